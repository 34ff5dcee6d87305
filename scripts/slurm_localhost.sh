#!/usr/bin/env bash
# A real Slurm (Debian's 22.05) on this one machine, for tests: slurmctld plus two slurmd nodes
# n0 and n1 (partition p0 holds n0, p1 holds n1), started as root without systemd. Heterogeneous
# jobs need each component on a different node, hence two slurmd. Recipe and timings:
# /work/shared/notes/slurm-on-localhost.md.
#   scripts/slurm_localhost.sh start   # prints SLURM_CONF=...; installs Slurm first if missing and root
#   scripts/slurm_localhost.sh stop    # stops the daemons this script started (by their PIDs)
#   scripts/slurm_localhost.sh status
# Environment: SLURM_LOCALHOST_DIR (state, logs, slurm.conf; default /tmp/megatron-het-slurm),
#              SLURM_LOCALHOST_PORT (slurmctld port, default 6817; slurmd use PORT+10000 and +10001).
set -euo pipefail
D=${SLURM_LOCALHOST_DIR:-/tmp/megatron-het-slurm}
PORT=${SLURM_LOCALHOST_PORT:-6817}
export SLURM_CONF=$D/slurm.conf

install_slurm() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null && return 0
  if [ "$(id -u)" != 0 ]; then
    echo "slurm_localhost: Slurm is not installed and we are not root; install slurmctld slurmd slurm-client" >&2
    exit 2
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client >/dev/null
}

write_conf() {
  cat > "$SLURM_CONF" <<CONF
ClusterName=megatronhet
SlurmctldHost=localhost
SlurmctldPort=$PORT
SlurmUser=root
AuthType=auth/none
CredType=cred/none
MailProg=/bin/true
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Backfill starts het jobs; every second instead of every 30 s. Finished jobs leave after 4 s.
SchedulerParameters=bf_interval=1
MinJobAge=4
ReturnToService=2
SlurmdParameters=config_overrides
NodeName=n0 NodeHostname=$(hostname -s) NodeAddr=127.0.0.1 Port=$((PORT + 10000)) CPUs=1 State=UNKNOWN
NodeName=n1 NodeHostname=$(hostname -s) NodeAddr=127.0.0.1 Port=$((PORT + 10001)) CPUs=1 State=UNKNOWN
PartitionName=p0 Nodes=n0 Default=YES MaxTime=INFINITE State=UP
PartitionName=p1 Nodes=n1 MaxTime=INFINITE State=UP
CONF
}

stop() {
  [ -f "$D/run/daemons.pids" ] || return 0
  while read -r pid; do kill "$pid" 2>/dev/null || true; done < "$D/run/daemons.pids"
  for _ in $(seq 50); do
    alive=0
    while read -r pid; do kill -0 "$pid" 2>/dev/null && alive=1; done < "$D/run/daemons.pids"
    [ "$alive" = 0 ] && break; sleep 0.1
  done
  rm -f "$D/run/daemons.pids"
}

start() {
  install_slurm
  stop
  rm -rf "$D"; mkdir -p "$D"/{state,log,run,spool/n0,spool/n1}
  write_conf
  # setsid: the daemons outlive this script; their PIDs go to a file for `stop`.
  setsid slurmctld -D -i >"$D/log/ctld.stdout" 2>&1 < /dev/null & echo $! >> "$D/run/daemons.pids"
  setsid slurmd -D -N n0 >"$D/log/n0.stdout" 2>&1 < /dev/null & echo $! >> "$D/run/daemons.pids"
  setsid slurmd -D -N n1 >"$D/log/n1.stdout" 2>&1 < /dev/null & echo $! >> "$D/run/daemons.pids"
  for _ in $(seq 60); do
    if [ "$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" = 2 ]; then
      echo "SLURM_CONF=$SLURM_CONF"
      return 0
    fi
    sleep 0.5
  done
  echo "slurm_localhost: nodes n0/n1 not idle after 30 s; logs in $D/log" >&2
  tail -n 5 "$D"/log/*.log "$D"/log/*.stdout >&2 || true
  stop
  exit 1
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) sinfo -N ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
