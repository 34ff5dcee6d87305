"""perf/link_fit: the ring link fitted to collective times recovers a known link."""

import pytest

from megatron_het.perf.comm import ring_all_gather_time, ring_all_reduce_time
from megatron_het.perf.link_fit import CollectiveSample, fit_ring_link


@pytest.mark.parametrize(("formula", "fn"), [("all_reduce", ring_all_reduce_time),
                                             ("all_gather", ring_all_gather_time)])
def test_recovers_the_link_that_generated_the_times(formula, fn):
    samples = [CollectiveSample(ranks=n, nbytes=b, seconds=fn(b, n=n, bandwidth_gbps=6.0, latency_us=900.0))
               for n in (2, 4) for b in (2 ** 16, 2 ** 20, 2 ** 24)]
    ch = fit_ring_link(samples, formula=formula)
    assert ch.latency_us == pytest.approx(900.0, rel=1e-9)
    assert ch.bandwidth_gbps == pytest.approx(6.0, rel=1e-9)


def test_relative_least_squares_weighs_small_messages():
    """Noise of +-10% on alternating samples: the fit stays within 10% of the true link (an absolute
    least-squares fit would let the 16 MiB samples swamp the latency)."""
    true = {"bandwidth_gbps": 8.0, "latency_us": 1000.0}
    samples = [CollectiveSample(ranks=4, nbytes=b, seconds=ring_all_reduce_time(b, n=4, **true) * (1.1 if i % 2 else 0.9))
               for i, b in enumerate((2 ** 16, 2 ** 17, 2 ** 22, 2 ** 23, 2 ** 24, 2 ** 25))]
    ch = fit_ring_link(samples, formula="all_reduce")
    assert ch.latency_us == pytest.approx(1000.0, rel=0.1)
    assert ch.bandwidth_gbps == pytest.approx(8.0, rel=0.1)


def test_latency_only_times_clamp_the_bandwidth_and_stay_positive():
    samples = [CollectiveSample(ranks=4, nbytes=b, seconds=t) for b, t in ((2 ** 16, 6e-3), (2 ** 24, 5e-3))]
    ch = fit_ring_link(samples, formula="all_reduce")  # bigger message faster: no positive bandwidth term
    assert ch.bandwidth_gbps > 1e5 and 0 < ch.latency_us < 1000.0


def test_errors_name_the_field_and_the_fix():
    one = [CollectiveSample(ranks=4, nbytes=2 ** 20, seconds=1e-3)]
    with pytest.raises(ValueError, match=r"samples: need 2 or more points .* Fix: time the collective"):
        fit_ring_link(one * 3, formula="all_reduce")
    with pytest.raises(ValueError, match=r"formula: must be one of \['all_gather', 'all_reduce'\]"):
        fit_ring_link(one, formula="broadcast")
    with pytest.raises(ValueError, match=r"ranks >= 2.* got ranks=1"):
        fit_ring_link([CollectiveSample(ranks=1, nbytes=1.0, seconds=1.0)], formula="all_gather")


def test_collective_links_fitted_per_group_size_recover_each_size_link():
    """Times generated with a different link per (kind, group size): each size's fitted links recover
    its own link (the pooled fields cannot fit both), and a kind missing is a named error."""
    from megatron_het.perf.link_fit import fit_collective_links

    fns = {"all_gather": ring_all_gather_time, "all_reduce": ring_all_reduce_time, "reduce_scatter": ring_all_reduce_time}
    truth = {2: (2.0, 2000.0), 4: (6.0, 800.0)}  # ranks -> (Gbit/s, us per step): a 2-rank step dearer
    samples = {kind: [CollectiveSample(ranks=n, nbytes=b, seconds=fn(b, n=n, bandwidth_gbps=bw, latency_us=lat))
                      for n, (bw, lat) in truth.items() for b in (2 ** 16, 2 ** 20, 2 ** 24)]
               for kind, fn in fns.items()}
    formulas = {"all_gather": "all_gather", "all_reduce": "all_reduce", "reduce_scatter": "all_reduce"}
    links = fit_collective_links(samples, formulas=formulas)
    assert sorted(links.by_group_size) == [2, 4]
    for n, (bw, lat) in truth.items():
        for key in ("ag_weight", "ar_forward", "rs_wgrad"):
            ch = links.for_item(key, ranks=n)
            assert ch.bandwidth_gbps == pytest.approx(bw, rel=1e-9)
            assert ch.latency_us == pytest.approx(lat, rel=1e-9)
    assert links.for_item("ag_weight", ranks=8) is links.all_gather  # a size never timed: the pooled fit
    assert not any(abs(links.all_reduce.latency_us - lat) < 1 for _, lat in truth.values())
    assert fit_collective_links(samples, formulas=formulas, per_group_size=False).by_group_size == {}
    one_size = {k: [s for s in v if s.ranks == 4 or (k == "all_gather" and s.nbytes == 2 ** 16)]
                for k, v in samples.items()}  # 2 ranks timed at one buffer size only: no 2-rank links
    assert sorted(fit_collective_links(one_size, formulas=formulas).by_group_size) == [4]
    with pytest.raises(ValueError, match=r"missing \['reduce_scatter'\] .* Fix: time and name every kind"):
        fit_collective_links({k: v for k, v in samples.items() if k != "reduce_scatter"}, formulas=formulas)
