"""Megatron-style GPT pre-training on a heterogeneous cluster.

    torchrun --nproc-per-node 4 pretrain_scripts/pretrain_gpt.py \
        --hetero-cluster examples/clusters/cpu-demo.yaml --hetero-plan examples/plans/cpu-demo-hetero.json \
        --hetero-model examples/models/tiny-cpu.yaml --micro-batch-size 2 --global-batch-size 16 \
        --train-iters 20 --mock-data

Thin: everything lives in megatron_het.cli.pretrain (parse, build, train, close).
"""

import sys

from megatron_het.cli.pretrain import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
