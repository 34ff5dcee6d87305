"""Conversion against real megatron-core models: logits of the converted HF model, het and Megatron-LM
checkpoints written by megatron-core itself, exact round trips through every format.

One spawned gloo process (world size 1) builds a GPT (tied, learned positions) and a Llama-style
model (RMSNorm, rotary, SwiGLU, GQA, untied) with megatron_het.model.gpt.build_gpt_stage,
saves each as megatron-core's GPTModel.sharded_state_dict (as Megatron-LM does) and as a megatron-het
checkpoint (dist_ckpt.save_checkpoint, as the trainer does, keeping the run's SentencePiece model),
and runs the conversions. The HF export is then used as a user would: transformers' AutoTokenizer and
AutoModelForCausalLM from the exported directory, on text, against megatron-core's logits.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_het.cluster import ModelSpec

from support.paths import REPO

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read when huggingface_hub is imported: everything is local
ROOT = REPO
# vocab 384 (padded to 384 at TP 1, 512 at TP 2) and a 384-piece tokenizer trained as `make demo` does.
GPT = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=384)
LLAMA = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                  seq_length=32, vocab_size=384, swiglu=True, untie_embeddings_and_output_weights=True)
TOLERANCE = 1e-4  # abs, fp32 logits of HF vs megatron-core (measured <= 9e-7)
# Text a user would feed the export: indentation, a double space, a character outside the vocabulary.
TEXT = "def add(a, b):\n    return a + b  # sum \u2713"


def _worker(rank: int, world_size: int, out: str, tokenizer: str) -> dict:
    """Both models in one process: megatron-core's import (~15 s) is paid once."""
    return {"gpt": _convert_model(GPT, os.path.join(out, "gpt"), tokenizer),
            "llama": _convert_model(LLAMA, os.path.join(out, "llama"), tokenizer)}


def _convert_model(model: ModelSpec, out: str, tokenizer: str) -> dict:
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rope
    import sentencepiece as spm
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import megatron_het.platform  # noqa: F401  (triton import guard before any megatron import)
    from megatron_het.checkpoint.convert import ConvertRequest, convert, megatron_args, read_het
    from megatron_het.checkpoint.convert.state import VOCAB_ROWS, unpad_vocab
    from megatron_het.checkpoint.dist_ckpt import TensorSlot, model_common_state, save_checkpoint
    from megatron_het.checkpoint.full_state import assemble_full_state, local_shards
    from megatron_het.model.gpt import StageModelSpec, build_gpt_stage, transformer_config
    from megatron_het.model.groups import BlockShape, block_process_groups
    from megatron_het.perf.flops import padded_vocab_size
    from megatron_het.platform import enable_cpu_backend
    from megatron_het.platform.cpu_backend import _CpuTorchProxy

    enable_cpu_backend()
    # megatron-core 0.19.2 rotary_pos_embedding.py:162 moves inv_freq to torch.cuda.current_device();
    # the platform's CPU backend does not redirect that module yet.
    rope.torch = _CpuTorchProxy()
    model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0)
    _, pgc = block_process_groups(BlockShape(tp=1, pp=1, dp=1))
    padded = padded_vocab_size(model.vocab_size, tp=1)
    spec = StageModelSpec(model=model, num_layers=model.num_layers, layer_offset=0, tp=1, pre_process=True,
                          post_process=True, vocab_size=padded)
    gpt = build_gpt_stage(spec, transformer_config(spec), pgc)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in gpt.parameters():  # norms and biases start at 1/0: make every tensor informative
            p.add_(torch.randn_like(p) * 0.05)
    gpt.eval()
    tokens = torch.randint(0, model.vocab_size, (2, model.seq_length), generator=torch.Generator().manual_seed(1))
    position_ids = torch.arange(model.seq_length).unsqueeze(0).expand_as(tokens)
    # The project's own tokenizer on TEXT (SentencePiece, as the data pipeline encodes corpora).
    text_ids = torch.tensor([spm.SentencePieceProcessor(model_file=tokenizer).encode(TEXT)])
    assert text_ids.shape[1] <= model.seq_length
    with torch.no_grad():
        logits = gpt(tokens, position_ids, None)[..., :model.vocab_size].clone()
        text_positions = torch.arange(text_ids.shape[1]).unsqueeze(0)
        text_logits = gpt(text_ids, text_positions, None)[..., :model.vocab_size].clone()
    tied = not model.untie_embeddings_and_output_weights
    shards = local_shards(gpt, layer_offset=0, tp_rank=0, tp_size=1, tied=tied, gated=model.swiglu)
    full = {n: unpad_vocab(t, model.vocab_size, name=n) if n in VOCAB_ROWS else t
            for n, t in assemble_full_state([shards]).items()}

    # A Megatron-LM checkpoint as its save_checkpoint writes it (model part): megatron-core's own keys.
    meg = os.path.join(out, "megatron-lm")
    os.makedirs(os.path.join(meg, "iter_0000007"))
    dist_checkpointing.save({"model": gpt.sharded_state_dict(metadata={"dp_cp_group": pgc.dp_cp}),
                             "args": megatron_args(model, tp=1, pp=1, padded_vocab=padded, iteration=7),
                             "checkpoint_version": 3.0, "iteration": 7}, os.path.join(meg, "iter_0000007"))
    with open(os.path.join(meg, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("7")
    # A megatron-het checkpoint as the trainer writes it (a gated fc1 as its gate and up halves).
    het = os.path.join(out, "het")
    slots = {n: TensorSlot(tensor=s.tensor, partition_dim=s.partition_dim, tp_rank=0, tp_size=1, main=True,
                           glu=s.glu) for n, s in shards.items()}
    moments = {n: {"exp_avg": torch.zeros_like(s.tensor), "exp_avg_sq": torch.zeros_like(s.tensor)}
               for n, s in shards.items()}
    save_checkpoint(het, 5, params=slots, optimizer_state=moments,
                    common={"model": model_common_state(model), "padded_vocab": padded, "plan": None},
                    tokenizer_model=tokenizer)

    def run(src, src_fmt, dst, dst_fmt, **kw):
        convert(ConvertRequest(input=os.path.join(out, src), input_format=src_fmt, output=os.path.join(out, dst),
                               output_format=dst_fmt, **kw))

    run("megatron-lm", "megatron", "hf-from-megatron", "hf")
    run("het", "het", "hf-from-het", "hf")
    run("hf-from-het", "hf", "het-from-hf", "het", tp=2)
    run("het", "het", "megatron-from-het", "megatron", tp=2, pp=2)
    run("megatron-from-het", "megatron", "het-from-megatron", "het")
    reread = {name: read_het(os.path.join(out, name)) for name in ("het-from-hf", "het-from-megatron")}
    return {"logits": logits, "tokens": tokens, "full": full, "text_ids": text_ids, "text_logits": text_logits,
            "reread": {k: (dict(v.tensors), v.iteration, v.tokenizer_model) for k, v in reread.items()}}


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
    from megatron_het.data.tokenizer import TokenizerTrainConfig, train_tokenizer

    corpus = ROOT / "examples" / "data" / "corpus.jsonl"
    out = tmp_path_factory.mktemp("sp")
    config = TokenizerTrainConfig(input=corpus, output_prefix=out / "sp", vocab_size=GPT.vocab_size)
    return str(train_tokenizer(config).model_path)


@pytest.fixture(scope="module")
def converted_both(tmp_path_factory, sp_model):
    from megatron_het.platform.local_launch import run_local

    out = tmp_path_factory.mktemp("convert")
    return out, run_local(1, _worker, (str(out), sp_model), timeout_s=600)[0]


@pytest.fixture(params=["gpt", "llama"])
def converted(request, converted_both):
    out, results = converted_both
    return {"gpt": GPT, "llama": LLAMA}[request.param], out / request.param, results[request.param]


def _hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers  # a test dependency (scripts/bootstrap_env.sh installs it): no skip
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("source", ["hf-from-megatron", "hf-from-het"])
def test_hf_logits_match_megatron_core(converted, source):
    model, out, result = converted
    hf = _hf_logits(out / source, result["tokens"])
    assert hf.shape == (2, model.seq_length, model.vocab_size)  # unpadded vocabulary
    diff = (hf - result["logits"]).abs().max().item()
    assert diff < TOLERANCE, f"max |logit difference| {diff}"
    assert result["logits"].abs().max().item() > 0.1  # not trivially zero


def test_hf_export_runs_on_text_as_is(converted, sp_model):
    """A user's three lines: AutoTokenizer and AutoModelForCausalLM from the export, then the model on
    text; the tokenizer gives SentencePiece's ids and the logits are megatron-core's on them."""
    import sentencepiece as spm
    import transformers

    model, out, result = converted
    export = out / "hf-from-het"
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(export))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    batch = tokenizer(TEXT, return_tensors="pt")
    assert batch.input_ids.tolist() == result["text_ids"].tolist()  # == SentencePiece's ids (worker)
    assert batch.input_ids[0].tolist() == spm.SentencePieceProcessor(model_file=sp_model).encode(TEXT)
    assert tokenizer.decode(batch.input_ids[0]) == TEXT
    with torch.no_grad():
        logits = hf(**batch).logits
    diff = (logits - result["text_logits"]).abs().max().item()
    assert diff <= TOLERANCE, f"max |logit difference| {diff}"
    assert result["text_logits"].abs().max().item() > 0.1  # not trivially zero
    assert hf.generation_config.eos_token_id == tokenizer.eos_token_id == 2  # generate() stops at the eod


def test_tokenizer_is_carried_through_every_format(converted, sp_model):
    _, out, result = converted
    original = Path(sp_model).read_bytes()
    assert (out / "het" / "iter_0000005" / "tokenizer.model").read_bytes() == original  # save_checkpoint keeps it
    for name in ("het-from-hf", "het-from-megatron"):
        path = result["reread"][name][2]
        assert path is not None and Path(path).read_bytes() == original, name
    assert (out / "megatron-from-het" / "iter_0000005" / "tokenizer.model").read_bytes() == original
    assert not (out / "hf-from-megatron" / "tokenizer.json").exists()  # Megatron-LM's own save keeps none


def test_round_trips_are_exact(converted):
    model, _, result = converted
    full = result["full"]
    for name, (tensors, _, _) in result["reread"].items():
        assert set(tensors) == set(full), name
        for key, value in full.items():
            assert torch.equal(tensors[key], value), f"{name}: {key}"


def test_iteration_and_padding_are_carried(converted):
    model, out, result = converted
    assert result["reread"]["het-from-megatron"][1] == 5  # het (5) -> megatron -> het
    assert (out / "megatron-from-het" / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert (out / "het-from-hf" / "iter_0000000").is_dir()  # HF carries no iteration


def test_megatron_checkpoint_keys_are_megatron_cores(converted):
    from megatron.core import dist_checkpointing

    model, out, _ = converted
    meta = dist_checkpointing.load_tensors_metadata(str(out / "megatron-from-het" / "iter_0000005"))
    assert tuple(meta["decoder.layers.self_attention.linear_qkv.weight"].global_shape)[0] == model.num_layers
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in meta
    # --tp 2 pads the vocabulary to a multiple of 256.
    assert tuple(meta["embedding.word_embeddings.weight"].global_shape) == (512, model.hidden_size)
    common = dist_checkpointing.load_common_state_dict(str(out / "megatron-from-het" / "iter_0000005"))
    assert common["args"].tensor_model_parallel_size == 2 and common["args"].pipeline_model_parallel_size == 2


def test_het_checkpoints_store_a_gated_fc1_as_the_trainer_does(converted):
    """The trainer stores a gated fc1 as its .gate and .up halves (a TP shard holds [gate_r; up_r]); so does
    every het output of the converter, which pretrain_gpt.py --load reads."""
    from megatron.core import dist_checkpointing

    model, out, _ = converted
    fc1 = "model.decoder.layers.1.mlp.linear_fc1.weight"
    for name in ("het/iter_0000005", "het-from-hf/iter_0000000", "het-from-megatron/iter_0000005"):
        meta = dist_checkpointing.load_tensors_metadata(str(out / name))
        if model.swiglu:
            assert fc1 not in meta, name
            assert tuple(meta[fc1 + ".gate"].global_shape) == (model.ffn_hidden_size, model.hidden_size), name
            assert tuple(meta[fc1 + ".up"].global_shape) == (model.ffn_hidden_size, model.hidden_size), name
        else:
            assert fc1 in meta and fc1 + ".gate" not in meta, name


@pytest.mark.slow  # a fresh interpreter importing megatron-core: ~25 s for a thin CLI
def test_cli_converts(converted_both, tmp_path):
    out, _ = converted_both
    tool = [sys.executable, str(ROOT / "tools" / "checkpoint" / "convert.py")]
    done = subprocess.run(tool + ["--input", str(out / "gpt" / "hf-from-het"), "--input-format", "hf",
                                  "--output", str(tmp_path / "het"), "--output-format", "het"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "converted 28 tensors (2 layers, iteration 0) from hf to het" in done.stderr
    assert "write het: 28/28" in done.stderr
    assert (tmp_path / "het" / "latest_checkpointed_iteration.txt").read_text() == "0"


def test_wrong_model_is_refused_naming_the_tensor(converted_both, tmp_path):
    from megatron_het.checkpoint.convert import ConvertError, ConvertRequest, convert
    from megatron_het.cluster import load_model

    out, _ = converted_both
    wrong = load_model(ROOT / "examples" / "models" / "tiny-cpu.yaml")  # 4 layers: not this checkpoint
    with pytest.raises(ConvertError, match=r"missing tensor 'transformer.h.2.ln_1.weight'"):
        convert(ConvertRequest(input=str(out / "gpt" / "hf-from-het"), input_format="hf", model=wrong,
                               output=str(tmp_path / "bad"), output_format="het"))
    assert not (tmp_path / "bad").exists()
