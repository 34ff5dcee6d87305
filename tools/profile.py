#!/usr/bin/env python
"""Measure per-layer forward/backward time and memory on this machine; write a profile JSON.

    python tools/profile.py --num-layers 2 --hidden-size 256 --num-attention-heads 4 \\
        --seq-length 128 --micro-batch-sizes 1,2,4 --output PROFILE.json

The layers are megatron-core ``TransformerLayer``s built from the local layer spec
(``get_gpt_layer_local_spec``), run on CPU in a single-process gloo group (world size 1) after
``megatron_het.platform.enable_cpu_backend()``. If megatron-core cannot be built here, a plain
torch layer of the same shape (pre-norm attention + MLP, unfused softmax) is measured instead and
the profile's "method" says so. ``--num-layers`` layers are stacked and times divided by it, which
amortises per-call overhead; each time is the median of ``--repeats`` runs after ``--warmup``.

Peak memory per layer = parameter bytes + bytes of the tensors autograd saves for backward
(``torch.autograd.graph.saved_tensors_hooks``, each storage counted once). tracemalloc cannot see
torch's allocator, and this sum is what the activation model in ``megatron_het/perf/memory.py``
predicts, so the two can be compared directly.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# This file's name shadows the standard library's ``profile`` (which cProfile, imported by
# megatron-core's dependencies, needs): drop tools/ from the path, add the checkout root instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))  # run from a checkout without installing

import torch  # noqa: E402

from megatron_het.cluster import ModelSpec  # noqa: E402
from megatron_het.perf.flops import padded_vocab_size  # noqa: E402
from megatron_het.perf.profile import PartEntry, Profile, ProfileEntry, save_profile  # noqa: E402

LayerStack = Callable[[torch.Tensor], torch.Tensor]


class _TorchReferenceLayer(torch.nn.Module):
    """Pre-norm GPT/Llama layer in plain torch, shaped like megatron-core's local spec."""

    def __init__(self, model: ModelSpec) -> None:
        super().__init__()
        h, d = model.hidden_size, model.kv_channels
        self.heads, self.groups, self.d, self.swiglu = model.num_attention_heads, model.num_query_groups, d, model.swiglu
        bias = not model.swiglu
        norm = torch.nn.RMSNorm if model.swiglu else torch.nn.LayerNorm
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
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _build_megatron(model: ModelSpec, num_layers: int, dtype: torch.dtype) -> tuple[list[torch.nn.Module], Callable[[], None]]:
    """Megatron-core layers in a world-size-1 gloo group; returns them and a cleanup function."""
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
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups, ffn_hidden_size=model.ffn_hidden_size,
        gated_linear_unit=model.swiglu, add_bias_linear=not model.swiglu,
        activation_func=torch.nn.functional.silu if model.swiglu else torch.nn.functional.gelu,
        normalization="RMSNorm" if model.swiglu else "LayerNorm",
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
    )
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    layers = [build_module(spec, config=config, layer_number=i + 1).to(dtype) for i in range(num_layers)]

    def cleanup() -> None:
        parallel_state.destroy_model_parallel()
        if created_group:
            dist.destroy_process_group()

    return layers, cleanup


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
            warmup: int, repeats: int) -> tuple[float, float, int]:
    """Median forward and backward seconds of the whole stack, and its peak bytes."""
    x = torch.randn(*shape, dtype=dtype, requires_grad=True)
    forward, backward = [], []
    for i in range(warmup + repeats):
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        out = run(x)
        t1 = time.perf_counter()
        out.backward(torch.ones_like(out))
        t2 = time.perf_counter()
        if i >= warmup:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
    peak = sum(p.numel() * p.element_size() for p in params) + _saved_bytes(run, x)
    return statistics.median(forward), statistics.median(backward), peak


def profile_layers(model: ModelSpec, *, num_layers: int, micro_batch_sizes: list[int], device: str,
                   warmup: int, repeats: int, dtype: torch.dtype, implementation: str,
                   vocab_size: int | None = None, optimizer: bool = False) -> Profile:
    """Build the layers (megatron-core, or the torch reference if that fails) and measure them."""
    cleanup: Callable[[], None] = lambda: None
    fallback_reason = ""
    layers: list[torch.nn.Module] = []
    megatron = implementation in ("auto", "megatron")
    if megatron:
        try:
            layers, cleanup = _build_megatron(model, num_layers, dtype)
        except Exception as err:  # any megatron-core failure on this machine -> reference layer
            if implementation == "megatron":
                raise
            megatron, fallback_reason = False, f"{type(err).__name__}: {err}"
    if not megatron:
        torch.manual_seed(1234)
        layers = [_TorchReferenceLayer(model).to(dtype) for _ in range(num_layers)]
    params = [p for layer in layers for p in layer.parameters()]
    run = _stack(layers, megatron)
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
        for mbs in micro_batch_sizes:
            fwd, bwd, peak = measure(run, params, shape=(model.seq_length, mbs, model.hidden_size), dtype=dtype,
                                     warmup=warmup, repeats=repeats)
            entries.append(ProfileEntry(
                hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads,
                num_query_groups=model.num_query_groups, ffn_hidden_size=model.ffn_hidden_size,
                swiglu=model.swiglu, seq_length=model.seq_length, micro_batch_size=mbs, tp=1,
                forward_s=fwd / num_layers, backward_s=bwd / num_layers, peak_memory_bytes=peak // num_layers))
    finally:
        cleanup()
    what = ("megatron-core TransformerLayer (local spec), CPU backend, gloo world size 1" if megatron else
            "plain torch reference layer of the same shape" +
            (f" (megatron-core failed: {fallback_reason})" if fallback_reason else ""))
    method = (f"{what}; {dtype}; {num_layers} stacked layers, times per layer = median of {repeats} after "
              f"{warmup} warm-up; memory = parameters + saved-for-backward tensors")
    machine = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
               "python": platform.python_version(), "torch": torch.__version__,
               "threads": torch.get_num_threads()}
    return Profile(device=device, entries=tuple(entries), method=method, machine=machine, parts=parts,
                   optimizer_s_per_parameter=opt_s, optimizer_method=opt_method)


def _median_times(step: Callable[[], tuple[float, float]], *, warmup: int, repeats: int) -> tuple[float, float]:
    runs = [step() for _ in range(warmup + repeats)][warmup:]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def profile_parts(model: ModelSpec, *, vocab_size: int, micro_batch_sizes: list[int], warmup: int, repeats: int,
                  dtype: torch.dtype) -> tuple[PartEntry, ...]:
    """Embedding (word + learned positions) and output (final norm, logits GEMM, vocab-parallel
    cross entropy, mean) of a first / last stage, megatron-core modules, world size 1."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

    from megatron_het.runtime.gpt_model import StageModelSpec, transformer_config

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
        positions = torch.arange(s).unsqueeze(0).expand(mbs, s)
        hidden = torch.randn(s, mbs, model.hidden_size, dtype=dtype, requires_grad=True)

        def embed() -> tuple[float, float]:
            t0 = time.perf_counter()
            out = embedding(tokens, positions)
            t1 = time.perf_counter()
            out.backward(torch.ones_like(out))
            return t1 - t0, time.perf_counter() - t1

        def head() -> tuple[float, float]:
            t0 = time.perf_counter()
            logits, _ = output(norm(hidden))
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), tokens.t().contiguous(),
                                                                tp_group=tp_group).mean()
            t1 = time.perf_counter()
            loss.backward()
            return t1 - t0, time.perf_counter() - t1

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
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        optimizer.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    n = sum(p.numel() for p in params)
    return statistics.median(times) / n, (f"torch.optim.AdamW step (defaults, two param groups) over {n} "
                                          f"parameters, median of {repeats} after {warmup} warm-up")


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--micro-batch-sizes: expected integers like 1,2,4 (got {text!r})") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--micro-batch-sizes: expected positive integers like 1,2,4 (got {text!r})")
    return sizes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-layers", type=int, default=1, help="layers to stack (times are per layer)")
    ap.add_argument("--hidden-size", type=int, required=True)
    ap.add_argument("--num-attention-heads", type=int, required=True)
    ap.add_argument("--num-query-groups", type=int, default=None)
    ap.add_argument("--ffn-hidden-size", type=int, default=None)
    ap.add_argument("--seq-length", type=int, required=True)
    ap.add_argument("--swiglu", action="store_true")
    ap.add_argument("--micro-batch-sizes", type=_sizes, default=[1, 2, 4])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--device", default="CPU", help="catalog device type name recorded in the profile")
    ap.add_argument("--implementation", choices=("auto", "megatron", "torch"), default="auto",
                    help="auto: megatron-core, falling back to the torch reference layer")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="also measure the embedding and the output layer + loss for this vocabulary (padded "
                         "like Megatron to a multiple of 128)")
    ap.add_argument("--optimizer", action="store_true", help="also measure the AdamW step per parameter")
    ap.add_argument("--comm-ranks", type=int, default=0,
                    help="also measure all-reduce and send/recv among this many local gloo processes and fit "
                         "the latency/bandwidth the model uses for links of this host (0: skip)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's); match what each training rank uses, e.g. 1 "
                         "when one process per core stands in for a GPU (megatron_het.platform.local_launch)")
    ap.add_argument("--output", required=True)
    args = ap.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    model = ModelSpec(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                      ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length, vocab_size=1,
                      swiglu=args.swiglu)
    if args.vocab_size is not None and args.vocab_size < 1:
        ap.error(f"--vocab-size must be >= 1, got {args.vocab_size}")
    if args.comm_ranks == 1 or args.comm_ranks < 0:
        ap.error(f"--comm-ranks must be 0 (skip) or >= 2, got {args.comm_ranks}")
    vocab = None if args.vocab_size is None else padded_vocab_size(args.vocab_size)
    profile = profile_layers(model, num_layers=args.num_layers, micro_batch_sizes=args.micro_batch_sizes,
                             device=args.device, warmup=args.warmup, repeats=args.repeats,
                             dtype=getattr(torch, args.dtype), implementation=args.implementation,
                             vocab_size=vocab, optimizer=args.optimizer)
    if args.comm_ranks:
        from dataclasses import replace

        from megatron_het.perf.probe import measure_link

        profile = replace(profile, link=measure_link(args.comm_ranks))
    save_profile(profile, args.output)
    print(f"wrote {args.output}: {profile.method}")
    for e in profile.entries:
        print(f"  micro_batch_size={e.micro_batch_size}: forward {e.forward_s * 1e3:.3f} ms, "
              f"backward {e.backward_s * 1e3:.3f} ms, peak {e.peak_memory_bytes / 2**20:.1f} MiB per layer")
    for p in profile.parts:
        print(f"  {p.part} (vocab {p.vocab_size}), micro_batch_size={p.micro_batch_size}: forward "
              f"{p.forward_s * 1e3:.3f} ms, backward {p.backward_s * 1e3:.3f} ms")
    if profile.optimizer_s_per_parameter is not None:
        print(f"  AdamW step: {profile.optimizer_s_per_parameter * 1e9:.2f} ns per parameter")
    if profile.link is not None:
        print(f"  links of this host ({profile.link.ranks} processes): latency {profile.link.latency_us:.1f} us, "
              f"bandwidth {profile.link.bandwidth_gbps:.2f} Gbit/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
