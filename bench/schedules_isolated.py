"""Is there a per-action cost of interleaved's chunks outside the pipeline run? (#16, bench/schedules.py's gap)

A per-action intercept in the pipeline run's action CPU time (bench/schedules_gap.py) would cost interleaved
(32 actions per rank) twice what it costs 1F1B (16). This bench looks for it outside the run, with the
runtime's own pieces, one thread, in thread CPU time (the clock the emulation stretches):

1. chunk call: a megatron-core GPTModel chunk (no embedding or output layer, split linears installed) called
   as the runtime calls it at 1, 2 and 4 layers, beside the profile's way (its TransformerLayers stacked),
   caches swept before each phase: the intercept of time vs layers is a per-call cost.
2. executor: ``ActionExecutor`` running one rank's action list (stage 1 of 4: 4 layers as [4] under 1F1B,
   [2, 2] interleaved; stage 3: [2] vs [1, 1]), m = 8, links faked (recv returns a fresh tensor), each
   compute call timed: total per iteration. Between actions: nothing; a 64 MiB cache sweep; a 20 ms sleep
   (the emulation's wait); both; or (``pair``) a hand-off to a second process on the same core running its
   own executor meanwhile.
3. trainer: the real HeteroTrainer on stages of 4 layers ([4], interleaved [2, 2]), m = 8: two stages on two
   cores, not emulated and emulated 4x; on one core emulated 4x; four stages on two cores emulated 4x
   (bench/schedules.py's sharing). Per rank: compute CPU time per iteration and the involuntary context
   switches inside it.

    python bench/schedules_isolated.py [--reps 15] [--iters 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from harness import (
    MICRO_BATCH,
    MICRO_BATCHES,
    MODEL,
    SWEEP_MIB,
    count_compute,
    cpu_rank,
    per_iteration,
    rank_setup,
    stamp,
    thread_clock_trainer,
    write_result,
)

from megatron_het.platform.local_launch import run_local

CASES = (("1f1b", 1, (4,)), ("interleaved", 1, (2, 2)), ("1f1b", 3, (2,)), ("interleaved", 3, (1, 1)))
CONDITIONS = ("warm", "sweep", "sleep", "sweep+sleep")
SLEEP_S = 0.02
TRAINER_MODES = (("2 ranks, 2 cores, not emulated", 2, 1.0, None), ("2 ranks, 2 cores, emulated 4x", 2, 4.0, None),
                 ("2 ranks, 1 core, emulated 4x", 2, 4.0, {0}), ("4 ranks, 2 cores, emulated 4x", 4, 4.0, None))


def _world_of_one():
    """A gloo world of one, megatron-core's model-parallel RNG, this process's ProcessGroupCollection."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_het.model.groups import BlockShape, block_process_groups
    from megatron_het.platform.local_launch import free_port

    cpu_rank()
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    pgc = block_process_groups(BlockShape(tp=1, pp=1, dp=1))[1]
    model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    return pgc


def _chunk(pgc, num_layers):
    """A middle chunk as the runtime builds it (hetero_trainer._build_model)."""
    from megatron_het.model.gpt import StageModelSpec, build_gpt_stage, transformer_config
    from megatron_het.runtime.split_backward import WeightGradStore, install_split_linears

    spec = StageModelSpec(model=MODEL, num_layers=num_layers, layer_offset=0, tp=1, pre_process=False,
                          post_process=False, vocab_size=1024)
    gpt = build_gpt_stage(spec, transformer_config(spec), pgc)
    install_split_linears(gpt, WeightGradStore())
    return gpt


def _chunk_calls(rank, world_size, reps):
    """Per layer count: runtime-call and profile-style forward/backward ms (median of ``reps``, swept)."""
    import torch

    from megatron_het.profiling.layers import profile_layers

    s, b, h = MODEL.seq_length, MICRO_BATCH, MODEL.hidden_size
    profiled = {}
    for n in (1, 2, 4):  # tools/profile_host.py's engine, as bench/schedules.py runs it (times per layer)
        entry = profile_layers(MODEL, num_layers=n, micro_batch_sizes=[b], device="CPU", warmup=3, repeats=reps,
                               dtype=torch.float32, implementation="megatron", clock="thread",
                               sweep_mib=SWEEP_MIB).entries[0]
        profiled[n] = (n * entry.forward_s, n * entry.backward_s)
    pgc = _world_of_one()
    sweep = torch.zeros(SWEEP_MIB * 2**18)
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    out = {}
    for n in (1, 2, 4):
        gpt = _chunk(pgc, n)
        f, bw = [], []
        for i in range(reps + 3):
            inp, grad = torch.randn(s, b, h).requires_grad_(), torch.randn(s, b, h)
            sweep.add_(1.0)
            t0 = time.thread_time()
            gpt.set_input_tensor(inp)
            y = gpt(None, pos, None, labels=None)
            t1 = time.thread_time()
            sweep.add_(1.0)
            t2 = time.thread_time()
            torch.autograd.backward(y, grad_tensors=grad)
            t3 = time.thread_time()
            for p in gpt.parameters():
                p.grad = None
            if i >= 3:
                f.append(t1 - t0)
                bw.append(t3 - t2)
        out[n] = {"runtime_forward_ms": 1e3 * statistics.median(f), "runtime_backward_ms": 1e3 * statistics.median(bw),
                  "profile_forward_ms": 1e3 * profiled[n][0], "profile_backward_ms": 1e3 * profiled[n][1]}
    return out


def _executor_runs(rank, world_size, iters, conditions, pipe=None):
    """Per (case, condition): compute CPU seconds per iteration (median after one warm-up) and calls."""
    import torch

    from megatron_het.runtime.executor import ActionExecutor
    from megatron_het.schedule import build_schedule
    from megatron_het.schedule.transfers import stage_transfer_steps
    from megatron_het.train.timer import EmulationTimer

    if pipe is not None:
        os.sched_setaffinity(0, {0})  # both processes on one core: each action follows the other's
    pgc = _world_of_one()
    s, b, h = MODEL.seq_length, MICRO_BATCH, MODEL.hidden_size
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    sweep = torch.zeros(SWEEP_MIB * 2**18)
    state = {"condition": "warm"}

    def between():
        c = state["condition"]
        if "sweep" in c:
            sweep.add_(1.0)
        if "sleep" in c:
            time.sleep(SLEEP_S)
        if pipe is not None:
            try:
                pipe.send(1)
                pipe.recv()
            except (EOFError, BrokenPipeError, ConnectionResetError):
                pass  # the other process has finished

    class FakeLink:  # neighbours that answer at once: receives are fresh tensors, sends go nowhere

        def send_ops(self, t, *, downstream, message):
            return []

        def recv_ops(self, shape, dtype, *, downstream, message):
            between()
            return torch.randn(shape, dtype=dtype), []

    class CallTimer(EmulationTimer):
        def __init__(self):
            super().__init__(clock=time.thread_time)
            self.calls = []

        def compute(self, fn):
            c0 = time.thread_time()
            result = fn()
            self.calls.append(time.thread_time() - c0)
            return result

    out = {}
    for name, stage, chunk_layers in CASES:
        v = len(chunk_layers)
        gpts = [_chunk(pgc, n) for n in chunk_layers]
        schedule = build_schedule(name, 4, MICRO_BATCHES, v)
        actions = schedule.actions[stage]
        ex = ActionExecutor(actions=actions, links={g: FakeLink() for g in range(MICRO_BATCHES)}, is_first=False,
                            is_last=False, act_shape=(s, b, h), dtype=torch.float32, micro_batch_size=b,
                            loss_scale=1.0, num_chunks=v, chunk_links={c: FakeLink() for c in range(1, v)},
                            steps=stage_transfer_steps(schedule, stage))
        params = [p for g in gpts for p in g.parameters()]

        def forward(c, tokens, inp, gpts=gpts):
            gpts[c].set_input_tensor(inp)
            return gpts[c](None, pos, None, labels=None)

        for condition in conditions:
            state["condition"] = condition
            totals = []
            for it in range(iters + 1):
                timer = CallTimer()
                ex.run(iteration=it, batch_fn=None, forward=forward, params=params, timer=timer)
                for p in params:
                    p.grad = None
                if it:
                    totals.append(sum(timer.calls))
            out[f"{name} stage {stage} chunks {list(chunk_layers)} / {condition}"] = {
                "compute_s": statistics.median(totals), "calls": len(timer.calls)}
    if pipe is not None:
        pipe.close()
    return out


def _trainer_plan(schedule, stages):
    from megatron_het.plan import Plan, ReplicaPlan, StagePlan, uneven_chunk_layers

    v = 2 if schedule == "interleaved" else 1
    chunks = uneven_chunk_layers([[2, 2]] * stages)
    plans = tuple(StagePlan(island="fast", device_type="CPU", ranks=(s,), layers=(4 * s, 4 * s + 4),
                            chunk_layers=chunks[s] if v > 1 else ()) for s in range(stages))
    return Plan(replicas=(ReplicaPlan(stages=plans, num_micro_batches=MICRO_BATCHES),), micro_batch_size=MICRO_BATCH,
                global_batch_size=MICRO_BATCH * MICRO_BATCHES, schedule=schedule, virtual_pipeline_size=v,
                precision="fp32")


def _trainer_rank(rank, world_size, slowdown, cores, iters):
    """Per schedule: (compute CPU s per iteration, compute calls, involuntary switches in them, elapsed s)."""
    from dataclasses import replace

    if cores is not None:
        os.sched_setaffinity(0, cores)
    model = replace(MODEL, num_layers=4 * world_size)
    spec = {"islands": [{"name": "fast", "device": "CPU", "nodes": 1, "gpus_per_node": world_size}]}
    if slowdown > 1:
        spec["emulation"] = {"fast": {"slowdown": slowdown}}
    cluster, train, batch_fn = rank_setup(iters + 1, model=model, cluster=spec)

    out = {}
    for name in ("1f1b", "interleaved", "interleaved", "1f1b"):  # ABBA: drift cancels in the medians
        trainer = thread_clock_trainer(model, _trainer_plan(name, world_size), train, batch_fn, cluster)
        calls = []
        count_compute(trainer.timer, lambda cpu, switches, calls=calls: calls.append((cpu, switches)))
        out.setdefault(name, []).extend(per_iteration(calls, trainer.run(iters + 1).iterations))  # after 1 warm-up
    return {k: [statistics.median(col) for col in zip(*v)] for k, v in out.items()}


def _pair_process(queue, conn, iters):
    queue.put(_executor_runs(0, 1, iters, ("pair",), conn))


def _pair(iters):
    """Two processes on one core, handing over at every recv: (process A's, process B's) results."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    queues = [ctx.Queue(), ctx.Queue()]
    procs = [ctx.Process(target=_pair_process, args=(q, c, iters)) for q, c in zip(queues, (a, b))]
    for proc in procs:
        proc.start()
    results = [q.get(timeout=3600) for q in queues]
    for proc in procs:
        proc.join()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15, help="repetitions per chunk-call measurement")
    ap.add_argument("--iters", type=int, default=4, help="executor iterations per case and condition (+1 warm-up)")
    args = ap.parse_args()
    load_before = os.getloadavg()
    chunk = run_local(1, _chunk_calls, (args.reps,), timeout_s=3600)[0]
    single = run_local(1, _executor_runs, (args.iters, CONDITIONS), timeout_s=3600)[0]
    pair = _pair(args.iters)
    trainer = {mode: run_local(ranks, _trainer_rank, (slowdown, cores, args.iters), timeout_s=3600)
               for mode, ranks, slowdown, cores in TRAINER_MODES}
    load_after = os.getloadavg()

    print("chunk call (ms, thread CPU time, swept): layers: runtime F / B | profile-style F / B")
    for n, r in chunk.items():
        print(f"  {n}: {r['runtime_forward_ms']:.2f} / {r['runtime_backward_ms']:.2f} | "
              f"{r['profile_forward_ms']:.2f} / {r['profile_backward_ms']:.2f}")
    # least-squares intercept/slope of runtime time vs layers
    fit = {}
    for phase in ("forward", "backward"):
        slope, intercept = statistics.linear_regression(list(chunk), [r[f"runtime_{phase}_ms"] for r in chunk.values()])
        fit[phase] = {"intercept_ms": intercept, "slope_ms_per_layer": slope}
        print(f"  {phase}: {fit[phase]['intercept_ms']:+.2f} ms per call + {slope:.2f} ms per layer")
    executor = {**single, **{k + " (process A)": v for k, v in pair[0].items()},
                **{k + " (process B)": v for k, v in pair[1].items()}}
    print("executor, one rank, fake link: compute CPU s per iteration (calls)")
    for k, v in executor.items():
        print(f"  {k}: {v['compute_s'] * 1e3:.1f} ms ({v['calls']})")
    ratios = {}
    for cond in (*CONDITIONS, "pair (process A)", "pair (process B)"):
        c, suffix = cond.split(" (")[0], (" (" + cond.split(" (")[1]) if " (" in cond else ""
        for stage, one, two in ((1, "[4]", "[2, 2]"), (3, "[2]", "[1, 1]")):
            ratios[f"stage {stage} / {cond}"] = (executor[f"interleaved stage {stage} chunks {two} / {c}{suffix}"]["compute_s"]
                                                 / executor[f"1f1b stage {stage} chunks {one} / {c}{suffix}"]["compute_s"])
    print("interleaved / 1F1B compute per iteration: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    print("trainer, stages of 4 layers, m=8: per rank, compute CPU ms per iteration (preemptions in it)")
    trainer_ratio = {}
    for mode, ranks in trainer.items():
        for r, got in enumerate(ranks):
            one, two = got["1f1b"], got["interleaved"]
            trainer_ratio[f"{mode} / rank {r}"] = two[0] / one[0]
            print(f"  {mode}, rank {r}: 1F1B {one[0] * 1e3:.1f} ({one[2]:.0f}), interleaved {two[0] * 1e3:.1f} "
                  f"({two[2]:.0f}): {two[0] / one[0]:.3f}; elapsed {one[3] * 1e3:.0f} / {two[3] * 1e3:.0f} ms")
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f}")
    write_result("schedules_isolated.json", {
        "figures": {"chunk_call_ms": chunk, "chunk_call_fit": fit, "executor": executor,
                    "interleaved_over_1f1b_compute": ratios,
                    "trainer": {mode: [{k: dict(zip(("compute_s", "calls", "involuntary_switches", "elapsed_s"), v))
                                        for k, got in [(k, r[k]) for k in r]} for r in ranks]
                                for mode, ranks in trainer.items()},
                    "trainer_interleaved_over_1f1b_compute": trainer_ratio},
        "targets": {"purpose": "find a per-action cost outside the pipeline run (no pass/fail target)"},
        "setup": {"model": {k: v for k, v in MODEL.__dict__.items() if v is not None}, "micro_batch_size": MICRO_BATCH,
                  "micro_batches": MICRO_BATCHES, "sweep_mib": SWEEP_MIB, "sleep_s": SLEEP_S, "reps": args.reps,
                  "iters": args.iters, "clock": "time.thread_time", "threads": 1},
        **stamp(load_before=load_before, load_after=load_after),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
