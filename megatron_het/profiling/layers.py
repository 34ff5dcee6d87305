"""Measure layers, stage parts and the optimizer step on this host (``tools/profile_host.py``'s engine).

The layers are megatron-core ``TransformerLayer``s built from the local layer spec
(``get_gpt_layer_local_spec``), run on CPU after ``megatron_het.platform.enable_cpu_backend()`` in a
gloo group of ``tp`` processes (world size 1 for ``tp=1``; ``tp > 1`` is spawned by
:func:`profile_tp_layers`, and its times then include the layer's tensor-parallel collectives on
this host). If megatron-core cannot be built, a plain torch layer of the same shape (pre-norm
attention + MLP, unfused softmax) is measured instead and the profile's "method" says so. Layers are
stacked and times divided by their number, which amortises per-call overhead; each time is the
median of ``repeats`` runs after ``warmup``.

Peak memory per layer = parameter bytes + bytes of the tensors autograd saves for backward
(``torch.autograd.graph.saved_tensors_hooks``, each storage counted once). tracemalloc cannot see
torch's allocator, and this sum is what the activation model in ``megatron_het/perf/memory.py``
predicts, so the two can be compared directly.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from megatron_het.cluster import ModelSpec
from megatron_het.perf.profile import PartEntry, Profile, ProfileEntry
from megatron_het.platform import detect_accelerator
from megatron_het.platform.local_launch import free_port

__all__ = ["TorchReferenceLayer", "measure", "profile_layers", "profile_parts", "profile_optimizer",
           "profile_tp_layers", "profile_ep_layers", "profile_concurrent", "profile_emulated"]

LayerStack = Callable[[torch.Tensor], torch.Tensor]
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


class _Timing:
    """How every measurement here is clocked (profile_layers sets it for its duration)."""

    clock: Callable[[], float] = staticmethod(time.perf_counter)
    sweep: torch.Tensor | None = None  # swept through the caches before each timed repetition (cold)
    # after each timed section, wait this many times its measured seconds: an emulated device of slowdown s
    # waits s - 1 (EmulationTimer), and the other processes sharing the host run meanwhile; 0: no wait
    idle_factor: float = 0.0
    # several processes measuring at once start every repetition together (a barrier); False: each runs on
    # its own, as a run's ranks compute (profiling.in_run)
    barrier: bool = True

    def before(self) -> None:
        if self.sweep is not None:
            self.sweep.add_(1.0)

    def after(self, seconds: float) -> None:
        """The measured section took ``seconds`` (on the profile's clock): the emulated device's wait."""
        if self.idle_factor > 0.0 and seconds > 0.0:
            time.sleep(self.idle_factor * seconds)


_TIMING = _Timing()


class TorchReferenceLayer(torch.nn.Module):
    """Pre-norm GPT/Llama layer in plain torch, shaped like megatron-core's local spec."""

    def __init__(self, model: ModelSpec) -> None:
        super().__init__()
        h, d = model.hidden_size, model.kv_channels
        self.heads, self.groups, self.d, self.swiglu = model.num_attention_heads, model.num_query_groups, d, model.swiglu
        bias = model.add_bias_linear
        norm = torch.nn.RMSNorm if model.normalization == "RMSNorm" else torch.nn.LayerNorm
        self.norm1, self.norm2 = norm(h), norm(h)
        self.qkv = torch.nn.Linear(h, (self.heads + 2 * self.groups) * d, bias=bias)
        self.proj = torch.nn.Linear(self.heads * d, h, bias=bias)
        self.fc1 = torch.nn.Linear(h, model.ffn_hidden_size * (2 if model.swiglu else 1), bias=bias)
        self.fc2 = torch.nn.Linear(model.ffn_hidden_size, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [s, b, h]
        s, b, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.d, self.groups * self.d, self.groups * self.d], dim=-1)
        q = q.reshape(s, b * self.heads, self.d).transpose(0, 1)
        k = k.reshape(s, b * self.groups, self.d).transpose(0, 1).repeat_interleave(self.heads // self.groups, 0)
        v = v.reshape(s, b * self.groups, self.d).transpose(0, 1).repeat_interleave(self.heads // self.groups, 0)
        scores = torch.bmm(q, k.transpose(1, 2)) / self.d ** 0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
        context = torch.bmm(probs, v).transpose(0, 1).reshape(s, b, self.heads * self.d)
        x = x + self.proj(context)
        y = self.fc1(self.norm2(x))
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = torch.nn.functional.silu(gate) * up
        else:
            y = torch.nn.functional.gelu(y)
        return x + self.fc2(y)


def _build_megatron(model: ModelSpec, num_layers: int, dtype: torch.dtype,
                    tp: int = 1, ep: int = 1) -> tuple[list[torch.nn.Module], Callable[[], None]]:
    """Megatron-core layers split over ``tp`` ranks, an MoE layer's experts over ``ep`` ranks (the
    current gloo world, or a new world of one); returns them and a cleanup function."""
    import torch.distributed as dist

    from megatron_het.platform import enable_cpu_backend

    enable_cpu_backend()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    created_group = not dist.is_initialized()
    if created_group:
        # a fresh port per call, not MASTER_PORT in os.environ: a port left there by an earlier call
        # may have been taken by another process since (EADDRINUSE on the second profile in a process)
        dist.init_process_group(detect_accelerator().world_backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
    # A runtime in this process (megatron_het.model.groups.ensure_global_memory_buffer) may have
    # created the buffer initialize_model_parallel insists on creating itself; it is stateless scratch.
    parallel_state.destroy_global_memory_buffer()
    parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=tp if ep == 1 else 1)
    model_parallel_cuda_manual_seed(1234)
    moe = {}
    if model.is_moe:  # the run's MoE layer (model/gpt.py): experts over EP ranks, else split over TP (expert-TP = TP)
        from megatron_het.model.gpt import moe_kwargs

        moe = dict(moe_kwargs(model), expert_model_parallel_size=ep, expert_tensor_parallel_size=tp if ep == 1 else 1,
                   tensor_model_parallel_size=tp,
                   sequence_parallel=_sequence_parallel(model, tp))
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups, ffn_hidden_size=model.ffn_hidden_size,
        gated_linear_unit=model.swiglu, add_bias_linear=model.add_bias_linear,
        activation_func=torch.nn.functional.silu if model.swiglu else torch.nn.functional.gelu,
        normalization=model.normalization,
        # the run's dropout: on a CPU, drawing its masks costs as much as a fifth of a small layer's forward
        hidden_dropout=model.hidden_dropout, attention_dropout=model.attention_dropout,
        use_cpu_initialization=True, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, **moe,
    )
    if _sequence_parallel(model, tp):  # the SP layer the run builds (model/gpt.layer_spec: norms that take it)
        from dataclasses import replace as with_fields

        from megatron_het.model.gpt import layer_spec

        block = layer_spec(with_fields(model, num_layers=num_layers, moe_layer_freq=1), sequence_parallel=True,
                           num_layers=num_layers, transformer_impl="local", fused_attention=False)
        specs = list(block.layer_specs)
    else:
        specs = [get_gpt_layer_local_spec(normalization=config.normalization,
                                          num_experts=model.num_experts if model.is_moe else None)] * num_layers
    layers = [build_module(spec, config=config, layer_number=i + 1).to(dtype) for i, spec in enumerate(specs)]

    def cleanup() -> None:
        parallel_state.destroy_model_parallel()
        if created_group:
            dist.destroy_process_group()

    return layers, cleanup


def _sequence_parallel(model: ModelSpec, tp: int) -> bool:
    """Whether the layers run sequence parallel: an MoE layer under TP (megatron-core splits its tokens
    over the TP ranks only so, and the planner gives MoE plans SP); a dense layer never here (its TP
    profile entries stand for plans without SP)."""
    return model.is_moe and tp > 1


def _moe_entry(model: ModelSpec) -> dict[str, int]:
    """ProfileEntry's MoE fields for ``model``'s layer (none for a dense model)."""
    if not model.is_moe:
        return {}
    return dict(num_experts=model.num_experts, moe_router_topk=model.moe_router_topk,
                moe_ffn_hidden_size=model.moe_ffn_hidden_size,
                moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size or 0,
                moe_token_dispatcher_type=model.moe_token_dispatcher_type)


def _stack(layers: list[torch.nn.Module], megatron: bool) -> LayerStack:
    def run(x: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = layer(hidden_states=x, attention_mask=None)[0] if megatron else layer(x)
        return x
    return run


def _saved_bytes(run: LayerStack, x: torch.Tensor) -> int:
    """Bytes of distinct storages autograd keeps for backward during one forward."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run(x)
    return sum(storages.values())


def measure(run: LayerStack, params: list[torch.nn.Parameter], *, shape: tuple[int, int, int], dtype: torch.dtype,
            warmup: int, repeats: int, synchronize: Callable[[], None] = lambda: None) -> tuple[float, float, int]:
    """Median forward and backward seconds of the whole stack, and its peak bytes. ``synchronize``
    (a barrier across TP ranks) runs before every repetition so all ranks start together."""
    x = torch.randn(*shape, dtype=dtype, requires_grad=True)
    forward, backward = [], []
    for i in range(warmup + repeats):
        for p in params:
            p.grad = None
        synchronize()
        _TIMING.before()
        t0 = _TIMING.clock()
        out = run(x)
        t1 = _TIMING.clock()
        _TIMING.after(t1 - t0)
        grad = torch.ones_like(out)
        _TIMING.before()  # in a pipeline a backward never follows its forward warm either
        t2 = _TIMING.clock()
        out.backward(grad)
        t3 = _TIMING.clock()
        _TIMING.after(t3 - t2)
        if i >= warmup:
            forward.append(t1 - t0)
            backward.append(t3 - t2)
    peak = sum(p.numel() * p.element_size() for p in params) + _saved_bytes(run, x)
    return statistics.median(forward), statistics.median(backward), peak


def measure_split(run: LayerStack, layers: list[torch.nn.Module], params: list[torch.nn.Parameter], *,
                  shape: tuple[int, int, int], dtype: torch.dtype, warmup: int, repeats: int) -> tuple[float, float, str]:
    """Zero-bubble B and W of the stack as shares of its fused backward: (B share, W share, method).

    The runtime's split (runtime/split_backward.py: B computes input gradients and keeps each linear's
    (input, output gradient), W computes the linears' weight gradients) against the fused backward,
    alternated per repetition, each timed phase after the same cache sweep as the other measurements."""
    from megatron_het.runtime.split_backward import WeightGradStore, install_split_linears

    store = WeightGradStore()
    for layer in layers:
        install_split_linears(layer, store)
    x = torch.randn(*shape, dtype=dtype, requires_grad=True)
    fused, b, w = [], [], []

    def timed(fn: Callable[[], object]) -> float:
        _TIMING.before()
        t0 = _TIMING.clock()
        fn()
        seconds = _TIMING.clock() - t0
        _TIMING.after(seconds)
        return seconds

    try:
        for i in range(warmup + repeats):
            for split in (False, True) if i % 2 else (True, False):
                for p in params:
                    p.grad = None
                store.enabled = split
                out = run(x)
                grad = torch.ones_like(out)
                if not split:
                    t = timed(lambda: out.backward(grad))
                    if i >= warmup:
                        fused.append(t)
                    continue
                with store.deferring(i):
                    tb = timed(lambda: out.backward(grad))
                tw = timed(lambda: store.flush(i))
                if i >= warmup:
                    b.append(tb)
                    w.append(tw)
    finally:
        store.enabled = False
    f = statistics.median(fused)
    method = (f"split backward (runtime/split_backward.py) of the same {len(layers)} layers against their fused "
              f"backward, alternated, median of {repeats} after {warmup} warm-up")
    return statistics.median(b) / f, statistics.median(w) / f, method


def measure_call_overhead(layers: list[torch.nn.Module], megatron: bool, *, shape: tuple[int, int, int],
                          dtype: torch.dtype, warmup: int, repeats: int) -> tuple[float, float, str]:
    """Fixed seconds of one forward and one backward call beyond its layers: (forward, backward, method).

    A model chunk runs as one call per pipeline action; interleaving makes twice the calls of half the
    layers. The intercept of time vs layers, from the first layer alone and the whole stack of n layers
    (measured back to back, clocked like every measurement here): (n T(1) - T(n)) / (n - 1). Measured
    2026-11-25 (bench/schedules_isolated.py): megatron-core's GPTModel chunk called as the runtime calls it
    has the same intercept as these stacked layers, so the layers stand for the chunk."""
    n = len(layers)
    one = [p for p in layers[0].parameters()]
    t1 = measure(_stack(layers[:1], megatron), one, shape=shape, dtype=dtype, warmup=warmup, repeats=repeats)
    tn = measure(_stack(layers, megatron), [p for layer in layers for p in layer.parameters()], shape=shape,
                 dtype=dtype, warmup=warmup, repeats=repeats)
    forward, backward = ((n * t1[i] - tn[i]) / (n - 1) for i in (0, 1))
    return forward, backward, (f"intercept of time vs layers: 1 layer and the {n}-layer stack, each the median of "
                               f"{repeats} after {warmup} warm-up")


def profile_layers(model: ModelSpec, *, num_layers: int, micro_batch_sizes: list[int], device: str,
                   warmup: int, repeats: int, dtype: torch.dtype, implementation: str,
                   vocab_size: int | None = None, optimizer: bool = False, tp: int = 1, clock: str = "wall",
                   sweep_mib: int = 0, split_backward: bool = False, call_overhead: bool = False,
                   idle_factor: float = 0.0, barrier: bool = True, ep: int = 1) -> Profile:
    """Build the layers (megatron-core, or the torch reference if that fails) and measure them.
    ``tp > 1`` must run on every rank of a gloo world of ``tp`` processes (:func:`profile_tp_layers`),
    an MoE layer's ``ep > 1`` on every rank of a world of ``ep`` (:func:`profile_ep_layers`).
    ``clock`` "thread" times thread CPU time, the clock an emulated run on shared cores stretches
    (EmulationTimer clock=time.thread_time; wall time would count other processes' turns); ``sweep_mib``
    > 0 sweeps that many MiB through the caches before every timed repetition, as the other ranks
    sharing the cores do between two of a rank's actions (a back-to-back profile runs with warm caches).
    ``split_backward`` also times the zero-bubble B/W split of the layers (Profile.backward_split);
    ``call_overhead`` the fixed cost of one call of the stack beyond its layers (Profile.call_overhead).
    ``idle_factor`` > 0: after every timed section wait that many times its measured seconds, as an emulated
    device of slowdown ``idle_factor + 1`` does (EmulationTimer), so processes measuring at once share the host
    as a run's ranks do; ``barrier`` False: processes measuring at once do not start each repetition together
    (profiling.in_run: a run's ranks measuring as their actions run)."""
    if clock not in CLOCKS or sweep_mib < 0:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)} and sweep_mib >= 0, got {clock!r}, {sweep_mib}")
    if not idle_factor >= 0.0:
        raise ValueError(f"idle_factor must be >= 0 (an emulated device's slowdown - 1), got {idle_factor}")
    _TIMING.clock = CLOCKS[clock]
    _TIMING.sweep = torch.zeros(sweep_mib * 2**18) if sweep_mib else None
    _TIMING.idle_factor, _TIMING.barrier = idle_factor, barrier
    try:
        profile = _profile_layers(model, num_layers=num_layers, micro_batch_sizes=micro_batch_sizes, device=device,
                                  warmup=warmup, repeats=repeats, dtype=dtype, implementation=implementation,
                                  vocab_size=vocab_size, optimizer=optimizer, tp=tp, split_backward=split_backward,
                                  call_overhead=call_overhead, ep=ep)
    finally:
        _TIMING.clock, _TIMING.sweep = time.perf_counter, None
        _TIMING.idle_factor, _TIMING.barrier = 0.0, True
    if clock == "wall" and not sweep_mib and not idle_factor:
        return profile
    how = f"; clock {clock} ({'thread CPU time' if clock == 'thread' else 'wall time'})" + (
        f", {sweep_mib} MiB swept through the caches before each repetition" if sweep_mib else "") + (
        f", {idle_factor:g}x each timed section waited after it (an emulated device of slowdown "
        f"{idle_factor + 1:g})" if idle_factor else "")
    return replace(profile, method=profile.method + how, optimizer_method=profile.optimizer_method and profile.optimizer_method + how,
                   backward_split_method=profile.backward_split_method and profile.backward_split_method + how,
                   call_overhead_method=profile.call_overhead_method and profile.call_overhead_method + how)


def _profile_layers(model: ModelSpec, *, num_layers: int, micro_batch_sizes: list[int], device: str,
                    warmup: int, repeats: int, dtype: torch.dtype, implementation: str,
                    vocab_size: int | None, optimizer: bool, tp: int, split_backward: bool = False,
                    call_overhead: bool = False, ep: int = 1) -> Profile:
    if ep > 1 and (not model.is_moe or model.num_experts % ep or max(tp, ep) % min(tp, ep)):
        raise ValueError(f"ep={ep} spreads an MoE layer's experts over ep of max(tp, ep) processes (got tp {tp}, "
                         f"num_experts {model.num_experts}). Fix: pass an MoE model, an ep dividing num_experts, "
                         "and tp and ep dividing one another")
    if call_overhead and num_layers < 2:
        raise ValueError(f"call_overhead: the intercept of time vs layers needs num_layers >= 2, got {num_layers}. "
                         "Fix: pass num_layers=2 (tools/profile_host.py --num-layers 2)")
    cleanup: Callable[[], None] = lambda: None
    fallback_reason = ""
    layers: list[torch.nn.Module] = []
    megatron = implementation in ("auto", "megatron")
    if model.is_moe and model.add_bias_linear and ep == 1:  # megatron-core adds expert biases in place at EP 1
        raise ValueError("an MoE layer with linear biases trains only with expert parallelism > 1 and expert-TP 1 "
                         "(plan/checks.py), so it cannot be measured at EP 1. Fix: measure the model without biases "
                         "(tools/profile_host.py --disable-bias-linear, as Mixtral), or over EP ranks (--ep-sizes)")
    if model.is_moe and not megatron:  # the reference layer is dense: its times would price experts wrongly
        raise ValueError("implementation='torch' has no MoE layer; profile an MoE model with megatron-core "
                         "(tools/profile_host.py --implementation megatron)")
    if megatron:
        try:
            layers, cleanup = _build_megatron(model, num_layers, dtype, tp, ep)
        except Exception as err:  # any megatron-core failure on this machine -> reference layer
            if implementation == "megatron" or tp > 1 or model.is_moe:
                raise
            megatron, fallback_reason = False, f"{type(err).__name__}: {err}"
    if not megatron:
        torch.manual_seed(1234)
        layers = [TorchReferenceLayer(model).to(dtype) for _ in range(num_layers)]
    params = [p for layer in layers for p in layer.parameters()]
    run = _stack(layers, megatron)
    if ep > 1:  # each EP rank routes tokens of its own (as a run's replicas do), not the same ones
        import torch.distributed as dist

        torch.manual_seed(1234 + dist.get_rank())
    entries, parts, opt_s, opt_method = [], (), None, ""
    try:
        if optimizer:
            opt_s, opt_method = profile_optimizer(params, warmup=warmup, repeats=repeats)
        if vocab_size is not None:
            if not megatron:
                raise RuntimeError("--vocab-size needs megatron-core's embedding and output layer, which could not "
                                   f"be built here ({fallback_reason or 'implementation=torch'})")
            parts = profile_parts(model, vocab_size=vocab_size, micro_batch_sizes=micro_batch_sizes,
                                  warmup=warmup, repeats=repeats, dtype=dtype)
        sync = _synchronize()
        for mbs in micro_batch_sizes:
            if _sequence_parallel(model, tp) and model.seq_length % tp:
                raise ValueError(f"seq_length {model.seq_length} does not split over tp {tp} (sequence parallel). "
                                 "Fix: a sequence length divisible by the TP size")
            seq = model.seq_length // tp if _sequence_parallel(model, tp) else model.seq_length  # this rank's share
            fwd, bwd, peak = measure(run, params, shape=(seq, mbs, model.hidden_size), dtype=dtype,
                                     warmup=warmup, repeats=repeats, synchronize=sync)
            entries.append(ProfileEntry(
                hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
                num_query_groups=model.num_query_groups, ffn_hidden_size=model.ffn_hidden_size,
                swiglu=model.swiglu, seq_length=model.seq_length, micro_batch_size=mbs, tp=tp,
                forward_s=fwd / num_layers, backward_s=bwd / num_layers, peak_memory_bytes=peak // num_layers,
                includes_tp_comm=tp > 1, **_moe_entry(model), **({"ep": ep} if ep > 1 else {})))
        if split_backward:
            if not megatron or tp > 1:
                raise RuntimeError("split_backward: the runtime's B/W split routes megatron-core's linears, one "
                                   f"process (this profile: {'tp ' + str(tp) if megatron else 'torch reference layers'})")
            mbs = micro_batch_sizes[0]
            split = measure_split(run, layers, params, shape=(model.seq_length, mbs, model.hidden_size), dtype=dtype,
                                  warmup=warmup, repeats=repeats)
        overhead = measure_call_overhead(layers, megatron, shape=(model.seq_length, micro_batch_sizes[0],
                                                                   model.hidden_size), dtype=dtype, warmup=warmup,
                                         repeats=repeats) if call_overhead else None
    finally:
        cleanup()
    moe = (f", MoE layer ({model.num_experts} experts as SequentialMLP, top-{model.moe_router_topk}, expert "
           f"parallelism {ep})") if model.is_moe else ""
    drop = (f", dropout {model.hidden_dropout:g}/{model.attention_dropout:g} (hidden/attention)"
            if model.hidden_dropout or model.attention_dropout else "")
    what = (f"megatron-core TransformerLayer (local spec{moe}{drop}), CPU backend, gloo world size "
            f"{max(tp, ep)}" if megatron else
            "plain torch reference layer of the same shape" +
            (f" (megatron-core failed: {fallback_reason})" if fallback_reason else ""))
    method = (f"{what}; {dtype}; {num_layers} stacked layers, times per layer = median of {repeats} after "
              f"{warmup} warm-up; memory = parameters + saved-for-backward tensors")
    machine = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
               "python": platform.python_version(), "torch": torch.__version__,
               "threads": torch.get_num_threads()}
    precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
    return Profile(device=device, entries=tuple(entries), method=method, machine=machine, parts=parts,
                   precision=precision, optimizer_s_per_parameter=opt_s, optimizer_method=opt_method,
                   backward_split=split[:2] if split_backward else None,
                   backward_split_method=f"{split[2]}, micro-batch {micro_batch_sizes[0]}" if split_backward else "",
                   call_overhead=overhead[:2] if overhead else None, call_overhead_layers=num_layers,
                   call_overhead_method=f"{overhead[2]}, micro-batch {micro_batch_sizes[0]}" if overhead else "")


def _synchronize() -> Callable[[], None]:
    """A barrier when several processes measure together (TP ranks, or concurrent copies), else nothing."""
    import torch.distributed as dist

    if _TIMING.barrier and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.barrier
    return lambda: None


def _median_times(step: Callable[[], tuple[float, float]], *, warmup: int, repeats: int) -> tuple[float, float]:
    sync = _synchronize()

    def synced() -> tuple[float, float]:
        sync()
        _TIMING.before()
        forward, backward = step()
        _TIMING.after(forward + backward)
        return forward, backward

    runs = [synced() for _ in range(warmup + repeats)][warmup:]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def profile_parts(model: ModelSpec, *, vocab_size: int, micro_batch_sizes: list[int], warmup: int, repeats: int,
                  dtype: torch.dtype) -> tuple[PartEntry, ...]:
    """Embedding (word + learned positions) and output (final norm, logits GEMM, vocab-parallel
    cross entropy, mean) of a first / last stage, megatron-core modules, world size 1."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

    from megatron_het.model.gpt import StageModelSpec, transformer_config

    spec = StageModelSpec(model=model, num_layers=1, layer_offset=0, tp=1, pre_process=True, post_process=True,
                          vocab_size=vocab_size, params_dtype=dtype)
    config = transformer_config(spec)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    embedding = LanguageModelEmbedding(config, vocab_size, model.seq_length, "learned_absolute", tp_group=tp_group)
    norm = torch.nn.LayerNorm(model.hidden_size, dtype=dtype)
    output = tensor_parallel.ColumnParallelLinear(model.hidden_size, vocab_size, config=config,
                                                  init_method=config.init_method, bias=False, skip_bias_add=False,
                                                  gather_output=False, tp_group=tp_group)
    s, entries = model.seq_length, []
    for mbs in micro_batch_sizes:
        tokens = torch.randint(0, vocab_size, (mbs, s))
        positions = torch.arange(s, device=tokens.device).unsqueeze(0).expand(mbs, s)
        hidden = torch.randn(s, mbs, model.hidden_size, dtype=dtype, requires_grad=True)

        def embed() -> tuple[float, float]:
            t0 = _TIMING.clock()
            out = embedding(tokens, positions)
            t1 = _TIMING.clock()
            out.backward(torch.ones_like(out))
            return t1 - t0, _TIMING.clock() - t1

        def head() -> tuple[float, float]:
            t0 = _TIMING.clock()
            logits, _ = output(norm(hidden))
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), tokens.t().contiguous(),
                                                                tp_group=tp_group).mean()
            t1 = _TIMING.clock()
            loss.backward()
            return t1 - t0, _TIMING.clock() - t1

        for part, step in (("embedding", embed), ("output", head)):
            fwd, bwd = _median_times(step, warmup=warmup, repeats=repeats)
            entries.append(PartEntry(part=part, hidden_size=model.hidden_size, vocab_size=vocab_size,
                                     seq_length=s, micro_batch_size=mbs, tp=1, forward_s=fwd, backward_s=bwd))
    return tuple(entries)


def profile_optimizer(params: list[torch.nn.Parameter], *, warmup: int, repeats: int) -> tuple[float, str]:
    """Seconds per parameter of one AdamW step as the runtime builds it (decay / no-decay groups)."""
    for p in params:
        p.grad = torch.randn_like(p)
    decay = [p for p in params if p.dim() > 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                   {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}], lr=1e-4)
    times, sync = [], _synchronize()
    for i in range(warmup + repeats):
        sync()
        _TIMING.before()
        t0 = _TIMING.clock()
        optimizer.step()
        seconds = _TIMING.clock() - t0
        _TIMING.after(seconds)
        if i >= warmup:
            times.append(seconds)
    n = sum(p.numel() for p in params)
    return statistics.median(times) / n, (f"torch.optim.AdamW step (defaults, two param groups) over {n} "
                                          f"parameters, median of {repeats} after {warmup} warm-up")




def _tp_rank(rank: int, world_size: int, model: ModelSpec, kwargs: dict) -> tuple[ProfileEntry, ...]:
    return profile_layers(model, tp=world_size, implementation="megatron", **kwargs).entries


def profile_tp_layers(model: ModelSpec, *, tp: int, num_layers: int, micro_batch_sizes: list[int], device: str,
                      warmup: int, repeats: int, dtype: torch.dtype, timeout_s: float = 1800.0) -> tuple[ProfileEntry, ...]:
    """Layers split over ``tp`` local gloo processes (one thread each), rank 0's times: the layer's
    compute plus its tensor-parallel collectives on this host (``includes_tp_comm``)."""
    from megatron_het.platform.local_launch import run_local

    if tp < 2:
        raise ValueError(f"tp must be >= 2 for a tensor-parallel profile, got {tp}")
    if model.num_attention_heads % tp or model.ffn_hidden_size % tp:
        raise ValueError(f"tp={tp} must divide num_attention_heads={model.num_attention_heads} and "
                         f"ffn_hidden_size={model.ffn_hidden_size}; choose a TP size that divides both")
    kwargs = dict(num_layers=num_layers, micro_batch_sizes=micro_batch_sizes, device=device, warmup=warmup,
                  repeats=repeats, dtype=dtype)
    return run_local(tp, _tp_rank, (model, kwargs), timeout_s=timeout_s)[0]


def _ep_rank(rank: int, world_size: int, model: ModelSpec, tp: int, ep: int, kwargs: dict) -> tuple[ProfileEntry, ...]:
    return profile_layers(model, tp=tp, ep=ep, implementation="megatron", **kwargs).entries


def profile_ep_layers(model: ModelSpec, *, ep: int, num_layers: int, micro_batch_sizes: list[int], device: str,
                      warmup: int, repeats: int, dtype: torch.dtype, tp: int = 1,
                      timeout_s: float = 1800.0) -> tuple[ProfileEntry, ...]:
    """An MoE layer's experts spread over ``ep`` local gloo processes (expert-TP 1) of ``max(tp, ep)``
    (attention split over ``tp``, sequence parallel; each process with tokens of its own, as a run's
    replicas and sequence shards route theirs), one thread each, rank 0's times: the layer's compute plus
    the dispatcher's all-to-all and the waits for the other ranks' experts, on this host (entries' ``ep``)."""
    from megatron_het.platform.local_launch import run_local

    if ep < 2 or not model.is_moe or model.num_experts % ep or max(tp, ep) % min(tp, ep):
        raise ValueError(f"ep must be >= 2 and divide an MoE model's num_experts, and tp and ep each other (got ep "
                         f"{ep}, tp {tp}, num_experts {model.num_experts}). Fix: pass such sizes")
    kwargs = dict(num_layers=num_layers, micro_batch_sizes=micro_batch_sizes, device=device, warmup=warmup,
                  repeats=repeats, dtype=dtype)
    return run_local(max(tp, ep), _ep_rank, (model, tp, ep, kwargs), timeout_s=timeout_s)[0]


def _concurrent_rank(rank: int, world_size: int, model: ModelSpec, kwargs: dict,
                     idle_factors: Sequence[float] | None = None) -> Profile:
    if idle_factors is not None:  # this process stands for one rank of an emulated run
        kwargs = dict(kwargs, idle_factor=idle_factors[rank], barrier=False)
    return profile_layers(model, **kwargs)


def profile_concurrent(model: ModelSpec, *, processes: int, timeout_s: float = 1800.0, **kwargs) -> Profile:
    """:func:`profile_layers` (tp=1) on ``processes`` local processes at once, one thread each, every
    repetition started together: what each of that many ranks sharing this host sees when they all
    compute (cores of a VM can share a physical core or memory bandwidth). Rank 0's profile."""
    from megatron_het.platform.local_launch import run_local

    if processes < 2:
        raise ValueError(f"processes must be >= 2 for a concurrent profile, got {processes}; use profile_layers")
    profile = run_local(processes, _concurrent_rank, (model, kwargs), timeout_s=timeout_s)[0]
    return replace(profile, method=profile.method + f"; {processes} processes measuring at once (rank 0's times)")


def profile_emulated(model: ModelSpec, *, islands: Sequence[str], slowdowns: Sequence[float],
                     timeout_s: float = 1800.0, **kwargs) -> tuple[Profile, ...]:
    """:func:`profile_layers` (tp=1) on one local process per rank of an emulated run, all at once, each
    standing for its rank: rank i is on ``islands[i]`` with its emulated device ``slowdowns[i]`` times
    slower than the host, so after every timed section it waits ``slowdowns[i] - 1`` times it (as
    EmulationTimer does), with no barrier per repetition. One profile per island (``Profile.island``), the
    median over its ranks: a rank that sleeps between its actions wakes to caches the other ranks have
    used, the longer the colder; on the demo's host (2026-11-27) a layer's forward took 5.2 ms of CPU time
    waiting 7x after each section and 3.8 ms waiting 3x, and a profile over both islands priced the slow
    island's actions 30% short."""
    from megatron_het.platform.local_launch import run_local
    from megatron_het.profiling.combine import median_profile

    if len(islands) != len(slowdowns) or not islands or not all(s >= 1.0 for s in slowdowns):
        raise ValueError(f"profile_emulated needs one island and one slowdown >= 1 per rank, got islands {list(islands)} "
                         f"and slowdowns {list(slowdowns)}")
    factors = [float(s) - 1.0 for s in slowdowns]
    if len(islands) == 1:
        profiles = [profile_layers(model, **dict(kwargs, idle_factor=factors[0], barrier=False))]
    else:
        profiles = run_local(len(islands), _concurrent_rank, (model, kwargs, factors), timeout_s=timeout_s)
    out = []
    for name in dict.fromkeys(islands):
        mine = [p for p, i in zip(profiles, islands) if i == name]
        prof = median_profile(mine, what=f"ranks of island {name!r} ({len(islands)} processes measuring at once, "
                                         f"each waiting its emulated device's share after every timed section)")
        out.append(replace(prof, island=name))
    return tuple(out)
