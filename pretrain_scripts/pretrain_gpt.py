"""Megatron-style GPT pre-training on a heterogeneous cluster.

    torchrun --nproc-per-node 4 pretrain_scripts/pretrain_gpt.py \
        --hetero-cluster examples/clusters/cpu-demo.yaml --hetero-plan examples/plans/cpu-demo-hetero.json \
        --hetero-model examples/models/tiny-cpu.yaml --micro-batch-size 2 --global-batch-size 16 \
        --train-iters 20 --lr 1e-3 --mock-data

Thin: everything lives in megatron_het.cli.pretrain (parse, build, train, close). Started without
torchrun (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT not set), it still reports bad arguments and plans
as the run would, then says how to launch in one line (exit 2) instead of torch's rendezvous traceback
(so does the console script, which calls the same main).
"""

import sys


def main(argv: list[str] | None = None) -> int:
    from megatron_het.cli.pretrain import main as pretrain_main

    return pretrain_main(argv)


if __name__ == "__main__":
    sys.exit(main())
