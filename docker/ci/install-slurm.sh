#!/usr/bin/env bash
# A one-node Slurm cluster for tests/test_slurm.py, on a Debian machine without systemd (CI: root, Debian apt
# reachable). Installs Debian's slurmctld, slurmd, munge and slurm-client, writes a slurm.conf for this one
# node (loopback only), starts munged, slurmctld and slurmd by hand, and waits until `srun hostname` runs.
# Idempotent: run it again and it only starts what is stopped (a changed slurm.conf restarts the daemons).
# Without an accounting store (slurmdbd) `sacct` has nothing: finished jobs are read with `scontrol show job`
# (kept MinJobAge seconds) and each finished job is also logged by jobcomp/filetxt.
#   env SLURM_PARTITION   the partition (default debug)
#       SLURM_MIN_JOB_AGE seconds slurmctld keeps a finished job for `scontrol show job` (default 300)
set -euo pipefail

partition=${SLURM_PARTITION:-debug}
min_job_age=${SLURM_MIN_JOB_AGE:-300}
started=$(date +%s)
say() { echo "install-slurm [$(( $(date +%s) - started ))s]: $*" >&2; }

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
        || ! command -v sbatch >/dev/null; then
    say "installing Debian's slurmctld, slurmd, munge, slurm-client"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends slurmctld slurmd munge slurm-client >&2
fi

# -- munge: one key, one daemon -------------------------------------------------------------------------
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    say "making a random munge key"
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    say "starting munged"
    rm -f /run/munge/munged.pid
    su -s /bin/sh munge -c /usr/sbin/munged
    for _ in $(seq 20); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.5; done
    munge -n | unmunge >/dev/null || { say "munged does not answer"; exit 1; }
fi

# -- slurm.conf: this node, its cores and memory, one partition ----------------------------------------------
node=$(hostname -s)
cpus=$(nproc)
# a little under what the machine has: slurmd drains a node whose RealMemory is more than it finds
memory=$(awk '/^MemTotal:/ { printf "%d", $2 / 1024 * 0.95 }' /proc/meminfo)
install -d -m 0755 /etc/slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm /run/slurm
conf=$(cat <<EOF
# written by ddp-course docker/ci/install-slurm.sh: one node, loopback only
ClusterName=ddpcourse
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
# no systemd and no cgroup plugin: track a job's processes by parentage, bind no cores
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
ReturnToService=2
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
# no slurmdbd here: sacct has nothing; finished jobs stay in scontrol for MinJobAge s and go to the jobcomp file
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=/var/log/slurm/jobcomp.log
MinJobAge=$min_job_age
# a cancelled or timed-out job's processes get SIGTERM, then SIGKILL this many seconds later
KillWait=10
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=$partition Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
)
changed=0
if [[ ! -f /etc/slurm/slurm.conf ]] || [[ "$(cat /etc/slurm/slurm.conf)" != "$conf" ]]; then
    say "writing /etc/slurm/slurm.conf ($node: $cpus CPUs, $memory MiB, partition $partition)"
    printf '%s\n' "$conf" > /etc/slurm/slurm.conf
    changed=1
fi

running() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
stop() {
    if running "$1"; then
        kill "$(cat "$1")"
        for _ in $(seq 20); do running "$1" || break; sleep 0.5; done
    fi
}
if (( changed )); then
    stop /run/slurm/slurmd.pid
    stop /run/slurm/slurmctld.pid
fi
if ! running /run/slurm/slurmctld.pid; then
    say "starting slurmctld"
    slurmctld
fi
for _ in $(seq 60); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.5; done
scontrol ping | grep -q UP || { say "slurmctld does not answer; see /var/log/slurm/slurmctld.log"; exit 1; }
if ! running /run/slurm/slurmd.pid; then
    say "starting slurmd"
    slurmd
fi

# -- ready: the node is idle and runs a job -------------------------------------------------------------------
state=""
for _ in $(seq 120); do
    state=$(sinfo -h -n "$node" -o %T 2>/dev/null | head -n1)
    case $state in
        idle|mixed|allocated|completing) break ;;
        down*|drain*) scontrol update NodeName="$node" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 0.5
done
case $state in
    idle|mixed|allocated|completing) ;;
    *) say "node $node is '$state', not idle; see /var/log/slurm/slurmd.log"; exit 1 ;;
esac
got=$(timeout 120 srun --partition="$partition" -N1 -n1 --time=1 hostname) \
    || { say "srun hostname failed; see /var/log/slurm/"; exit 1; }
[[ $got == "$node" ]] || { say "srun hostname printed '$got', expected '$node'"; exit 1; }
say "Slurm $(sinfo -V | awk '{ print $2 }') is up: node $node $state, partition $partition ($cpus CPUs, $memory MiB)"
