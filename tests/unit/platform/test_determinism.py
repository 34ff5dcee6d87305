"""--deterministic-mode (platform/determinism.py): the libraries' variables pinned as Megatron-LM pins
them, a launcher's deterministic choice kept, another one refused naming the variable; torch's
deterministic algorithms switched on; --tp-comm-overlap refused with it."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_het.cluster.errors import ConfigError
from megatron_het.platform.determinism import apply_deterministic_mode


@pytest.fixture
def torch_state():
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def test_unset_variables_get_megatrons_values_and_torch_turns_deterministic(torch_state):
    env = {"NCCL_ALGO": "CollnetDirect,Ring"}  # a launcher's deterministic choice
    line = apply_deterministic_mode(tp_comm_overlap=False, env=env)
    assert env == {"NCCL_ALGO": "CollnetDirect,Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                   "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
    assert torch.are_deterministic_algorithms_enabled()
    assert line == ("deterministic mode: torch deterministic algorithms on; NCCL_ALGO=CollnetDirect,Ring, "
                    "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, CUBLAS_WORKSPACE_CONFIG=:4096:8")


@pytest.mark.parametrize("name, value, accepted", [
    ("NCCL_ALGO", "Tree", "['CollnetChain', 'CollnetDirect', 'Ring', '^NVLS']"),
    ("NCCL_ALGO", "Ring,Tree", "['CollnetChain', 'CollnetDirect', 'Ring', '^NVLS']"),
    ("CUBLAS_WORKSPACE_CONFIG", ":0:0", "[':16:8', ':4096:8']"),
    ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1", "['0']"),
])
def test_a_nondeterministic_setting_is_refused_naming_it(torch_state, name, value, accepted):
    env = {name: value}
    with pytest.raises(ConfigError, match=rf"^{name}: .* \(got '{value}'\)\. Fix: unset {name} .* one of "
                                          + re.escape(accepted) + "$"):
        apply_deterministic_mode(tp_comm_overlap=False, env=env)
    assert env == {name: value}  # nothing written on refusal


def test_tp_comm_overlap_is_refused(torch_state):
    with pytest.raises(ConfigError, match="--tp-comm-overlap: --deterministic-mode cannot run with"):
        apply_deterministic_mode(tp_comm_overlap=True, env={})
