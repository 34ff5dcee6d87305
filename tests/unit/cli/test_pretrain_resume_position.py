"""cli.pretrain.resume_position: a resumed run sizes its train split from the checkpoint's iteration and
consumed samples (GptDataConfig.resume_*), so a changed global batch size still finds its samples."""

from megatron_het.cli.pretrain import resume_position
from megatron_het.data import GptDataConfig


def test_the_checkpoints_count_or_a_fresh_start():
    assert resume_position(None, 16) == (0, 0)
    assert resume_position({"iteration": 20, "consumed_samples": 320}, 4) == (20, 320)  # not 20 x the new batch
    assert resume_position({"iteration": 20}, 4) == (20, 80)  # older checkpoints: iteration x batch, as before


def test_the_resumed_split_holds_the_samples_a_smaller_batch_reads_after_the_count():
    # 20 iterations at 16 consumed 320 samples; resuming at 4 per iteration up to 22 reads 320..327
    cfg = GptDataConfig(data_path=("x",), seq_length=8, global_batch_size=4, train_iters=22,
                        resume_iteration=20, resume_consumed_samples=320)
    assert cfg.num_samples()[0] == 328
    assert GptDataConfig(data_path=("x",), seq_length=8, global_batch_size=4, train_iters=22).num_samples()[0] == 88
