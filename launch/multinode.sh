#!/usr/bin/env bash
# Multi-node ds_mp training through DeepSpeed's launcher (pdsh/ssh to every host in the hostfile).
#   HOSTFILE=launch/hostfile NUM_NODES=2 MASTER_ADDR=node1 launch/multinode.sh ds_configs/tp2_pp2.json
# With the shipped launch/hostfile.localhost it runs on this machine only (used by the tests).
set -euo pipefail
CONFIG=${1:?usage: launch/multinode.sh CONFIG.json [extra train args]}
shift
HOSTFILE=${HOSTFILE:-launch/hostfile.localhost}
NUM_NODES=${NUM_NODES:-1}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
SSH_CHECK=()
if [ "$NUM_NODES" = 1 ]; then
    SSH_CHECK=(--no_ssh_check)  # one node: no passwordless ssh needed
fi
exec deepspeed --hostfile "$HOSTFILE" --num_nodes "$NUM_NODES" "${SSH_CHECK[@]}" --master_addr "$MASTER_ADDR" \
    --master_port "$MASTER_PORT" launch/train.py --deepspeed_config "$CONFIG" "$@"
