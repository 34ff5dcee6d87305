"""`make demo`: heterogeneous training on an emulated two-type CPU cluster, end to end.

1. data: SentencePiece tokenizer and megatron indexed dataset from the shipped corpus (idempotent);
2. plan: the planner picks a plan for examples/clusters/cpu-demo.yaml (islands `fast` and `slow`,
   the latter emulated 2x slower) and the tiny model (runs/demo/plan.json), and prices it from a
   quick profile of this host (measured once, cached in runs/demo/profile);
3. train: torchrun starts 4 gloo processes running pretrain_gpt.py with that plan; loss goes down,
   a validation loss is reported, and a checkpoint is written to runs/demo/checkpoints; last, the
   predicted and the measured iteration time side by side.

Extra arguments go to pretrain_gpt.py unchanged: ``python pretrain_scripts/demo.py --bf16``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUN = os.path.join(ROOT, "runs", "demo")
DATA = os.path.join(RUN, "data")
ITERATION_MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def prepare_data() -> tuple[str, str]:
    from megatron_het.data import PreprocessConfig, TokenizerTrainConfig, preprocess, train_tokenizer

    corpus = os.path.join(ROOT, "examples", "data", "corpus.jsonl")
    os.makedirs(DATA, exist_ok=True)
    model = os.path.join(DATA, "sp512.model")
    if not os.path.exists(model):
        report = train_tokenizer(TokenizerTrainConfig(input=Path(corpus), vocab_size=512,
                                                      output_prefix=Path(DATA, "sp512")))
        print(f"demo: trained tokenizer {report.model_path} ({report.vocab_size} pieces)")
    prefix = os.path.join(DATA, "corpus")
    if not os.path.exists(prefix + "_text_document.idx"):
        report = preprocess(PreprocessConfig(input=Path(corpus), output_prefix=prefix,
                                             tokenizer_type="SentencePieceTokenizer", tokenizer_model=Path(model),
                                             append_eod=True))
        print(f"demo: preprocessed {report.documents} documents, {sum(report.tokens.values())} tokens")
    return model, prefix + "_text_document"


def choose_plan(model, cluster, *, micro: int, global_batch: int) -> str:
    """The planner's best plan (what ``--hetero-plan auto`` picks), written where the run reads it, so
    the prediction below prices exactly the plan that trains."""
    from megatron_het.plan import save_plan
    from megatron_het.planner.modes import plan_best

    # the plan is chosen at and records the precision this demo trains in (extra --bf16/--fp16 pass
    # through), so both modes are compared, and the prediction below and the run agree, at it
    # (pretrain_gpt.py runs what the plan records)
    precision = "bf16" if "--bf16" in sys.argv[1:] else "fp16" if "--fp16" in sys.argv[1:] else "fp32"
    choice = plan_best(model, cluster, global_batch_size=global_batch, micro_batch_sizes=(micro,),
                       pipeline_options={"top_k": 3, "precision": precision}, sharded_options={"precision": precision})
    print(f"demo: planner: {choice.explanation}", flush=True)
    path = os.path.join(RUN, "plan.json")
    save_plan(dataclasses.replace(choice.plan, precision=precision), path)  # either kind records it
    return path


def train(cmd: list[str], env: dict) -> tuple[int, list[float]]:
    """Run torchrun, echoing its output; returns its exit code and the logged ms per iteration."""
    measured = []
    with subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1) as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            match = ITERATION_MS.search(line)
            if match:
                measured.append(float(match.group(1)))
    return proc.returncode, measured


def main() -> int:
    from megatron_het.cluster import load_cluster, load_model
    from megatron_het.plan import load_any_plan, save_plan
    from megatron_het.profiling.host import predict_on_this_host

    tokenizer, data = prepare_data()
    cluster_file = os.path.join(ROOT, "examples", "clusters", "cpu-demo-paced.yaml")
    model_file = os.path.join(ROOT, "examples", "models", "tiny-cpu.yaml")
    cluster, model = load_cluster(cluster_file), load_model(model_file)
    plan_file = choose_plan(model, cluster, micro=2, global_batch=16)
    # the same plan priced from a quick profile of this host (measured once, cached in runs/demo/profile);
    # the plan file then carries that figure, not the nominal CPU catalog entry's
    plan = load_any_plan(plan_file)
    predicted = predict_on_this_host(plan, model, cluster, cache_dir=os.path.join(RUN, "profile"))
    if hasattr(predicted.prediction, "to_json_dict"):
        save_plan(dataclasses.replace(plan, predicted=predicted.prediction.to_json_dict()), plan_file)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", "29517",
           os.path.join(ROOT, "pretrain_scripts", "pretrain_gpt.py"),
           "--hetero-cluster", cluster_file, "--hetero-plan", plan_file, "--hetero-model", model_file,
           "--data-path", data, "--tokenizer-model", tokenizer, "--split", "949,50,1",
           "--data-cache-path", os.path.join(DATA, "cache"),
           "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "40",
           "--lr", "3e-3", "--lr-decay-style", "cosine", "--min-lr", "3e-4", "--lr-warmup-iters", "4",
           "--log-interval", "5", "--eval-interval", "20", "--eval-iters", "2",
           "--save", os.path.join(RUN, "checkpoints"), *sys.argv[1:]]  # extra flags pass through (e.g. --bf16)
    print("demo: " + " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd[1:]), flush=True)
    code, measured = train(cmd, dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    if code == 0 and len(measured) > 1:
        steady = statistics.median(measured[1:])  # the first interval includes start-up
        where = ", ".join(os.path.relpath(p, ROOT) for p in predicted.profile_paths)
        print(f"demo: iteration time: predicted {predicted.iteration_time_s * 1e3:.1f} ms (plan priced from a "
              f"profile of this host, {where}), measured {steady:.1f} ms "
              f"(median of the log intervals after the first): predicted/measured "
              f"{predicted.iteration_time_s * 1e3 / steady:.2f}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
