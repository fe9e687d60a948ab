#!/usr/bin/env bash
# deploy/docker-ci.sh CMD [ARG...]: run CMD with a Docker engine and local base images, on a
# Debian bookworm host as root where no image registry is reachable (CI, `make test-compose`).
#
# 1. Installs what is missing: docker.io, debootstrap and nftables from Debian, and the compose v2
#    and buildx CLI plugins from Debian trixie (pinned; bookworm only has compose v1), unpacked
#    into /usr/local/lib/docker/cli-plugins without touching the system's apt sources.
# 2. Starts dockerd when no engine answers, and keeps its PID.
# 3. Builds the base images once (skipped while they exist): local/debian:bookworm
#    (debootstrap), local/hicache-python:3.11 for python:3.11-slim and local/hicache-redis:7 for
#    redis:7-alpine (deploy/ci/*.Dockerfile). CMD gets their names in HICACHE_PYTHON_IMAGE and
#    HICACHE_REDIS_IMAGE, which the Dockerfile and compose files take in place of the official
#    images, and HICACHE_REQUIRE_DOCKER=1 (the compose tests then fail, never skip, without Docker).
# 4. Runs CMD, then stops only what it started (dockerd and its containerd) and undoes the
#    network changes dockerd made (its bridges, its nft tables, net.ipv4.ip_forward). Images stay
#    cached in /var/lib/docker. Exits with CMD's status.
set -euo pipefail

COMPOSE_VERSION=2.26.1-4 # docker-compose in Debian trixie
BUILDX_VERSION=0.13.1+ds1-3 # docker-buildx in Debian trixie
PLUGINS=/usr/local/lib/docker/cli-plugins
DEBIAN_IMAGE=local/debian:bookworm
PYTHON_IMAGE=local/hicache-python:3.11
REDIS_IMAGE=local/hicache-redis:7
STATE=${HICACHE_DOCKER_STATE:-/var/tmp/hicache-docker-ci}
HERE=$(cd "$(dirname "$0")" && pwd)

log() { echo "docker-ci: $*" >&2; }
[ $# -gt 0 ] || { echo "usage: $0 CMD [ARG...]" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { log "needs root (it installs packages and starts dockerd)"; exit 2; }
mkdir -p "$STATE"

# The mirror apt already uses (deb822 or one-line sources), for debootstrap and trixie.
mirror() {
  grep -hsE '^(URIs:|deb )' /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list \
    | grep -o 'https\?://[^ ]*/debian' | head -n 1 || true
}

install_missing() {
  local need=()
  command -v dockerd >/dev/null || need+=(docker.io)
  command -v debootstrap >/dev/null || need+=(debootstrap)
  command -v nft >/dev/null || need+=(nftables)
  if [ ${#need[@]} -gt 0 ]; then
    log "installing ${need[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  fi
  [ -x "$PLUGINS/docker-compose" ] && [ -x "$PLUGINS/docker-buildx" ] && return
  local m apt="$STATE/apt"
  m=$(mirror)
  [ -n "$m" ] || { log "no Debian mirror in /etc/apt/sources.list*"; exit 1; }
  log "fetching docker-compose $COMPOSE_VERSION and docker-buildx $BUILDX_VERSION from trixie"
  mkdir -p "$apt/lists/partial" "$apt/archives/partial" "$apt/root"
  echo "deb $m trixie main" >"$apt/sources.list"
  local opts=(-o "Dir::Etc::sourcelist=$apt/sources.list" -o Dir::Etc::sourceparts=- -o APT::Sandbox::User=root \
    -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache::archives=$apt/archives")
  apt-get "${opts[@]}" update -qq
  (cd "$apt/archives" && apt-get "${opts[@]}" download \
    "docker-compose=$COMPOSE_VERSION" "docker-buildx=$BUILDX_VERSION")
  for deb in "$apt"/archives/docker-compose_*.deb "$apt"/archives/docker-buildx_*.deb; do
    dpkg -x "$deb" "$apt/root"
  done
  install -D -m 755 -t "$PLUGINS" "$apt/root/usr/libexec/docker/cli-plugins/docker-compose" \
    "$apt/root/usr/libexec/docker/cli-plugins/docker-buildx"
}

# ---- the engine, and undoing what it changed ------------------------------------------------
DOCKERD_PID=
FORWARD_BEFORE=
LINKS_BEFORE=
TABLES_BEFORE=
start_dockerd() {
  if docker info >/dev/null 2>&1; then
    log "using the Docker engine that already answers"
    return
  fi
  FORWARD_BEFORE=$(cat /proc/sys/net/ipv4/ip_forward)
  LINKS_BEFORE=$(ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1)
  TABLES_BEFORE=$(nft list tables)
  setsid dockerd >"$STATE/dockerd.log" 2>&1 </dev/null &
  DOCKERD_PID=$!
  echo "$DOCKERD_PID" >"$STATE/dockerd.pid"
  trap stop_dockerd EXIT
  trap 'exit 130' INT TERM
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && { log "dockerd started (pid $DOCKERD_PID)"; return; }
    kill -0 "$DOCKERD_PID" 2>/dev/null || break
    sleep 0.5
  done
  log "dockerd did not answer; its log:"
  tail -n 30 "$STATE/dockerd.log" >&2
  exit 1
}

stop_dockerd() {
  [ -n "$DOCKERD_PID" ] || return 0
  log "stopping dockerd (pid $DOCKERD_PID) and undoing its network changes"
  kill -TERM "$DOCKERD_PID" 2>/dev/null || true
  for _ in $(seq 1 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
  kill -KILL "$DOCKERD_PID" 2>/dev/null || true
  local link table
  for link in $(ip -o link show type bridge | awk -F': ' '{print $2}'); do
    [[ $link == docker0 || $link == br-* ]] || continue
    grep -qxF "$link" <<<"$LINKS_BEFORE" || ip link delete "$link" 2>/dev/null || true
  done
  while read -r table; do # "table FAMILY NAME", split into nft's words on purpose
    # shellcheck disable=SC2086
    [ -n "$table" ] && ! grep -qxF "$table" <<<"$TABLES_BEFORE" && nft delete $table || true
  done < <(nft list tables)
  echo "$FORWARD_BEFORE" >/proc/sys/net/ipv4/ip_forward
  rm -f "$STATE/dockerd.pid"
}

# ---- the base images ------------------------------------------------------------------------
have_image() { docker image inspect "$1" >/dev/null 2>&1; }

build_images() {
  if ! have_image "$DEBIAN_IMAGE"; then
    local rootfs="$STATE/rootfs"
    log "debootstrap bookworm into $rootfs"
    rm -rf "$rootfs"
    debootstrap --variant=minbase bookworm "$rootfs" "$(mirror)" >"$STATE/debootstrap.log" 2>&1 \
      || { tail -n 20 "$STATE/debootstrap.log" >&2; exit 1; }
    tar -C "$rootfs" -c . | docker import --change 'CMD ["bash"]' \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$DEBIAN_IMAGE" >/dev/null
    rm -rf "$rootfs"
  fi
  if ! have_image "$PYTHON_IMAGE"; then
    local ctx="$STATE/python-context"
    rm -rf "$ctx" && mkdir -p "$ctx/ca" "$ctx/wheels"
    cp /usr/local/share/ca-certificates/*.crt "$ctx/ca/" 2>/dev/null || true
    # the host's CPU torch wheel, where its pip config names a local find-links folder
    local links
    links=$(python3 -m pip config get global.find-links 2>/dev/null || true)
    [ -n "$links" ] && cp "$links"/torch-*cpu*.whl "$ctx/wheels/" 2>/dev/null || true
    # PyPI stays an extra index: the Dockerfiles' --index-url (PyTorch's CPU index) is not
    # reachable here, and retries = 2 gives up on it quickly
    cat >"$ctx/pip.conf" <<'EOF'
[global]
find-links = /opt/wheels
extra-index-url = https://pypi.org/simple
cert = /etc/ssl/certs/ca-certificates.crt
retries = 2
EOF
    docker build -q -t "$PYTHON_IMAGE" --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE" \
      -f "$HERE/ci/python.Dockerfile" "$ctx" >/dev/null
  fi
  have_image "$REDIS_IMAGE" || docker build -q -t "$REDIS_IMAGE" --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE" \
    -f "$HERE/ci/redis.Dockerfile" "$HERE/ci" >/dev/null
}

install_missing
start_dockerd
build_images
log "images ready: $PYTHON_IMAGE, $REDIS_IMAGE"
rc=0
HICACHE_PYTHON_IMAGE=$PYTHON_IMAGE HICACHE_REDIS_IMAGE=$REDIS_IMAGE HICACHE_REQUIRE_DOCKER=1 "$@" || rc=$?
exit $rc
