#!/usr/bin/env bash
# Launch agent for mpirun (--mca plm_rsh_agent), standing in for ssh on the
# emulated cluster of benchmarks/emulated_cluster.sh. Called as
#   agent [ssh-style options] HOST COMMAND...
# it runs COMMAND in HOST's network namespace, in its own UTS namespace with
# the node's hostname (Open MPI merges "nodes" that share a hostname, and
# crashes). HOST -> namespace/hostname comes from EMU_CLUSTER_HOSTS, set by
# emulated_cluster.sh and inherited through mpirun: "addr=netns=hostname ...".
set -u
while [[ $# -gt 0 && $1 == -* ]]; do shift; done   # options meant for ssh
host=${1:?usage: $0 [options] HOST COMMAND...}
shift
for entry in ${EMU_CLUSTER_HOSTS:?EMU_CLUSTER_HOSTS is not set: run through emulated_cluster.sh}; do
    IFS== read -r addr netns name <<<"$entry"
    if [[ $host == "$addr" || $host == "$name" ]]; then
        # "$*" like ssh: the remote side gets one command line for its shell
        exec ip netns exec "$netns" unshare --uts sh -c "hostname $name; $*"
    fi
done
echo "emulated_cluster_agent: unknown host '$host' (known: $EMU_CLUSTER_HOSTS)" >&2
exit 255
