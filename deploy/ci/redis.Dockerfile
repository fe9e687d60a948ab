# A stand-in for redis:7-alpine where no image registry is reachable (deploy/docker-ci.sh builds
# it as local/hicache-redis:7): Debian's redis-server 7.0 and redis-cli. The official image
# compiles protected mode off (compose's services reach Redis over their own network); here a
# wrapper first on PATH adds `--protected-mode no` to every redis-server command line.
ARG DEBIAN_IMAGE=local/debian:bookworm
FROM ${DEBIAN_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && printf '#!/bin/sh\nexec /usr/bin/redis-server "$@" --protected-mode no\n' > /usr/local/bin/redis-server \
 && chmod 755 /usr/local/bin/redis-server
EXPOSE 6379
CMD ["redis-server"]
