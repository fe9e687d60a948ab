# hicache sidecar image. CPU torch by default; --build-arg TORCH_INDEX=<cuda wheel index> for CUDA.
FROM python:3.11-slim
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""
RUN useradd --create-home --uid 1000 hicache
WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY hicache ./hicache
COPY server ./server
COPY proto ./proto
RUN pip install --no-cache-dir torch==${TORCH_VERSION} --index-url ${TORCH_INDEX} \
 && pip install --no-cache-dir ".${EXTRAS}"
USER hicache
ENTRYPOINT ["hicache"]
CMD ["demo"]
