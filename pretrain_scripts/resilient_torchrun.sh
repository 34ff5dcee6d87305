#!/bin/bash
# Launch one node's ranks of a --hetero-resilience run: the launchers exec this instead of torchrun
# when --hetero-resilience is among the flags.
#
#   bash pretrain_scripts/resilient_torchrun.sh pretrain_scripts/pretrain_gpt.py [flags]
#
# torchrun's agent stops every worker it started when one of them fails (--max-restarts only restarts
# them all), so each rank gets its own agent (--nproc-per-node=1 --max-restarts=0, its own static
# rendezvous node: global rank = NODE_RANK * GPUS_PER_NODE + i); a dead rank then ends only its own
# agent and the survivors keep training in-process. Node 0 also runs the resilience store
# (python -m megatron_het.cli.resilience_store) on MASTER_ADDR:RESILIENCE_PORT, outside every rank.
# Environment as the launchers: NNODES, GPUS_PER_NODE, NODE_RANK, MASTER_ADDR, MASTER_PORT, TORCHRUN;
# RESILIENCE_PORT (default MASTER_PORT + 1), PYTHON (default python).
set -euo pipefail
cd "$(dirname "$0")/.."

NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:?set GPUS_PER_NODE (ranks on this node)}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
RESILIENCE_PORT=${RESILIENCE_PORT:-$((MASTER_PORT + 1))}
TORCHRUN=${TORCHRUN:-torchrun}
PYTHON=${PYTHON:-python}
WORLD=$((NNODES * GPUS_PER_NODE))

ARGS=("$@")
if [[ " $* " != *" --hetero-resilience-store "* ]]; then
  ARGS+=(--hetero-resilience-store "$MASTER_ADDR:$RESILIENCE_PORT")
fi
if [ "$NODE_RANK" -eq 0 ]; then
  "$PYTHON" -m megatron_het.cli.resilience_store --host "$MASTER_ADDR" --port "$RESILIENCE_PORT" &
  STORE_PID=$!
  trap 'kill "$STORE_PID" 2>/dev/null || true' EXIT
fi
pids=()
for ((i = 0; i < GPUS_PER_NODE; i++)); do
  # each agent's LOCAL_RANK is 0 (one process per agent): the index on the node picks the device
  MEGATRON_HET_LOCAL_RANK=$i $TORCHRUN --nnodes="$WORLD" --nproc-per-node=1 --max-restarts=0 --node-rank=$((NODE_RANK * GPUS_PER_NODE + i)) \
    --rdzv-backend=static --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" "${ARGS[@]}" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  rc=0; wait "$pid" || rc=$?
  if [ "$rc" -ne 0 ]; then echo "megatron-het: a rank's agent exited with $rc; the others continued" >&2; status=$rc; fi
done
exit "$status"
