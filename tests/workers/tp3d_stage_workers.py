"""Rank functions for the 3D stage test (module-level for spawn; no tests): a whole GPT (embedding,
two 3D layers, final norm, tied output layer, loss) on a 4-rank grid vs the single-process TP=1
GPTModel with the same global weights, float64."""

from __future__ import annotations

import torch
import torch.distributed as dist

H, HEADS, FFN, SEQ, BATCH, VOCAB, LAYERS = 16, 4, 32, 8, 4, 128, 2
GRIDS = ((2, 2, 1), (1, 2, 2), (2, 1, 2))


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def _spec():
    from megatron_het.cluster import ModelSpec
    from megatron_het.model.gpt import StageModelSpec

    model = ModelSpec(num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                      seq_length=SEQ, vocab_size=VOCAB)
    return StageModelSpec(model=model, num_layers=LAYERS, layer_offset=0, tp=1, pre_process=True,
                          post_process=True, vocab_size=VOCAB, params_dtype=torch.float64)


def _config(tp: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                             tensor_model_parallel_size=tp, params_dtype=torch.float64, pipeline_dtype=torch.float64,
                             use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)


def _pgc(tp, me):
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgc = ProcessGroupCollection(tp=tp, cp=me, pp=me, dp=me, ep=me, mp=tp, tp_cp=tp, dp_cp=me, tp_dp_cp=tp)
    pgc.embd = pgc.pos_embd = me
    pgc.expt_dp, pgc.expt_tp, pgc.tp_ep_pp = me, tp, tp
    return pgc


def stage_cases(rank: int, world: int) -> dict:
    from megatron_het.platform import enable_cpu_backend

    enable_cpu_backend()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_het.checkpoint.tp_layout import grid_index, grid_kind
    from megatron_het.model.groups import ensure_global_memory_buffer
    from megatron_het.model.tp3d import sum_replicated_grads_over_z
    from megatron_het.model.tp3d_stage import build_tp3d_gpt_stage
    from megatron_het.tp import Grid4D, create_grid_groups

    ensure_global_memory_buffer()
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    me = singles[rank]
    model_parallel_cuda_manual_seed(5, tp_rank=0, ep_rank=0, etp_rank=0)
    torch.manual_seed(11)
    spec = _spec()
    ref = GPTModel(config=_config(1), transformer_layer_spec=get_gpt_layer_local_spec(normalization="LayerNorm"),
                   vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=True, post_process=True,
                   share_embeddings_and_output_weights=True, pg_collection=_pgc(me, me)).double()
    with torch.no_grad():  # non-trivial norm parameters and biases
        for n, p in ref.named_parameters():
            if "layernorm" in n or n.endswith(".bias"):
                p.copy_(torch.randn(p.shape, dtype=p.dtype, generator=torch.Generator().manual_seed(len(n))))
    g = torch.Generator().manual_seed(21)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    loss_ref = ref(tokens, pos, None, labels=labels)
    loss_ref.sum().backward()
    full = dict(ref.named_parameters())
    out = {}
    for gx, gy, gz in GRIDS:
        grid = Grid4D(x=gx, y=gy, z=gz)
        groups = create_grid_groups(grid)
        c = groups.coords
        gpt = build_tp3d_gpt_stage(spec, _config(gy), _pgc(groups.y, me), groups,
                                   micro_batch_size=BATCH).double()  # torch final norm: fp32
        views = {}
        for name, p in gpt.named_parameters():
            f = full[name]
            index = grid_index(name, tuple(f.shape), (gx, gy, gz), rank, gated=False)
            if index is None and getattr(p, "tensor_model_parallel", False):  # TP = gy over the y group
                d, n = int(p.partition_dim), p.shape[int(p.partition_dim)]
                index = tuple([slice(None)] * d + [slice(c["y"] * n, (c["y"] + 1) * n)])
            views[name] = (f, index if index is not None else (slice(None),))
            with torch.no_grad():
                p.copy_(f[views[name][1]])
        loss = gpt(tokens, pos, None, labels=labels)
        loss.sum().backward()
        sum_replicated_grads_over_z(gpt, groups)
        errs = {"loss": _err(loss.detach(), loss_ref.detach())}
        kinds = {}
        for name, p in gpt.named_parameters():
            f, sl = views[name]
            errs[name] = _err(p.grad, f.grad[sl])
            kinds[name] = grid_kind(name)
        out[(gx, gy, gz)] = {"errs": errs, "kinds": kinds}
    return out
