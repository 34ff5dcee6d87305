"""cli.pretrain.resume_position: a resumed run sizes its train split from the checkpoint's iteration and
consumed samples (GptDataConfig.resume_*), so a changed global batch size still finds its samples."""

import megatron_het.checkpoint.dist_ckpt as dist_ckpt
from megatron_het.cli.pretrain import resume_position
from megatron_het.data import GptDataConfig


def test_the_checkpoints_count_or_a_fresh_start(monkeypatch, tmp_path):
    assert resume_position(None) == (0, 0)
    assert resume_position(str(tmp_path)) == (0, 0)  # no tracker file: nothing to resume
    monkeypatch.setattr(dist_ckpt, "latest_iteration", lambda load: 20)
    seen = []
    monkeypatch.setattr(dist_ckpt, "read_common", lambda path: seen.append(path) or {"consumed_samples": 320})
    assert resume_position(str(tmp_path)) == (20, 320)
    assert seen == [dist_ckpt.iteration_dir(str(tmp_path), 20)]
    for old in ({}, {"consumed_samples": None}, {"consumed_samples": True}, {"consumed_samples": -1}):
        monkeypatch.setattr(dist_ckpt, "read_common", lambda path, old=old: old)
        assert resume_position(str(tmp_path)) == (0, 0)  # older checkpoints: iteration x global batch, as before


def test_the_resumed_split_holds_the_samples_a_smaller_batch_reads_after_the_count():
    # 20 iterations at 16 consumed 320 samples; resuming at 4 per iteration up to 22 reads 320..327
    cfg = GptDataConfig(data_path=("x",), seq_length=8, global_batch_size=4, train_iters=22,
                        resume_iteration=20, resume_consumed_samples=320)
    assert cfg.num_samples()[0] == 328
    assert GptDataConfig(data_path=("x",), seq_length=8, global_batch_size=4, train_iters=22).num_samples()[0] == 88
