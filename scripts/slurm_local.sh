#!/usr/bin/env bash
# A single-node SLURM cluster with accounting on this machine, for tests/test_slurm.py
# (Debian slurm-wlm, slurmdbd, munge, mariadb-server; scripts/setup.sh installs them as root):
#
#   scripts/slurm_local.sh start DIR     state, logs and the database under DIR; starts munged,
#                                        mariadbd, slurmdbd, slurmctld, slurmd
#   scripts/slurm_local.sh stop DIR      stops them and removes /etc/slurm/slurm.conf
#
# The config must be /etc/slurm/slurm.conf: the job-step side of snakemake-executor-plugin-slurm
# drops every SLURM_* variable (SLURM_CONF too) before its inner srun. An existing slurm.conf not
# written by this script is never touched (start fails). Runs as root. The node advertises 8 CPUs
# and 64 GB (SlurmdParameters=config_overrides) whatever the machine has, so jobs can ask for the
# SLURM profile's per-rule resources on a small VM; without cgroups nothing is enforced beyond the
# allocation itself, which sacct reports.
set -euo pipefail
# The daemons must not inherit the CPU BLAS preload that `make test` and the Snakefile set
# (vqpipe/blas.py): under Debian's OpenBLAS preload mariadb-install-db aborts ("Can't initialize
# timers"). Jobs get the preload back from the Snakefile, which sets it for every job it runs.
unset LD_PRELOAD
cmd=$1
dir=$(realpath -m "$2")
host=$(hostname -s)
conf=/etc/slurm/slurm.conf
marker="# written by vqpipe scripts/slurm_local.sh"
port=${VQPIPE_SLURM_PORT:-16817}

wait_for() {  # wait_for SECONDS WHAT COMMAND...
  local n=$1 what=$2; shift 2
  for _ in $(seq "$n"); do "$@" >/dev/null 2>&1 && return 0; sleep 1; done
  echo "slurm_local: $what did not come up; logs in $dir/log" >&2
  tail -n 20 "$dir"/log/*.log >&2 || true
  exit 1
}

case "$cmd" in
start)
  if [ -e "$conf" ] && ! head -n1 "$conf" | grep -qF "$marker"; then
    echo "slurm_local: $conf exists and is not ours; not touching a real SLURM setup" >&2
    exit 3
  fi
  mkdir -p "$dir"/{state,spool,log,munge,db} /etc/slurm /run/mysqld /run/munge
  # The default socket: sacctmgr (22.05) ignores AuthInfo=socket=...
  munged --force --num-threads=10 --pid-file="$dir/munge/munged.pid" \
    --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed"

  [ -d "$dir/db/mysql" ] || mariadb-install-db --user=root --datadir="$dir/db" \
    --auth-root-authentication-method=socket >"$dir/log/mariadb-install.log" 2>&1
  mariadbd --user=root --datadir="$dir/db" --socket=/run/mysqld/mysqld.sock --skip-networking \
    --pid-file="$dir/mariadbd.pid" --log-error="$dir/log/mariadbd.log" --innodb-buffer-pool-size=32M &
  wait_for 60 mariadbd mariadb --socket=/run/mysqld/mysqld.sock -e "select 1"

  cat > "$dir/slurmdbd.conf" <<CONF
AuthType=auth/munge
DbdHost=$host
DbdPort=$((port + 2))
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=vqpipe_slurm_acct
PidFile=$dir/slurmdbd.pid
LogFile=$dir/log/slurmdbd.log
CONF
  chmod 600 "$dir/slurmdbd.conf"
  SLURM_CONF=$dir/slurmdbd.conf slurmdbd

  cat > "$conf" <<CONF
$marker (state in $dir)
ClusterName=vqpipe
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldPort=$port
SlurmdPort=$((port + 1))
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$host
AccountingStoragePort=$((port + 2))
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=3600
MpiDefault=none
AccountingStoreFlags=job_comment
NodeName=$host CPUs=8 RealMemory=64000 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
  wait_for 60 slurmdbd sacctmgr -n list cluster
  sacctmgr -i add cluster vqpipe >/dev/null 2>&1 || true
  sacctmgr -i add account vqpipe-ci cluster=vqpipe >/dev/null 2>&1 || true
  sacctmgr -i add user root account=vqpipe-ci >/dev/null 2>&1 || true
  slurmctld
  slurmd
  wait_for 60 "the node" bash -c "sinfo -h -o %T | grep -qE '^(idle|mixed|allocated)'"
  ;;
stop)
  for pid in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/slurmdbd.pid" "$dir/mariadbd.pid" "$dir/munge/munged.pid"; do
    if [ -f "$pid" ]; then kill "$(cat "$pid")" 2>/dev/null || true; fi
    for _ in $(seq 20); do kill -0 "$(cat "$pid" 2>/dev/null)" 2>/dev/null || break; sleep 0.5; done
  done
  if [ -e "$conf" ] && head -n1 "$conf" | grep -qF "$marker"; then rm -f "$conf"; fi
  ;;
*) echo "usage: $0 start|stop DIR" >&2; exit 2 ;;
esac
