#!/usr/bin/env bash
# Smoke test of the Compose deployment on a real Docker engine, on a machine that cannot
# reach any image registry: run as root from anywhere in the repository.
#
#   bash deploy/compose-smoke.sh            # exit 0: the job ran, summary.json is good
#
# What it does, each step with a time limit:
#   1. installs Debian's docker.io and debootstrap if missing (and uses the Compose v2
#      plugin that .ci/deploy-deps.sh installs);
#   2. starts a private dockerd (own socket, data-root and exec-root under $SMOKE_DIR) with
#      no bridge network and no iptables: nothing is added to the host's network;
#   3. makes a base image locally: debootstrap (Debian bookworm, minbase, python3 +
#      python3-venv) | docker import (cached in $SMOKE_CACHE);
#   4. downloads the wheels (torch CPU 2.13.0, psgd's dependencies) with the host's pip
#      (cached) and builds deploy/docker/Dockerfile offline from a copy of the tree;
#   5. `docker compose -f deploy/compose.yaml -f deploy/compose.host.yaml up` (host
#      networking, loopback), then reads /data/run/summary.json out of the named volume
#      and checks final_accuracy >= target_accuracy;
#      with SMOKE_NETWORK=bridge instead: dockerd runs inside a network namespace made for
#      it (its bridge, iptables rules and containers stay in there) and the plain
#      deploy/compose.yaml runs on its own bridge network, as on a normal Docker host;
#   6. tears it all down: compose down -v, dockerd stopped, its mounts and folders removed.
#
# Settings: SMOKE_NETWORK (host | bridge; default host), SMOKE_DIR (default /tmp/psgd-compose-smoke), SMOKE_CACHE (default
# /var/tmp/psgd-smoke-cache), SMOKE_TIMEOUT_S for the compose run (default 900),
# DEPLOY_WORKERS (default 2), SMOKE_TORCH_INDEX_URL (where torch's wheel comes from; default the
# CPU index), SMOKE_KEEP=1 keeps the engine and the project running for a look around and
# prints the commands to use them; SMOKE_CLEANUP=1 then tears down what it kept.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
DIR=${SMOKE_DIR:-/tmp/psgd-compose-smoke}
CACHE=${SMOKE_CACHE:-/var/tmp/psgd-smoke-cache}
RUN_TIMEOUT=${SMOKE_TIMEOUT_S:-900}
NETWORK=${SMOKE_NETWORK:-host}
TORCH_INDEX=${SMOKE_TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}
case "$NETWORK" in host|bridge) ;; *) echo "SMOKE_NETWORK must be host or bridge" >&2; exit 2;; esac
BASE_IMAGE=localhost/psgd-base:bookworm
IMAGE=localhost/psgd:smoke
PROJECT=psgd-smoke
export DEBIAN_FRONTEND=noninteractive
T0=$SECONDS
say() { echo "[compose-smoke +$((SECONDS - T0))s] $*" >&2; }
die() { say "FAILED: $*"; exit 1; }
[ "$(id -u)" = 0 ] || die "run as root (dockerd, debootstrap)"

# ---- 1. tools ---------------------------------------------------------------------
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  say "installing ${need[*]}"
  timeout 300 apt-get update -qq
  timeout 900 apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
if ! docker compose version >/dev/null 2>&1 && [ -f "$REPO/.ci/deploy-deps.sh" ]; then
  timeout 900 bash "$REPO/.ci/deploy-deps.sh" >&2
fi
docker compose version >/dev/null 2>&1 || die "no docker compose plugin (see .ci/deploy-deps.sh)"

# ---- 2. a private engine ------------------------------------------------------------
mkdir -p "$DIR" "$CACHE"
SOCK="$DIR/docker.sock"
export DOCKER_HOST="unix://$SOCK" DOCKER_BUILDKIT=0 COMPOSE_BAKE=false
ULIMITS='"default-ulimits": {"nofile": {"Name": "nofile", "Hard": 20000, "Soft": 20000},
                     "nproc": {"Name": "nproc", "Hard": 32768, "Soft": 32768}}'
NS=""
IN_NS=()
FILES=(-f "$REPO/deploy/compose.yaml")
if [ "$NETWORK" = host ]; then
  # no bridge, no iptables: the engine adds nothing to the host's network
  echo "{\"bridge\": \"none\", \"iptables\": false, \"ip6tables\": false, \"ip-masq\": false, $ULIMITS}" \
    >"$DIR/daemon.json"
  FILES+=(-f "$REPO/deploy/compose.host.yaml")
else
  # the engine's bridges and iptables rules live in a network namespace of its own
  echo "{\"ip6tables\": false, $ULIMITS}" >"$DIR/daemon.json"
  NS=psgd-smoke-$$
  IN_NS=(nsenter --net="/run/netns/$NS")   # not `ip netns exec`: it remounts /sys (and hides the cgroups)
fi
DOCKERD_PID=""
CHILD=""
bounded() {  # SECONDS CMD...: run CMD with a time limit, in the background so that a
  # signal to this script is handled at once (bash runs traps only between commands)
  timeout "$@" &
  CHILD=$!
  wait "$CHILD"
  local rc=$?
  CHILD=""
  return $rc
}
cleanup() {
  code=$?
  [ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null
  if [ "${SMOKE_KEEP:-0}" = 1 ] && [ -n "$DOCKERD_PID" ]; then
    declare -p DOCKERD_PID NS FILES >"$DIR/kept.env"   # what SMOKE_CLEANUP=1 tears down
    say "SMOKE_KEEP=1: the engine (pid $DOCKERD_PID) and the project are left running. To use them, paste:"
    printf '  export DOCKER_HOST=%q DEPLOY_IMAGE=%q DEPLOY_PORT=%q DEPLOY_RUN=run\n' \
      "$DOCKER_HOST" "$IMAGE" "${PORT:-5555}" >&2
    printf '  alias dc=%q\n' "docker compose -p $PROJECT ${FILES[*]}" >&2
    printf '  dc ps -a; dc logs coordinator; dc cp coordinator:/data/run/summary.json .\n' >&2
    say "and to tear it all down afterwards: SMOKE_CLEANUP=1 bash $REPO/deploy/compose-smoke.sh"
    exit $code
  fi
  if [ -n "$DOCKERD_PID" ] && kill -0 "$DOCKERD_PID" 2>/dev/null; then
    timeout 120 docker compose -p "$PROJECT" "${FILES[@]}" \
      down -v --remove-orphans -t 30 >/dev/null 2>&1 || true
    kill -TERM "$DOCKERD_PID" 2>/dev/null || true
    for _ in $(seq 150); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$DOCKERD_PID" 2>/dev/null && kill -KILL "$DOCKERD_PID" 2>/dev/null
  fi
  # what the engine leaves mounted, deepest first
  if [ -d "$DIR" ]; then
    awk -v d="$DIR" '$2 ~ "^"d {print $2}' /proc/mounts | sort -r | while read -r m; do
      umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
    done
    rm -rf "$DIR"
  fi
  [ -n "$NS" ] && ip netns del "$NS" 2>/dev/null
  say "cleaned up (exit $code)"
  exit $code
}
trap cleanup EXIT
trap 'exit 130' INT TERM
if [ "${SMOKE_CLEANUP:-0}" = 1 ]; then   # tear down what a SMOKE_KEEP=1 run left running
  [ -f "$DIR/kept.env" ] || { SMOKE_KEEP=0; die "nothing kept in $DIR (no SMOKE_KEEP=1 run left there)"; }
  SMOKE_KEEP=0
  # shellcheck disable=SC1091
  . "$DIR/kept.env"
  exit 0
fi

if [ -n "$NS" ]; then
  ip netns add "$NS"
  ip -n "$NS" link set lo up
fi
say "starting dockerd ($DIR${NS:+, in network namespace $NS})"
"${IN_NS[@]}" dockerd --config-file "$DIR/daemon.json" --data-root "$DIR/data" --exec-root "$DIR/exec" \
  --pidfile "$DIR/dockerd.pid" -H "$DOCKER_HOST" >"$DIR/dockerd.log" 2>&1 &
DOCKERD_PID=$!
for _ in $(seq 150); do docker info >/dev/null 2>&1 && break; kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.2; done
docker info >/dev/null 2>&1 || { tail -20 "$DIR/dockerd.log" >&2; die "dockerd did not start"; }
say "engine $(docker version -f '{{.Server.Version}}') up"

# ---- 3. base image, made here ---------------------------------------------------------
if [ ! -s "$CACHE/base.tar" ]; then
  say "debootstrap bookworm (minbase + python3, python3-venv)"
  rm -rf "$CACHE/rootfs"
  bounded 900 debootstrap --variant=minbase --include=python3,python3-venv bookworm "$CACHE/rootfs" \
    "${SMOKE_MIRROR:-http://deb.debian.org/debian}" >"$CACHE/debootstrap.log" 2>&1 \
    || { tail -20 "$CACHE/debootstrap.log" >&2; die "debootstrap failed"; }
  rm -rf "$CACHE/rootfs"/var/cache/apt/archives/*.deb "$CACHE/rootfs"/var/lib/apt/lists/*
  tar -C "$CACHE/rootfs" -cf "$CACHE/base.tar.tmp" . && mv "$CACHE/base.tar.tmp" "$CACHE/base.tar"
  rm -rf "$CACHE/rootfs"
fi
timeout 300 docker import -c 'CMD ["/bin/bash"]' "$CACHE/base.tar" "$BASE_IMAGE" >/dev/null
say "base image $BASE_IMAGE imported"

# ---- 4. wheels and the image -----------------------------------------------------------
PYBIN=${SMOKE_PYTHON:-python3}
"$PYBIN" -c 'import sys; assert sys.version_info[:2] == (3, 11)' \
  || die "$PYBIN is not Python 3.11 (the base image's); set SMOKE_PYTHON"
if [ ! -e "$CACHE/wheels/.complete" ]; then
  say "downloading wheels into $CACHE/wheels"
  mkdir -p "$CACHE/wheels"
  # torch from the CPU index, as the Dockerfile's default TORCH_INDEX_URL: PyPI's torch for
  # Linux x86_64 is the CUDA build, several GB of nvidia-* wheels (SMOKE_TORCH_INDEX_URL=''
  # leaves the index to pip's own configuration)
  bounded 900 "$PYBIN" -m pip download -q --only-binary=:all: -d "$CACHE/wheels" \
    ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "torch==2.13.0" "pyzmq>=25" "msgpack>=1.0" "numpy>=1.24" "scikit-learn>=1.2" "setuptools>=61" wheel \
    >"$CACHE/pip.log" 2>&1 || { tail -20 "$CACHE/pip.log" >&2; die "pip download failed"; }
  touch "$CACHE/wheels/.complete"
fi
say "copying the tree into a build context"
rm -rf "$DIR/ctx" && mkdir -p "$DIR/ctx"
if git -C "$REPO" rev-parse >/dev/null 2>&1; then
  (cd "$REPO" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$DIR/ctx" 2>/dev/null || true)
else
  tar -C "$REPO" --exclude=.git --exclude=runs -cf - . | tar -C "$DIR/ctx" -xf -
fi
mkdir -p "$DIR/ctx/deploy/docker/wheels"
cp -l "$CACHE"/wheels/*.whl "$DIR/ctx/deploy/docker/wheels/" 2>/dev/null || cp "$CACHE"/wheels/*.whl "$DIR/ctx/deploy/docker/wheels/"
say "docker build (offline, legacy builder)"
bounded 1200 docker build --network none -q -f "$DIR/ctx/deploy/docker/Dockerfile" \
  --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg PIP_ARGS="--no-index --find-links /wheels" \
  -t "$IMAGE" "$DIR/ctx" >"$DIR/build.log" 2>&1 || { tail -30 "$DIR/build.log" >&2; die "docker build failed"; }
rm -rf "$DIR/ctx"
say "image $IMAGE built ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"

# ---- 5. the job ------------------------------------------------------------------------
free_ports() {  # three free ports in a row on 127.0.0.1, below the ephemeral range (psgd/launcher.py pick_port)
  "$PYBIN" - <<'PY'
import random
import socket
for _ in range(200):
    base = random.randrange(10000, 32000)
    socks = []
    try:
        for p in range(base, base + 3):
            t = socket.socket()
            socks.append(t)
            t.bind(("127.0.0.1", p))
        print(base)
        break
    except OSError:
        pass
    finally:
        for t in socks:
            t.close()
PY
}
PORT=${SMOKE_PORT:-$(free_ports)}
COMPOSE=(docker compose -p "$PROJECT" "${FILES[@]}")
export DEPLOY_IMAGE=$IMAGE DEPLOY_PORT=$PORT DEPLOY_RUN=run
"${COMPOSE[@]}" config --quiet || die "compose config"
if [ "$NETWORK" = host ]; then
  say "docker compose up (host network, loopback ports $PORT-$((PORT + 2)))"
else
  say "docker compose up (the project's bridge network, in network namespace $NS)"
fi
set +e
bounded "$RUN_TIMEOUT" "${COMPOSE[@]}" up --no-build --pull never --abort-on-container-failure \
  >"$DIR/compose-up.log" 2>&1
UP=$?
set -e
tail -n 25 "$DIR/compose-up.log" >&2
"${COMPOSE[@]}" ps -a --format '{{.Service}} {{.State}} {{.ExitCode}}' >&2 || true
[ $UP = 0 ] || die "docker compose up exited with $UP"
docker run --rm --network none -v "${PROJECT}_data:/data" --entrypoint cat "$IMAGE" /data/run/summary.json \
  >"$DIR/summary.json" || die "no summary.json in the volume"
docker run --rm --network none -v "${PROJECT}_data:/data" --entrypoint ls "$IMAGE" -l /data/run/checkpoints >&2 || true
"$PYBIN" - "$DIR/summary.json" <<'PY' || die "summary.json does not reach the target"
import json, sys
s = json.load(open(sys.argv[1]))
acc, target = s.get("final_accuracy"), s.get("target_accuracy", 0.9)
print(f"[compose-smoke] summary: mode {s['mode']}, {s['workers']} workers x {s['servers']} shards, "
      f"accuracy {acc}, target {target}, wall {s['wall_s']} s, samples {s['samples']}", file=sys.stderr)
sys.exit(0 if acc is not None and acc >= target else 1)
PY
cp "$DIR/summary.json" "$CACHE/last-summary.json"
say "PASSED in $((SECONDS - T0)) s"
