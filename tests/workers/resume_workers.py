"""Rank functions of tests/multiproc/test_resume_batch_size.py (module-level so spawn can import them)."""

from __future__ import annotations

from megatron_het.cluster import ModelSpec
from megatron_het.data.synthetic import synthetic_batch


class RecordingBatches:
    """Sample-addressed batches (as data.gpt_data.GptBatches): sample k's tokens are keyed by k alone;
    records the first sample of every batch read."""

    def __init__(self, model: ModelSpec, global_batch_size: int) -> None:
        self.model, self.gbs, self.firsts = model, global_batch_size, []

    def __call__(self, iteration, indices):
        return self.samples(iteration * self.gbs, indices)

    def samples(self, first, indices, *, iteration=None):
        self.firsts.append(first + indices.start)
        return synthetic_batch(seed=0, iteration=0, indices=range(first + indices.start, first + indices.stop),
                               seq_length=self.model.seq_length, vocab_size=self.model.vocab_size)


def resume_worker(rank, world_size, model: ModelSpec, steps, padded_vocab, save_dir):
    """steps: [(plan, train, load: bool)]: train each to train.train_iters, saving under save_dir.
    Returns per step (first sample of each micro-batch read, consumed samples logged, saved count)."""
    from megatron_het.checkpoint.dist_ckpt import iteration_dir, latest_iteration, read_common
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.runtime.hetero_trainer import HeteroTrainer

    enable_cpu_backend()
    out = []
    for plan, train, load in steps:
        batches = RecordingBatches(model, train.global_batch_size)
        trainer = HeteroTrainer(model=model, plan=plan, train=train, batch_fn=batches, padded_vocab=padded_vocab)
        if load:
            trainer.load_checkpoint(iteration_dir(save_dir, latest_iteration(save_dir)))
        logs = trainer.run(train.train_iters - trainer.iteration).iterations
        saved = trainer.save_checkpoint(save_dir)
        out.append((batches.firsts, [log.consumed_samples for log in logs], read_common(saved)["consumed_samples"]))
        trainer.close()
    return out
