"""One conversion: read the input format into the neutral form, write the output format atomically."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from megatron_het.checkpoint.convert.errors import ConvertError
from megatron_het.checkpoint.convert.het import read_het, write_het
from megatron_het.checkpoint.convert.hf import read_hf, write_hf
from megatron_het.checkpoint.convert.hf_tokenizer import check_tokenizer_model
from megatron_het.checkpoint.convert.io import atomic_output_dir, check_output_dir
from megatron_het.checkpoint.convert.megatron import read_megatron, write_megatron
from megatron_het.checkpoint.convert.state import ModelState
from megatron_het.cluster import ModelSpec
from megatron_het.utils.progress import ProgressCallback

FORMATS = ("het", "megatron", "hf")


@dataclass(frozen=True, kw_only=True)
class ConvertRequest:
    """What tools/checkpoint/convert.py was asked to do."""

    input: str  # input directory (a --save directory, an iter_XXXXXXX directory, or a HF model directory)
    input_format: str  # one of FORMATS
    output: str  # output directory; must not exist (or be empty); written atomically
    output_format: str  # one of FORMATS
    model: ModelSpec | None = None  # overrides the model the input describes (needed when it records none)
    tp: int = 1  # target tensor-parallel size: vocabulary padding (and recorded args) of het/megatron output
    pp: int = 1  # target pipeline-parallel size: recorded in the output's args/plan only
    tokenizer_model: str | None = None  # SentencePiece .model to write with the weights; wins over the input's
    no_tokenizer: bool = False  # write the weights alone, even when the input carries a tokenizer

    def __post_init__(self) -> None:
        if self.no_tokenizer and self.tokenizer_model is not None:
            raise ConvertError(f"--no-tokenizer: conflicts with --tokenizer-model {self.tokenizer_model}. "
                               f"Fix: pass one of the two")
        for name in ("input_format", "output_format"):
            if getattr(self, name) not in FORMATS:
                raise ConvertError(f"--{name.replace('_', '-')}: unknown format {getattr(self, name)!r}. "
                                   f"Fix: use one of {', '.join(FORMATS)}")
        for name in ("tp", "pp"):
            if getattr(self, name) < 1:
                raise ConvertError(f"--{name}: must be >= 1 (got {getattr(self, name)}). Fix: pass --{name} 1 or more")


def read_state(path: str, fmt: str, *, model: ModelSpec | None = None,
               progress: ProgressCallback | None = None) -> ModelState:
    readers = {"het": read_het, "megatron": read_megatron, "hf": read_hf}
    return readers[fmt](path, model=model, progress=progress)


def write_state(state: ModelState, out_dir: str, fmt: str, *, tp: int = 1, pp: int = 1,
                progress: ProgressCallback | None = None) -> None:
    if fmt == "hf":
        write_hf(state, out_dir, progress=progress)
    elif fmt == "het":
        write_het(state, out_dir, tp=tp, pp=pp, progress=progress)
    else:
        write_megatron(state, out_dir, tp=tp, pp=pp, progress=progress)


def check_parallel_sizes(model: ModelSpec, *, tp: int, pp: int) -> None:
    """Refuse a --tp / --pp the model cannot be split by: TP with the check plan.py and predict.py apply
    (it divides the heads, query groups and MLP width); PP must divide the layers, as the het and
    Megatron-LM writers split them evenly over the stages (so it never exceeds them)."""
    from megatron_het.plan import PlanError, homogeneous_plan, validate_plan

    try:
        validate_plan(homogeneous_plan(tp=tp, pp=1, dp=1, num_layers=model.num_layers, micro_batch_size=1,
                                       global_batch_size=1, island="target", device_type="CPU"), model)
    except PlanError as e:
        raise ConvertError(f"--tp {tp}: {e.problem} (the model has {model.num_attention_heads} attention heads). "
                           f"Fix: {e.fix}") from None
    layers = model.num_layers
    if layers % pp:
        fits = [d for d in range(1, layers + 1) if layers % d == 0]
        why = "exceeds" if pp > layers else "does not divide"
        raise ConvertError(f"--pp {pp}: {why} the model's num_layers={layers} (the output splits the layers evenly "
                           f"over the pipeline stages). Fix: use a PP size that divides {layers}: one of {fits[:12]}")


PhaseProgress = Callable[[str], ProgressCallback]  # phase label ("read hf", "write het") -> its callback


def convert(request: ConvertRequest, *, progress: PhaseProgress | None = None) -> ModelState:
    """Run the conversion; returns the state that was written (``tokenizer_model``: the tokenizer
    written with it, None when none was).

    Two phases, each with its own count: ``progress("read <fmt>")`` returns the callback for the
    tensors read, then ``progress("write <fmt>")`` the one for the tensors written; each phase's
    last call is ``(total, total)``, made once that phase's files are written or read.
    """
    check_output_dir(request.output)  # before the (long) read
    export = request.output_format == "hf"  # het and megatron outputs only keep the file
    if request.tokenizer_model is not None:  # a wrong file fails before the (long) read
        check_tokenizer_model(request.tokenizer_model, export=export)
    on_read = progress(f"read {request.input_format}") if progress is not None else None
    state = read_state(request.input, request.input_format, model=request.model, progress=on_read)
    if request.output_format != "hf":  # hf output is unsharded; het/megatron record tp and pp
        check_parallel_sizes(state.model, tp=request.tp, pp=request.pp)
    if request.no_tokenizer or request.tokenizer_model is not None:
        state = dataclasses.replace(state, tokenizer_model=request.tokenizer_model)
    if state.tokenizer_model is not None:
        check_tokenizer_model(state.tokenizer_model, vocab_size=state.model.vocab_size, export=export)
    with atomic_output_dir(request.output) as tmp:
        on_write = progress(f"write {request.output_format}") if progress is not None else None
        write_state(state, tmp, request.output_format, tp=request.tp, pp=request.pp, progress=on_write)
    return state
