"""Convert checkpoints between megatron-het, Megatron-LM (torch_dist) and Hugging Face safetensors.

    python tools/checkpoint/convert.py --input runs/ckpt --input-format het \
        --output hf-model --output-format hf
    python tools/checkpoint/convert.py --input hf-model --input-format hf \
        --output megatron-ckpt --output-format megatron --tp 4 --pp 2

Weights only (optimizer state is not carried over), plus the run's tokenizer: a Hugging Face export
holds tokenizer.json & co. (AutoTokenizer loads them) from the SentencePiece model the checkpoint keeps
or from --tokenizer-model. The output directory is written atomically.
A bad input (damaged, foreign or unsafe checkpoint, bad flags) is one line on stderr and exit
code 2, with nothing written. Guide: docs/checkpoint-conversion.md.
"""

from __future__ import annotations

import argparse
import sys

from megatron_het.checkpoint.convert import FORMATS, ConvertRequest, convert
from megatron_het.cluster import load_model
from megatron_het.errors import UserError
from megatron_het.utils.progress import Progress, ProgressCallback, add_progress_argument


class _PhaseBars:
    """One progress line per conversion phase ("read hf", then "write het"), each to its own total."""

    def __init__(self, *, quiet: bool) -> None:
        self.quiet = quiet  # --no-progress
        self.bar: Progress | None = None  # the open phase's display

    def __call__(self, label: str) -> ProgressCallback:
        self.close()
        self.bar = Progress(label, unit="tensors", quiet=self.quiet)
        return self.bar.update

    def close(self, *, failed: bool = False) -> None:
        if self.bar is not None:
            self.bar.quiet = self.bar.quiet or failed  # a failure is reported in one line, not two
            self.bar.close(interrupted=failed)
            self.bar = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="convert.py", description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="input directory")
    parser.add_argument("--input-format", required=True, choices=FORMATS)
    parser.add_argument("--output", required=True, help="output directory (must not exist or be empty)")
    parser.add_argument("--output-format", required=True, choices=FORMATS)
    parser.add_argument("--model", default=None, help="model YAML; needed when the input does not describe the model")
    parser.add_argument("--tp", type=int, default=1, help="target TP size (vocabulary padding of het/megatron output)")
    parser.add_argument("--pp", type=int, default=1, help="target PP size (recorded in het/megatron output)")
    tokenizer = parser.add_mutually_exclusive_group()
    tokenizer.add_argument("--tokenizer-model", default=None, metavar="PATH",
                           help="SentencePiece .model the run trained with, written with the weights (wins over "
                                "the tokenizer.model the input keeps)")
    tokenizer.add_argument("--no-tokenizer", action="store_true",
                           help="write the weights alone, even when the input keeps a tokenizer")
    add_progress_argument(parser)
    args = parser.parse_args(argv)
    bars = _PhaseBars(quiet=args.no_progress)
    try:
        model = load_model(args.model) if args.model else None
        request = ConvertRequest(input=args.input, input_format=args.input_format, output=args.output,
                                 output_format=args.output_format, model=model, tp=args.tp, pp=args.pp,
                                 tokenizer_model=args.tokenizer_model, no_tokenizer=args.no_tokenizer)
        state = convert(request, progress=bars)
    except UserError as e:  # bugs are not caught: they surface as tracebacks
        bars.close(failed=True)
        print(f"convert.py: {e}", file=sys.stderr)
        return 2
    bars.close()
    print(f"converted {len(state.tensors)} tensors ({state.model.num_layers} layers, iteration {state.iteration}) "
          f"from {args.input_format} to {args.output_format}: {args.output}", file=sys.stderr)
    if state.tokenizer_model is not None:
        print(f"tokenizer: {state.tokenizer_model} written with the weights", file=sys.stderr)
    elif not args.no_tokenizer:
        print(f"convert.py: no tokenizer written ({args.input} keeps no tokenizer.model); to add one, rerun with "
              f"--tokenizer-model PATH (the SentencePiece .model the run trained with)", file=sys.stderr)
    return 0
