"""`make demo`: real megatron-core GPT training on CPU, 4 gloo processes standing in for 4 GPUs.

Thin: build the inputs, launch, print. (The heterogeneous demo replaces this once the runtime for
uneven plans lands; until then it shows megatron-core's own TP=2 x PP=2 path running on CPU.)
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_het.cluster import load_model  # noqa: E402
from megatron_het.platform.local_launch import run_local  # noqa: E402
from megatron_het.runtime.groups import BlockShape  # noqa: E402
from megatron_het.runtime.train_config import TrainConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rank(rank, world_size, model, train, shape):
    from functools import partial

    from megatron_het.data.synthetic import synthetic_batch
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.megatron_trainer import train_megatron_block

    report = enable_cpu_backend()
    if rank == 0:
        print(report.describe(), flush=True)
    batch = partial(lambda it, idx: synthetic_batch(seed=train.seed, iteration=it, indices=idx,
                                                    seq_length=model.seq_length, vocab_size=model.vocab_size))
    return train_megatron_block(model=model, train=train, shape=shape, batch_fn=batch)


def main() -> int:
    model = load_model(os.path.join(ROOT, "examples/models/tiny-cpu.yaml"))
    train = TrainConfig(micro_batch_size=2, global_batch_size=16, train_iters=10, lr=3e-3)
    shape = BlockShape(tp=2, pp=2, dp=1)
    print(f"demo: {model.name}: {model.num_layers} layers, hidden {model.hidden_size}; "
          f"TP={shape.tp} x PP={shape.pp} on {shape.size} gloo processes; "
          f"global batch {train.global_batch_size}, {train.train_iters} iterations")
    start = time.time()
    results = run_local(shape.size, _rank, (model, train, shape))
    last = results[-1]
    for log in last.iterations:
        print(f" iteration {log.iteration:3d}/{train.train_iters} | lm loss {log.lm_loss:.4f} | "
              f"grad norm {log.grad_norm:.3f} | elapsed {log.elapsed_s * 1000:.0f} ms")
    first_loss, last_loss = last.iterations[0].lm_loss, last.iterations[-1].lm_loss
    print(f"demo: loss {first_loss:.4f} -> {last_loss:.4f} in {time.time() - start:.0f} s")
    return 0 if last_loss < first_loss else 1


if __name__ == "__main__":
    sys.exit(main())
