# hicache sidecar image: `hicache-server` by default; `hicache demo --sidecar ...` runs the
# example engine (compose's `engine` service) from the same image.
#   CPU (default):  docker build -t hicache .
#   CUDA:           docker build -t hicache:cuda --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#                       --build-arg EXTRAS="[cuda,storage]" --build-arg KEEP_CC=1 .
# KEEP_CC=1 keeps gcc in the image: on CUDA, Triton compiles its launcher with the C compiler
# at run time (the first kernel launch); the CPU image needs none after the build.
# PYTHON_IMAGE: the base, python:3.11-slim; CI, with no image registry, passes a local stand-in
# (deploy/docker-ci.sh).
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS="[storage]"
ARG KEEP_CC=0

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HICACHE_SOCKET=/run/hicache/hicache.sock

# A fixed non-root uid: the engine must run as the same uid to use the 0600 socket.
RUN useradd --create-home --uid 1000 hicache \
 && mkdir -p /run/hicache /var/lib/hicache \
 && chown hicache:hicache /run/hicache /var/lib/hicache

WORKDIR /app
RUN pip install torch==${TORCH_VERSION} --index-url ${TORCH_INDEX}
COPY pyproject.toml setup.py README.md ./
COPY hicache ./hicache
COPY server ./server
COPY proto ./proto
# gcc for the build of the C copy extension (hicache/transfer/_native*.c); removed afterwards
# unless KEEP_CC=1 (CUDA: Triton needs it at run time). Not pinned (DL3008): Debian drops old
# versions of these packages from its archive, so a pin would break the build, and they only
# compile. The pip install is this checkout itself (DL3013); its dependencies follow
# pyproject.toml. `python -P`: import the installed package, not the source folder.
# hadolint ignore=DL3008,DL3013
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && pip install ".${EXTRAS}" \
 && python -P -c "from hicache.transfer import native; assert native.available(), 'C extension not built'" \
 && if [ "${KEEP_CC}" != "1" ]; then apt-get purge -y gcc libc6-dev && apt-get autoremove -y; fi \
 && rm -rf /var/lib/apt/lists/*

# the numeric uid of the hicache user created above (DL3066: resolvable on the host too)
USER 1000
# /run/hicache: the socket (share it with the engine); /var/lib/hicache: the file tier.
VOLUME ["/run/hicache", "/var/lib/hicache"]
EXPOSE 9400
HEALTHCHECK --interval=5s --timeout=3s --start-period=30s --retries=3 CMD ["hicache", "health"]
ENTRYPOINT ["hicache-server"]
CMD ["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", "{\"dir\": \"/var/lib/hicache/pages\"}"]
