#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for CI and for trying scripts/slurm/train.sbatch.
#
#   scripts/slurm/local-cluster.sh start    # as root on Debian: apt-get installs slurm-wlm + munge if
#                                           # missing, writes /etc/slurm/slurm.conf, starts munged,
#                                           # slurmctld, slurmd; returns once `sinfo` shows the node idle
#   scripts/slurm/local-cluster.sh stop     # kills exactly the daemons `start` started
#   scripts/slurm/local-cluster.sh status
#
# The node advertises LOCAL_SLURM_CPUS (default 4) CPUs whatever the machine has
# (SlurmdParameters=config_overrides), so a 4-task CPU job fits on a 2-core machine.
# State (pids, logs, spool) lives in LOCAL_SLURM_STATE (default /tmp/megatron-rails-slurm).
# It never overwrites a slurm.conf it did not write, and exits 0 without doing anything when it
# cannot run here (not root, no apt-get and no Slurm): callers then see no cluster and skip.
set -uo pipefail

STATE=${LOCAL_SLURM_STATE:-/tmp/megatron-rails-slurm}
CPUS=${LOCAL_SLURM_CPUS:-4}
CONF=/etc/slurm/slurm.conf
MARK="# written by megatron-rails scripts/slurm/local-cluster.sh"
log() { echo "local-cluster: $*" >&2; }

have_slurm() { command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
               && command -v munged >/dev/null; }

install_packages() {
    have_slurm && return 0
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        log "Slurm is not installed and this is not root on Debian: skipping"; return 1
    fi
    log "installing slurm-wlm and munge with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    # services must not start from the package scripts: we start the daemons ourselves
    local policy=/usr/sbin/policy-rc.d added=0
    if [ ! -e $policy ]; then printf '#!/bin/sh\nexit 101\n' >$policy && chmod +x $policy && added=1; fi
    (apt-get install -y -q --no-install-recommends slurm-wlm munge >"$STATE/apt.log" 2>&1 \
        || { apt-get update -q >>"$STATE/apt.log" 2>&1 \
             && apt-get install -y -q --no-install-recommends slurm-wlm munge >>"$STATE/apt.log" 2>&1; })
    local rc=$?
    [ $added = 1 ] && rm -f $policy
    if [ $rc != 0 ]; then log "apt-get failed (see $STATE/apt.log)"; tail -5 "$STATE/apt.log" >&2; return 1; fi
    have_slurm
}

write_conf() {
    if [ -e $CONF ] && ! grep -qF "$MARK" $CONF; then
        log "$CONF exists and was not written by this script: refusing to touch it"; return 1
    fi
    local host; host=$(hostname -s)
    mkdir -p /etc/slurm "$STATE/ctld" "$STATE/d" "$STATE/log"
    cat >$CONF <<EOF
$MARK
ClusterName=mrails
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
MinJobAge=600
SlurmdParameters=config_overrides
NodeName=$host NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

start_munge() {
    if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi  # one already runs
    mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
    local user=root
    id munge >/dev/null 2>&1 && user=munge
    [ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null
    chown -R $user: /etc/munge /run/munge /var/lib/munge /var/log/munge
    chmod 0700 /etc/munge && chmod 0400 /etc/munge/munge.key
    if [ $user = munge ]; then runuser -u munge -- munged; else munged --force; fi || return 1
    pgrep -n -x munged >"$STATE/munged.pid"
}

start() {
    mkdir -p "$STATE"
    if sinfo -h -o %T 2>/dev/null | grep -q idle; then log "a Slurm cluster already answers: nothing to start"; return 0; fi
    install_packages || return 0
    write_conf || return 1
    start_munge || { log "munged failed to start"; return 1; }
    slurmctld -c -i || { log "slurmctld failed (see $STATE/log/slurmctld.log)"; return 1; }
    slurmd -b || { log "slurmd failed (see $STATE/log/slurmd.log)"; return 1; }
    for _ in $(seq 60); do
        if sinfo -h -o %T 2>/dev/null | grep -q idle; then log "up: $(sinfo -h -o '%N %c CPUs %T')"; return 0; fi
        scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1
        sleep 1
    done
    log "the node did not become idle"; sinfo >&2; tail -5 "$STATE/log/slurmctld.log" "$STATE/log/slurmd.log" >&2
    return 1
}

stop() {
    local name pid
    for name in slurmd slurmctld munged; do
        [ -s "$STATE/$name.pid" ] || continue
        pid=$(cat "$STATE/$name.pid")
        if [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = "$name" ]; then
            kill "$pid" && for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            log "stopped $name ($pid)"
        fi
        rm -f "$STATE/$name.pid"
    done
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) sinfo 2>/dev/null || { echo "no Slurm cluster answers"; exit 1; } ;;
    -h|--help) echo "usage: $0 start|stop|status (see the comment at the top of this script)" ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
