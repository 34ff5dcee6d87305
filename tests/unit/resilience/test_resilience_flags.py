"""pretrain_gpt.py's resilience flags: off by default, knobs need the switch, values validated."""

from __future__ import annotations

import re

import pytest

from megatron_het.runtime.arguments import parse_args
from megatron_het.runtime.resilience_options import FaultInjection, ResilienceOptions, parse_store

from support.paths import REPO

BASE = ["--hetero-cluster", str(REPO / "examples/clusters/cpu-demo.yaml"), "--hetero-plan", "auto",
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--vocab-size", "512", "--micro-batch-size", "2",
        "--global-batch-size", "16", "--train-iters", "3", "--mock-data", "--lr", "1e-3"]


def test_off_by_default():
    args = parse_args(BASE)
    assert args.resilience is None and args.staggered_step is False


def test_on_with_knobs():
    args = parse_args([*BASE, "--hetero-resilience", "--hetero-resilience-store", "10.0.0.1:29600",
                       "--hetero-heartbeat-interval", "0.25", "--hetero-failure-timeout", "7",
                       "--hetero-resilience-policy", "reroute", "--hetero-inject-fault", "3:1:2"])
    r = args.resilience
    assert (r.store_host, r.store_port, r.heartbeat_interval_s, r.failure_timeout_s, r.policy) == (
        "10.0.0.1", 29600, 0.25, 7.0, "reroute")
    assert r.fault == FaultInjection(rank=3, iteration=1, after_actions=2)
    assert r.describe().startswith("resilience: ON") and "policy reroute" in r.describe()


@pytest.mark.parametrize("extra,message", [
    (["--hetero-failure-timeout", "5"], "--hetero-failure-timeout: needs --hetero-resilience"),
    (["--hetero-resilience"], "--hetero-resilience-store: missing"),
    (["--hetero-resilience", "--hetero-resilience-store", "nohost"], "is not HOST:PORT"),
    (["--hetero-resilience", "--hetero-resilience-store", "h:1", "--hetero-resilience-policy", "maybe"],
     "'maybe' is not one of"),
    (["--hetero-resilience", "--hetero-resilience-store", "h:1", "--hetero-heartbeat-interval", "9",
      "--hetero-failure-timeout", "5"], "need 0 < interval < timeout \\(got 9.0 and 5.0\\)"),
    (["--hetero-resilience", "--hetero-resilience-store", "h:1", "--hetero-inject-fault", "3;rm"],
     "is not RANK:ITERATION"),
    (["--hetero-staggered-step"], "cannot clip \\(--clip-grad 1.0\\)"),
])
def test_bad_values_exit_naming_the_flag(extra, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args([*BASE, *extra])
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_store_address_forms():
    assert parse_store("[::1]:29600") == ("::1", 29600)
    with pytest.raises(ValueError, match="port 70000 is not in 1..65535"):
        ResilienceOptions(store_host="h", store_port=70000)
