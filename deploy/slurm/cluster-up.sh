#!/usr/bin/env bash
# A real, throwaway Slurm cluster on this one host, for tests and for trying the batch
# scripts: munged + slurmctld + N slurmd daemons acting as virtual nodes n1..nN, all on
# 127.0.0.1 (each slurmd on its own port). Run as root. Installs Debian's slurmctld,
# slurmd, slurm-client and munge when they are missing.
#
#   eval "$(deploy/slurm/cluster-up.sh | tail -1)"    # exports SLURM_CONF
#   sbatch deploy/slurm/psgd.sbatch ...
#   deploy/slurm/cluster-down.sh
#
# Partitions: `debug` (all nodes, the default), `cpu` (n1) and `gpu` (n2..nN), so that the
# heterogeneous job (deploy/slurm/psgd-hetjob.sbatch: servers on `cpu`, workers on `gpu`)
# runs here: the components of a hetjob never share a node. There are no real GPUs.
#
# Settings (environment):
#   SLURMCI_DIR    state, logs, slurm.conf          (default /tmp/psgd-slurm)
#   SLURMCI_NODES  virtual nodes, at least 2        (default 3)
#   SLURMCI_CPUS   CPUs each node claims            (default 4; may exceed real cores)
#   SLURMCI_PORT   slurmctld port; slurmd n<i> listens on PORT+i  (default 16817)
# The last line printed is `export SLURM_CONF=...`: every sbatch/srun/squeue needs it.
set -euo pipefail
DIR=${SLURMCI_DIR:-/tmp/psgd-slurm}
NODES=${SLURMCI_NODES:-3}
CPUS=${SLURMCI_CPUS:-4}
PORT=${SLURMCI_PORT:-16817}
export DEBIAN_FRONTEND=noninteractive
say() { echo "cluster-up: $*" >&2; }
[ "$(id -u)" = 0 ] || { say "must run as root (munged, slurmd)"; exit 1; }
[ "$NODES" -ge 2 ] || { say "SLURMCI_NODES must be >= 2"; exit 1; }
export SLURM_CONF="$DIR/slurm.conf"

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

if alive "$DIR/slurmctld.pid"; then
  say "already running (slurmctld pid $(cat "$DIR/slurmctld.pid"))"
  sinfo -N >&2 || true
  echo "export SLURM_CONF=$SLURM_CONF"
  exit 0
fi

# --- packages ----------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
   || ! command -v munged >/dev/null; then
  say "installing slurmctld slurmd slurm-client munge"
  timeout 600 apt-get update -qq
  timeout 900 apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi

mkdir -p "$DIR"/state "$DIR"/log
# --- munge: no systemd here, so start it by hand (as the munge user) -----------------
[ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged
  touch "$DIR/munged.ours"          # cluster-down.sh stops only a munged we started
  for _ in $(seq 100); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi
munge -n | unmunge >/dev/null || { say "munged does not answer"; exit 1; }

# --- slurm.conf (kept out of /etc: clients find it through SLURM_CONF) ---------------
for i in $(seq "$NODES"); do mkdir -p "$DIR/spool/n$i"; done
cat > "$SLURM_CONF" <<CONF
ClusterName=psgdci
SlurmctldHost=localhost
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=15
MinJobAge=600
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
NodeName=n[1-$NODES] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[$((PORT + 1))-$((PORT + NODES))] CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP
PartitionName=cpu Nodes=n1 MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=n[2-$NODES] MaxTime=INFINITE State=UP
CONF

# --- daemons ---------------------------------------------------------------------------
slurmctld -i                          # -i: ignore state left by an earlier cluster
for i in $(seq "$NODES"); do slurmd -N "n$i"; done
ok=0
for _ in $(seq 150); do               # at most ~30 s
  if [ "$(sinfo -h -p debug -o '%t' 2>/dev/null | sort -u)" = idle ]; then ok=1; break; fi
  sleep 0.2
done
sinfo -N >&2 || true
if [ $ok != 1 ]; then
  say "nodes did not become idle; see $DIR/log"; tail -n 20 "$DIR"/log/*.log >&2 || true; exit 1
fi
echo "export SLURM_CONF=$SLURM_CONF"
