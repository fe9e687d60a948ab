# SGLang 0.5.23's server on CPU with hicache installed as its storage backend
# (hicache.integrations.sglang), as `make sglang-env` builds .venv-sglang: the CPU torch, then
# requirements-sglang.txt with --no-deps (SGLang pins a CUDA torch), then hicache, and the
# stand-ins for SGLang's CPU gaps from tests/integrations/sglang_server/standins, active only
# under SGLANG_USE_CPU_ENGINE=1. deploy/compose.cpu.yml builds it from the repository root.
#   PYTHON_IMAGE: python:3.11-slim; CI passes its local stand-in (deploy/docker-ci.sh).
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HOME=/tmp SGLANG_USE_CPU_ENGINE=1
# SGLang builds a small C++ extension with torch's cpp_extension on first use (get_hash_str):
# g++, ninja and OpenSSL's headers stay in the image. Not pinned (DL3008, DL3013): see the
# Dockerfile at the root.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ ninja-build libssl-dev libnuma1 \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/hicache
COPY requirements-sglang.txt ./
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# hadolint ignore=DL3013
RUN pip install --no-cache-dir torch==${TORCH_VERSION} --index-url ${TORCH_INDEX} \
 && pip install --no-cache-dir --no-deps -r requirements-sglang.txt
COPY pyproject.toml setup.py README.md ./
COPY hicache ./hicache
COPY server ./server
COPY proto ./proto
COPY tests/integrations/sglang_server/standins ./standins
# hadolint ignore=DL3013
RUN pip install --no-cache-dir . \
 && printf '%s\nimport sglang_cpu_standins\n' /opt/hicache/standins \
      > "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/sglang_cpu_standins.pth" \
 && python -P -c "from hicache.transfer import native; assert native.available(), 'C extension not built'" \
 && SGLANG_USE_CPU_ENGINE=1 python -P -c "import sglang.srt.entrypoints.http_server, hicache.integrations.sglang" \
 && rm -rf /tmp/.cache
# not the source folder: `python -m` puts the working directory first on sys.path
WORKDIR /tmp
USER 1000
# SGLang's key hash extension (torch's cpp_extension), compiled here into ~/.cache as the
# user that runs it, instead of at the first request
RUN python -P -c "from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module as load; load()"
EXPOSE 30000
ENTRYPOINT ["python", "-m", "sglang.launch_server"]
