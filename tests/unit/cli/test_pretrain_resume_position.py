"""cli.pretrain.resume_position: a resumed run sizes its train split from the checkpoint's iteration and
consumed samples (GptDataConfig.resume_*), so a changed global batch size still finds its samples."""

import megatron_het.checkpoint.dist_ckpt as dist_ckpt
from megatron_het.cli.pretrain import resume_position
from megatron_het.data import GptDataConfig


def test_the_checkpoints_count_or_a_fresh_start(monkeypatch):
    assert resume_position(None, 16) == (0, 0)
    seen = []
    monkeypatch.setattr(dist_ckpt, "read_common",
                        lambda path: seen.append(path) or {"iteration": 20, "consumed_samples": 320})
    assert resume_position("ckpt/iter_0000020", 4) == (20, 320)  # the count, not 20 x the new batch
    assert seen == ["ckpt/iter_0000020"]
    monkeypatch.setattr(dist_ckpt, "read_common", lambda path: {"iteration": 20})
    assert resume_position("ckpt/iter_0000020", 4) == (20, 80)  # older checkpoints: iteration x batch, as before


def test_the_resumed_split_holds_the_samples_a_smaller_batch_reads_after_the_count():
    # 20 iterations at 16 consumed 320 samples; resuming at 4 per iteration up to 22 reads 320..327
    cfg = GptDataConfig(data_path=("x",), seq_length=8, global_batch_size=4, train_iters=22,
                        resume_iteration=20, resume_consumed_samples=320)
    assert cfg.num_samples()[0] == 328
    assert GptDataConfig(data_path=("x",), seq_length=8, global_batch_size=4, train_iters=22).num_samples()[0] == 88
