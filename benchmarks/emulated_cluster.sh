#!/usr/bin/env bash
# Run a command under mpirun on an emulated two-node cluster on this machine:
# two network namespaces ("nodes", each with its own hostname), a veth pair
# between them capped with tbf at --rate in both directions. Everything is torn
# down on exit, error or signal. See ../shared/EMULATED-CLUSTER.md.
#
#   benchmarks/emulated_cluster.sh [--rate 1gbit|100mbit|none] [--np 4] -- COMMAND...
#   benchmarks/emulated_cluster.sh -- .venv/bin/python benchmarks/allreduce.py --max 64M
#
# Ranks are mapped by node (rank 0 -> nodeA, 1 -> nodeB, 2 -> nodeA, ...), so a
# flat ring crosses the link at every hop. At the end it prints the bytes that
# crossed the link each way ("emulated cluster: link bytes ..."). Exit status: the command's, or 77
# (skipped) with one line saying why when network namespaces cannot be made
# here, or 2 for a usage error.
set -uo pipefail

rate=1gbit np=4
usage() { echo "usage: $0 [--rate 1gbit|100mbit|none] [--np N] -- COMMAND..." >&2; exit 2; }
while [[ $# -gt 0 ]]; do
    case $1 in
        --rate) rate=${2:?}; shift 2 ;;
        --np) np=${2:?}; shift 2 ;;
        --) shift; break ;;
        *) usage ;;
    esac
done
[[ $# -gt 0 && $np =~ ^[0-9]+$ && $np -ge 2 ]] || usage

skip() { echo "emulated_cluster: skipped: $*" >&2; exit 77; }
[[ $(id -u) == 0 ]] || skip "network namespaces need root (running as uid $(id -u))"
for tool in ip tc unshare mpirun; do
    command -v "$tool" >/dev/null || skip "'$tool' is not installed"
done
unshare --uts true 2>/dev/null || skip "'unshare --uts' is not permitted here (each node needs its own hostname)"

here=$(cd "$(dirname "$0")" && pwd)
# Unique per run, so concurrent runs never share a namespace. Addresses live
# only inside the two namespaces; the subnet varies too, as the notes advise.
tag=$$-$RANDOM
nsA=emuA-$tag nsB=emuB-$tag
net=10.201.$(($$ % 250))
tmp=$(mktemp -d)

cleanup() {
    local ns pids
    # a namespace lives while a process is inside it: end ours first
    for ns in "$nsA" "$nsB"; do
        pids=$(ip netns pids "$ns" 2>/dev/null) && [[ -n $pids ]] && kill -TERM $pids 2>/dev/null
    done
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        [[ -z $(ip netns pids "$nsA" 2>/dev/null)$(ip netns pids "$nsB" 2>/dev/null) ]] && break
        sleep 0.3
    done
    for ns in "$nsA" "$nsB"; do
        pids=$(ip netns pids "$ns" 2>/dev/null) && [[ -n $pids ]] && kill -KILL $pids 2>/dev/null
        ip netns del "$ns" 2>/dev/null   # takes the veth and its qdisc with it
    done
    rm -rf "$tmp"
    [[ -n ${made:-} ]] && echo "emulated cluster: torn down $nsA $nsB"
    trap - EXIT   # once is enough
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

ip netns add "$nsA" 2>"$tmp/err" || skip "'ip netns add' failed: $(head -n1 "$tmp/err")"
made=1
ip netns add "$nsB" 2>"$tmp/err" || skip "'ip netns add' failed: $(head -n1 "$tmp/err")"
setup() {
    ip link add vethA netns "$nsA" type veth peer name vethB netns "$nsB" &&
    ip -n "$nsA" addr add "$net.1/24" dev vethA && ip -n "$nsB" addr add "$net.2/24" dev vethB &&
    ip -n "$nsA" link set lo up && ip -n "$nsA" link set vethA up &&
    ip -n "$nsB" link set lo up && ip -n "$nsB" link set vethB up || return 1
    [[ $rate == none ]] && return 0
    # tbf shapes egress only, so each end shapes its own direction
    tc -n "$nsA" qdisc add dev vethA root tbf rate "$rate" burst 256kb latency 50ms &&
    tc -n "$nsB" qdisc add dev vethB root tbf rate "$rate" burst 256kb latency 50ms
}
setup 2>"$tmp/err" || skip "setting up the veth link failed: $(head -n1 "$tmp/err")"

per_node=$(((np + 1) / 2))
printf '%s slots=%d\n%s slots=%d\n' "$net.1" "$per_node" "$net.2" "$per_node" >"$tmp/hosts"
cap="capped at $rate each way"
[[ $rate == none ]] && cap="uncapped"
echo "emulated cluster: nodeA ($nsA, $net.1) <-> nodeB ($nsB, $net.2), link $cap;" \
     "mpirun -n $np, $per_node per node, mapped by node"
# A caller that initialised MPI itself (a singleton: a test runner, a Python
# session) leaves its job's identity in the environment (PMIX_*, OMPI_MCA_ess,
# ORTE_*, ...); an mpirun inside the namespaces would try to join that job at
# 127.0.0.1 of the host namespace and exit 1 without a word. Start clean.
while IFS='=' read -r name _; do
    case $name in
        PMIX_*|ORTE_*|OMPI_APP_CTX_*|OMPI_COMM_WORLD_*|OMPI_MCA_ess*|OMPI_MCA_orte_*|OMPI_MCA_pmix*) unset "$name" ;;
    esac
done < <(env)
export EMU_CLUSTER_HOSTS="$net.1=$nsA=nodeA $net.2=$nsB=nodeB"   # read by the agent
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# mpirun itself runs on nodeA; the agent starts nodeB's daemon in nodeB.
# yield_when_idle: both "nodes" share this machine's cores, but Open MPI sees
# only slots=2 per node and would busy-poll (4 KB took 37 ms instead of 0.1 ms).
# In the background so that a signal to this script is handled at once.
ip netns exec "$nsA" unshare --uts sh -c 'hostname nodeA; exec "$@"' sh \
    mpirun -n "$np" --hostfile "$tmp/hosts" --map-by node --oversubscribe --bind-to none \
    --mca plm_rsh_agent "$here/emulated_cluster_agent.sh" --mca mpi_yield_when_idle 1 \
    --mca btl self,vader,tcp --mca btl_tcp_if_include "$net.0/24" --mca oob_tcp_if_include "$net.0/24" \
    "$@" &
wait $!
status=$?
# What crossed the link, each way, over the whole job (start-up, training, evaluation, and
# TCP/IP headers): the veths' own counters, read before the namespaces go.
ab=$(ip netns exec "$nsA" cat /sys/class/net/vethA/statistics/tx_bytes 2>/dev/null)
ba=$(ip netns exec "$nsB" cat /sys/class/net/vethB/statistics/tx_bytes 2>/dev/null)
[[ -n $ab && -n $ba ]] && echo "emulated cluster: link bytes nodeA->nodeB $ab, nodeB->nodeA $ba"
cleanup
exit $status
