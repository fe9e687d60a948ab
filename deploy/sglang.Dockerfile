# SGLang's image with hicache installed into its Python, so that SGLang can load
# hicache.integrations.sglang as its HiCache storage backend (deploy/compose.gpu.yml builds
# it from the repository root). pip keeps the image's torch (hicache needs torch>=2.4) and
# builds hicache's C extension with the image's compiler.
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23
FROM ${SGLANG_IMAGE}
COPY . /opt/hicache
RUN pip install --no-cache-dir /opt/hicache \
    && python -c "import hicache.integrations.sglang"
