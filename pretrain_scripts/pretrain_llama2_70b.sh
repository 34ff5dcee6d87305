#!/bin/bash
# Pre-train Llama-2 70B (examples/models/llama2-70b.yaml, GQA with 8 groups) on a heterogeneous cluster.
# Megatron-LM style launcher: environment variables with defaults, torchrun, the cluster file and
# the plan as arguments, Megatron-LM flags after them.
#
#   One node:      bash pretrain_scripts/pretrain_llama2_70b.sh CLUSTER.yaml PLAN.json [more flags]
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

GPUS_PER_NODE=${GPUS_PER_NODE:-8}   # ranks on this node (the plan's ranks on its island, per node)
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
TORCHRUN=${TORCHRUN:-torchrun}
DATA_PATH=${DATA_PATH:?set DATA_PATH to an indexed dataset prefix (tools/preprocess_data.py)}
TOKENIZER_MODEL=${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the SentencePiece model used for DATA_PATH}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-runs/$(basename "$0" .sh)/checkpoints}
MODEL_ARGS=(
  --num-layers 80 --hidden-size 8192 --num-attention-heads 64 --num-query-groups 8 --ffn-hidden-size 28672
  --seq-length 4096 --max-position-embeddings 4096 --swiglu --untie-embeddings-and-output-weights
)
TRAIN_ARGS=(
  --micro-batch-size "${MICRO_BATCH_SIZE:-1}" --global-batch-size "${GLOBAL_BATCH_SIZE:-1024}"
  --train-iters "${TRAIN_ITERS:-250000}" --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine
  --lr-warmup-iters 2000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
)
DATA_ARGS=(--data-path "$DATA_PATH" --tokenizer-model "$TOKENIZER_MODEL" --split 949,50,1)
OUTPUT_ARGS=(--save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval "${SAVE_INTERVAL:-1000}"
             --log-interval 10 --eval-interval 1000 --eval-iters 10)
LAUNCH=(pretrain_scripts/pretrain_gpt.py --hetero-cluster "$CLUSTER" --hetero-plan "$PLAN"
  "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@")
if [[ " $* " == *" --hetero-resilience "* ]]; then  # a dead rank must not stop the others: one agent per rank
  export NNODES GPUS_PER_NODE NODE_RANK MASTER_ADDR MASTER_PORT TORCHRUN
  exec bash pretrain_scripts/resilient_torchrun.sh "${LAUNCH[@]}"
fi
exec $TORCHRUN --nnodes="$NNODES" --nproc-per-node="$GPUS_PER_NODE" --node-rank="$NODE_RANK" \
  --rdzv-backend=static --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" "${LAUNCH[@]}"
