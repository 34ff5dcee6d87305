#!/bin/bash
# The CPU demo: tiny GPT on examples/clusters/cpu-demo.yaml (islands fast and slow, 2 ranks each), synthetic tokens.
# Megatron-LM style launcher: environment variables with defaults, torchrun, the cluster file and
# the plan as arguments, Megatron-LM flags after them.
#
#   One node:      bash pretrain_scripts/pretrain_cpu_demo.sh CLUSTER.yaml PLAN.json [more flags]
#   Several nodes: on every node, the same command with NNODES=<nodes> NODE_RANK=<this node>
#                  MASTER_ADDR=<node 0>. Node ranks go island by island in cluster-file order
#                  (global ranks are assigned that way), and each node starts GPUS_PER_NODE ranks.
#   Under Slurm:   python tools/slurm.py --cluster CLUSTER.yaml --plan PLAN.json \
#                    --partition ISLAND=PARTITION ... --output job.sbatch -- <the flags below>
#                  sbatch job.sbatch   (one het-job component per island; see docs/launch.md)
# Rendezvous is static (torchrun ignores --node-rank under c10d and orders nodes by host name).
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER=${1:?usage: $0 CLUSTER.yaml PLAN.json [more Megatron-LM flags]}
PLAN=${2:?usage: $0 CLUSTER.yaml PLAN.json [more Megatron-LM flags]}
shift 2

GPUS_PER_NODE=${GPUS_PER_NODE:-4}   # ranks on this node (the plan's ranks on its island, per node)
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
TORCHRUN=${TORCHRUN:-torchrun}
# Defaults make `bash pretrain_scripts/pretrain_cpu_demo.sh examples/clusters/cpu-demo.yaml
# examples/plans/cpu-demo-hetero.json` run on one machine: 4 CPU processes stand in for 4 GPUs.
MODEL_ARGS=(
  --num-layers 4 --hidden-size 64 --num-attention-heads 4
  --seq-length 64 --max-position-embeddings 64 --vocab-size 512
)
TRAIN_ARGS=(
  --micro-batch-size 2 --global-batch-size 16 --train-iters "${TRAIN_ITERS:-3}" --lr 1e-3
)
DATA_ARGS=(--mock-data)
OUTPUT_ARGS=(--log-interval 1)
LAUNCH=(pretrain_scripts/pretrain_gpt.py --hetero-cluster "$CLUSTER" --hetero-plan "$PLAN"
  "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@")
if [[ " $* " == *" --hetero-resilience "* ]]; then  # a dead rank must not stop the others: one agent per rank
  export NNODES GPUS_PER_NODE NODE_RANK MASTER_ADDR MASTER_PORT TORCHRUN
  exec bash pretrain_scripts/resilient_torchrun.sh "${LAUNCH[@]}"
fi
exec $TORCHRUN --nnodes="$NNODES" --nproc-per-node="$GPUS_PER_NODE" --node-rank="$NODE_RANK" \
  --rdzv-backend=static --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" "${LAUNCH[@]}"
