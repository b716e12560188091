#!/usr/bin/env bash
# A throw-away SLURM cluster on localhost for the tests (tests/slurm_cluster.py):
# munged, slurmctld and one slurmd per simulated node, all from Debian's
# packages, no systemd, everything (config, keys, sockets, spool, logs, pid
# files) under one directory.
#
#   scripts/slurm-cluster.sh install            apt-get the packages if missing (root + apt only)
#   scripts/slurm-cluster.sh start DIR [NODES]  start a cluster of NODES (default 2) nodes n1..nN
#   scripts/slurm-cluster.sh stop DIR           cancel its jobs, stop its daemons by pid
#   scripts/slurm-cluster.sh status DIR         sinfo + squeue
#   scripts/slurm-cluster.sh lose-node DIR NODE a node crash: SIGKILL to its slurmd, its slurmstepd
#                                               and every job process under them, all at once
#   scripts/slurm-cluster.sh revive-node DIR NODE  its slurmd again; waits until SLURM hears from it
#
# Clients find the cluster with `export SLURM_CONF=DIR/etc/slurm.conf` (start
# writes DIR/env with that line). Every slurmd runs on this host under its own
# node name (`slurmd -N n1`) and port; they share the hostname, so Open MPI's
# shared-memory transport must be kept off between them in multi-node jobs
# (OMPI_MCA_btl=self,tcp OMPI_MCA_btl_tcp_if_include=lo; the tests do that).
#
# Settings that matter here (each measured; see docs/slurm.md):
#   ProctrackType=proctrack/pgid      linuxproc left orphans after scancel
#   TaskPlugin=task/none              no cgroups in a container
#   SlurmdParameters=config_overrides nodes may declare more CPUs than the host has
#   MpiDefault=pmix                   Debian's Open MPI has no PMI2 (pmi2 and none fail)
#   TmpFS=DIR/tmp/%n                  two slurmd on one host otherwise share the PMIx directory
#   AuthInfo=...,cred_expire=5        a requeued job may start again 6 s after its requeue (slurmctld
#                                     waits cred_expire + 1 s; default 120, minimum 5)
#   SchedulerParameters=sched_interval=1,batch_sched_delay=0
#                                     a job starts within 1 s of its submission or its begin time
#                                     (slurmctld's background loop runs once a second), not 2-3 s
#   KillWait=2                        the ranks of a cancelled step that SIGTERM does not end (stuck in
#                                     a collective after a kill -9 of one of them) get SIGKILL 2 s later,
#                                     not 5; no test here saves at a time limit's SIGTERM (a site's
#                                     KillWait must cover a save: docs/slurm.md)
#   the daemons under a subreaper     a batch job that ran srun ended 3 s after its script (see REAPER)
set -euo pipefail

SLURM_PKGS="slurmctld slurmd slurm-client munge"
DAEMONS="munged slurmctld slurmd sbatch srun scontrol sinfo squeue scancel"

say() { printf 'slurm-cluster: %s\n' "$*"; }
die() { printf 'slurm-cluster: ERROR: %s\n' "$*" >&2; exit 1; }
# Debian puts munged in /usr/sbin, which a non-login PATH may lack
export PATH="$PATH:/usr/sbin:/sbin"

missing_binaries() {
    local b out=""
    for b in $DAEMONS; do command -v "$b" >/dev/null || out="$out $b"; done
    printf '%s' "$out"
}

cmd_install() {
    if [ -z "$(missing_binaries)" ]; then
        return 0
    fi
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        say "SLURM is not installed and this is not root with apt-get: the slurm tests will be skipped"
        return 0
    fi
    say "installing $SLURM_PKGS"
    export DEBIAN_FRONTEND=noninteractive
    # update only when the package lists do not know the packages yet
    apt-cache show slurmctld >/dev/null 2>&1 || apt-get -o DPkg::Lock::Timeout=600 update -qq
    # shellcheck disable=SC2086
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends $SLURM_PKGS >/dev/null
}

# Each daemon runs under a child subreaper (prctl PR_SET_CHILD_SUBREAPER) that waits for
# whatever is orphaned below it, as systemd does on a real node. Orphans are many here: slurmd
# starts each slurmstepd through a fork that exits, and srun leaves a child behind in the batch
# script's process group when it ends. Left to PID 1, a container's init reaped them 1-2 s late
# (measured here; another init may never), and slurmstepd (proctrack/pgid) waits for the batch
# script's process group to be empty, zombies included, sleeping 1 s, then 2 s: every batch job
# that ran srun ended 3 s after its script. With the subreaper: within 1 s (measured).
# The caller gets the daemon's exit code once it has forked into the background; the reaper
# then lets go of the caller's stdio and ends when everything below it has ended.
REAPER='
import ctypes, os, subprocess, sys
done_r, done_w = os.pipe()
if os.fork():
    os.close(done_w)
    sys.exit(int(os.read(done_r, 16) or 1))
os.close(done_r)
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
rc = subprocess.call(sys.argv[1:])
os.write(done_w, str(rc).encode())
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
'
reaped() {  # CMD...: run a daemon under its own subreaper; CMD's exit code
    python3 -c "$REAPER" "$@"
}

# Jobs run with slurmd's limits (PropagateResourceLimits=NONE), and slurmd raises its core limit to
# the hard one: a rank crashed on purpose (the give-up test's SIGSEGV) wrote a 170 MB core into its
# working directory, the repository. ulimit -c 0 sets the hard limit too.
slurmd_reaped() {  # SLURMD ARGS...: a slurmd of $SLURM_CONF under its subreaper, no core files
    (ulimit -c 0 && reaped slurmd -f "$SLURM_CONF" "$@")
}

free_port() {  # a TCP port nobody listens on now (the kernel's pick)
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

write_conf() {  # DIR NODES
    local dir=$1 nodes=$2 user i
    user=$(id -un)
    cat >"$dir/etc/slurm.conf" <<EOF
# written by scripts/slurm-cluster.sh; a test cluster on localhost
ClusterName=hpctrain-test
SlurmctldHost=localhost
SlurmctldPort=$(free_port)
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=5
StateSaveLocation=$dir/spool/ctld
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
TmpFS=$dir/tmp/%n
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=pmix
SlurmdParameters=config_overrides
PropagateResourceLimits=NONE
JobRequeue=1
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1,batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=2
MinJobAge=3600
InactiveLimit=0
Waittime=0
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/log/jobcomp.txt
SlurmctldDebug=info
MailProg=/bin/true
SlurmdDebug=info
EOF
    for i in $(seq 1 "$nodes"); do
        echo "NodeName=n$i NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$(free_port) CPUs=8 RealMemory=4000 State=UNKNOWN" >>"$dir/etc/slurm.conf"
        mkdir -p "$dir/spool/n$i" "$dir/tmp/n$i"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$dir/etc/slurm.conf"
}

cmd_start() {  # DIR [NODES]
    local dir nodes=${2:-2} i
    [ -n "${1:-}" ] || die "usage: $0 start DIR [NODES]"
    local gone; gone=$(missing_binaries)
    [ -z "$gone" ] || die "missing:$gone; run '$0 install' as root (Debian/Ubuntu)"
    mkdir -p "$1"
    dir=$(cd "$1" && pwd)
    [ ! -e "$dir/run/slurmctld.pid" ] || die "$dir already holds a cluster; stop it first ($0 stop $dir)"
    mkdir -p "$dir"/{etc,munge,spool/ctld,run,log,tmp}
    chmod 700 "$dir/munge"
    write_conf "$dir" "$nodes"
    export SLURM_CONF=$dir/etc/slurm.conf
    echo "export SLURM_CONF=$SLURM_CONF" >"$dir/env"
    # from here on, a failure stops whatever was started
    trap 'say "start failed; logs in $dir/log"; cmd_stop "$dir" >/dev/null 2>&1 || true' ERR

    head -c 1024 /dev/urandom >"$dir/munge/munge.key"
    chmod 400 "$dir/munge/munge.key"
    # -f: run despite a key/socket directory munged would call insecure (a test tree)
    reaped munged -f --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
        --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" \
        --seed-file="$dir/munge/munged.seed"
    # the daemons (and the slurmstepd they start) work in $dir/log: stop finds leftovers by that
    reaped slurmctld -i -f "$SLURM_CONF"
    for i in $(seq 1 "$nodes"); do
        slurmd_reaped -N "n$i"
    done
    for _ in $(seq 1 150); do  # up to 30 s; measured: under 1 s
        if [ "$(sinfo -h -o '%t' 2>/dev/null | sort -u)" = idle ] \
            && [ "$(sinfo -h -N -o '%N' 2>/dev/null | sort -u | wc -l)" = "$nodes" ]; then
            trap - ERR
            say "up: $nodes node(s) in $dir (export SLURM_CONF=$SLURM_CONF)"
            return 0
        fi
        sleep 0.2
    done
    say "nodes not idle after 30 s:"; sinfo -N 2>&1 || true
    tail -n 20 "$dir"/log/*.log >&2 || true
    cmd_stop "$dir" >/dev/null 2>&1 || true
    exit 1
}

alive() { kill -0 "$1" 2>/dev/null; }

stop_pid() {  # PID NAME: SIGTERM, then SIGKILL after 10 s
    local pid=$1 name=$2
    alive "$pid" || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do alive "$pid" || return 0; sleep 0.2; done
    say "$name ($pid) ignored SIGTERM; SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
}

cluster_pids() {  # DIR: SLURM/munge processes working in DIR (daemons and their slurmstepd), not this script
    local dir=$1 p comm cwd
    for p in /proc/[0-9]*; do
        p=${p#/proc/}
        [ "$p" = $$ ] && continue
        comm=$(cat "/proc/$p/comm" 2>/dev/null) || continue
        case $comm in slurmstepd | slurmd | slurmctld | slurmscriptd | munged) ;; *) continue ;; esac
        cwd=$(readlink "/proc/$p/cwd" 2>/dev/null) || continue
        case $cwd in "$dir" | "$dir"/*) echo "$p" ;; esac
    done
    return 0
}

descendants() {  # PID: its children, their children, ... (job processes under a slurmstepd)
    local child
    for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do
        echo "$child"
        descendants "$child"
    done
}

cmd_stop() {  # DIR
    local dir pid f p
    [ -n "${1:-}" ] || die "usage: $0 stop DIR"
    [ -d "$1" ] || return 0
    dir=$(cd "$1" && pwd)
    export SLURM_CONF=$dir/etc/slurm.conf
    # 1. jobs first, while slurmctld and slurmd can still end them cleanly
    if [ -f "$dir/run/slurmctld.pid" ] && alive "$(cat "$dir/run/slurmctld.pid")"; then
        timeout 10 scancel --quiet --full --state=PENDING,RUNNING,SUSPENDED,REQUEUED "--user=$(id -un)" 2>/dev/null \
            || timeout 10 scancel --quiet "--user=$(id -un)" 2>/dev/null || true
        for _ in $(seq 1 50); do  # up to 10 s
            [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break
            sleep 0.2
        done
    fi
    # 2. the daemons, by their pid files: slurmd, slurmctld, then munged
    for f in "$dir"/run/slurmd-*.pid "$dir/run/slurmctld.pid" "$dir/run/munged.pid"; do
        [ -f "$f" ] || continue
        pid=$(cat "$f")
        [ -n "$pid" ] && stop_pid "$pid" "$(basename "$f" .pid)"
        rm -f "$f"
    done
    # 3. anything of this cluster still alive: a slurmstepd whose job did not end, and its job's processes
    for pid in $(cluster_pids "$dir"); do
        for p in $(descendants "$pid") "$pid"; do
            say "leftover process $p ($({ tr '\0' ' ' <"/proc/$p/cmdline"; } 2>/dev/null)); killing it"
            kill -KILL "$p" 2>/dev/null || true
        done
    done
    say "stopped ($dir)"
}

cmd_status() {
    export SLURM_CONF=$1/etc/slurm.conf
    sinfo -N; squeue
}

node_pids() {  # DIR NODE: the slurmstepd of NODE (a job process under it runs as NODE) and their descendants
    local dir=$1 node=$2 p c kids
    for p in $(cluster_pids "$dir"); do
        [ "$(cat "/proc/$p/comm" 2>/dev/null)" = slurmstepd ] || continue
        kids=$(descendants "$p")
        for c in $kids; do
            if tr '\0' '\n' <"/proc/$c/environ" 2>/dev/null | grep -qx "SLURMD_NODENAME=$node"; then
                echo "$p" $kids
                break
            fi
        done
    done
    return 0
}

cmd_lose_node() {  # DIR NODE
    [ -n "${2:-}" ] || die "usage: $0 lose-node DIR NODE"
    local dir node=$2 victims
    dir=$(cd "$1" && pwd)
    victims="$(cat "$dir/run/slurmd-$node.pid" 2>/dev/null) $(node_pids "$dir" "$node")"
    [ -n "${victims// /}" ] || die "no slurmd or job process of node $node in $dir"
    # shellcheck disable=SC2086
    kill -KILL $victims 2>/dev/null || true
    say "lost $node: SIGKILL to" $victims
}

slurmd_started() {  # NODE: when slurmctld last heard a slurmd of NODE register
    scontrol show node "$1" -o 2>/dev/null | grep -o 'SlurmdStartTime=[^ ]*'
}

cmd_revive_node() {  # DIR NODE
    [ -n "${2:-}" ] || die "usage: $0 revive-node DIR NODE"
    local dir node=$2 state before
    dir=$(cd "$1" && pwd)
    export SLURM_CONF=$dir/etc/slurm.conf
    before=$(slurmd_started "$node")
    (cd "$dir/log" && slurmd_reaped -N "$node")
    # back = registered anew (right after lose-node the state still reads alloc or mix)
    for _ in $(seq 1 150); do  # up to 30 s
        state=$(sinfo -h -N -n "$node" -o '%t' 2>/dev/null)
        if [ "$(slurmd_started "$node")" != "$before" ]; then
            case $state in *'*'* | down* | "") ;; *) say "$node is back ($state)"; return 0 ;; esac
        fi
        sleep 0.2
    done
    die "$node not back after 30 s: $(sinfo -h -N -n "$node" 2>&1)"
}

case "${1:-}" in
    install) cmd_install ;;
    start) shift; cmd_start "$@" ;;
    stop) shift; cmd_stop "$@" ;;
    status) shift; cmd_status "$@" ;;
    lose-node) shift; cmd_lose_node "$@" ;;
    revive-node) shift; cmd_revive_node "$@" ;;
    *) die "usage: $0 install | start DIR [NODES] | stop DIR | status DIR | lose-node DIR NODE | revive-node DIR NODE" ;;
esac
