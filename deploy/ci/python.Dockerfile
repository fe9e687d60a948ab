# A stand-in for python:3.11-slim where no image registry is reachable (deploy/docker-ci.sh
# builds it as local/hicache-python:3.11): Debian's Python 3.11 in a venv on PATH, so `python`
# and `pip` behave as in the official image, with the host's CA certificates and a pip config
# (context/pip.conf) whose find-links folder holds the host's CPU torch wheel.
ARG DEBIAN_IMAGE=local/debian:bookworm
FROM ${DEBIAN_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates python3 python3-venv python3-dev \
 && rm -rf /var/lib/apt/lists/*
COPY ca/ /usr/local/share/ca-certificates/
COPY wheels/ /opt/wheels/
COPY pip.conf /etc/pip.conf
RUN update-ca-certificates && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PIP_CONFIG_FILE=/etc/pip.conf
CMD ["python3"]
