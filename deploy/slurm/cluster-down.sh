#!/usr/bin/env bash
# Stops the cluster that cluster-up.sh started (same SLURMCI_DIR): cancels its jobs,
# shuts down slurmctld and every slurmd, stops munged if cluster-up.sh started it, and
# removes the folder. Safe to run twice, or when nothing is running.
DIR=${SLURMCI_DIR:-/tmp/psgd-slurm}
export SLURM_CONF="$DIR/slurm.conf"
[ -f "$SLURM_CONF" ] || { echo "cluster-down: no cluster in $DIR" >&2; exit 0; }

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

if alive "$DIR/slurmctld.pid"; then
  timeout 10 scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
  for _ in $(seq 100); do           # at most ~20 s for the jobs' processes to end
    [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break
    sleep 0.2
  done
  timeout 10 scontrol shutdown 2>/dev/null || true   # stops slurmctld and every slurmd
fi
for _ in $(seq 100); do
  left=0
  for f in "$DIR"/slurmctld.pid "$DIR"/slurmd-*.pid; do alive "$f" && left=1; done
  [ $left = 0 ] && break
  sleep 0.1
done
for f in "$DIR"/slurmctld.pid "$DIR"/slurmd-*.pid; do   # by pid, only ours
  alive "$f" && kill -9 "$(cat "$f")" 2>/dev/null
done
# munged serves every Slurm on this host: stop it only if cluster-up.sh started it and no
# other slurmctld (another cluster-up.sh cluster) still needs it.
other_slurmctld() {   # a live one (orphaned daemons may linger as zombies here)
  local p
  for p in $(pgrep -x slurmctld); do
    [ "$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null)" = Z ] || return 0
  done
  return 1
}
if [ -e "$DIR/munged.ours" ] && ! other_slurmctld; then
  munged --stop 2>/dev/null || true
fi
rm -rf "$DIR"
echo "cluster-down: stopped" >&2
