"""A re-saved iteration never leaves the save directory without a loadable copy (#21 item 8)."""

from __future__ import annotations

import os

import pytest

from megatron_het.checkpoint.dist_ckpt import (
    OLD_SUFFIX,
    TRACKER,
    iteration_dir,
    latest_iteration,
    publish_iteration,
    resolve_iteration_dir,
)


def _fake_save(path, content: str) -> None:
    os.makedirs(path)
    with open(os.path.join(path, "weights"), "w") as f:
        f.write(content)


def _loadable(save) -> str:
    """What a loader finds: the tracked iteration's directory content."""
    path = resolve_iteration_dir(iteration_dir(str(save), latest_iteration(str(save))))
    with open(os.path.join(path, "weights")) as f:
        return f.read()


def test_resave_replaces_and_cleans_up(tmp_path):
    _fake_save(tmp_path / "new1.tmp", "v1")
    publish_iteration(str(tmp_path), str(tmp_path / "new1.tmp"), 5)
    _fake_save(tmp_path / "new2.tmp", "v2")
    publish_iteration(str(tmp_path), str(tmp_path / "new2.tmp"), 5)
    assert _loadable(tmp_path) == "v2"
    assert sorted(os.listdir(tmp_path)) == sorted([TRACKER, "iter_0000005"])  # no .old, no temp left


@pytest.mark.parametrize("fail_at", [0, 1, 2])  # os.replace calls: final->old, tmp->final, tracker
def test_failure_between_steps_leaves_a_loadable_checkpoint(tmp_path, monkeypatch, fail_at):
    _fake_save(tmp_path / "new1.tmp", "v1")
    publish_iteration(str(tmp_path), str(tmp_path / "new1.tmp"), 5)
    _fake_save(tmp_path / "new2.tmp", "v2")
    real_replace, calls = os.replace, []

    def crashing_replace(src, dst):  # the process dies right before the fail_at-th rename
        calls.append(src)
        if len(calls) == fail_at + 1:
            raise KeyboardInterrupt("killed")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crashing_replace)
    with pytest.raises(KeyboardInterrupt):
        publish_iteration(str(tmp_path), str(tmp_path / "new2.tmp"), 5)
    monkeypatch.setattr(os, "replace", real_replace)
    # Before the swap: the old copy is still in place (or moved aside, where the loader finds it);
    # after it: the new one. Never nothing.
    assert _loadable(tmp_path) == ("v1", "v1", "v2")[fail_at]
    if fail_at == 1:
        assert (tmp_path / f"iter_0000005{OLD_SUFFIX}").is_dir() and not (tmp_path / "iter_0000005").exists()
        assert _loadable(tmp_path) == "v1"
