"""Plain-text renderings of specs for the CLI (tools/cluster.py) and logs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from megatron_het.cluster.catalog import DeviceType
from megatron_het.cluster.model_spec import ModelSpec
from megatron_het.cluster.spec import ClusterSpec

__all__ = ["format_table", "format_cluster", "format_catalog", "format_model"]


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]], *, indent: str = "  ") -> str:
    """Left-aligned columns separated by two spaces."""
    cells = [[str(c) for c in header], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join(indent + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def _num(x: float) -> str:
    """Thousands separators, at most two decimals, no trailing zeros: 362.05, 1,200, 0.5."""
    return f"{x:,.2f}".rstrip("0").rstrip(".")


def format_cluster(spec: ClusterSpec) -> str:
    lines = [f"cluster: {spec.source or '(built in code)'}"]
    lines.append(f"islands ({len(spec.islands)}):")
    rows = [
        (i.name, i.device.name, f"{i.device.vendor}/{i.device.collective_library}", f"{i.nodes} x {i.gpus_per_node}",
         i.num_gpus, _num(i.inter_node_bandwidth_gbps), _num(i.intra_node_bandwidth_gbps),
         _num(i.peak_tflops), _num(i.memory_gib))
        for i in spec.islands
    ]
    lines.append(format_table(("name", "device", "vendor/comm", "nodes x gpus", "GPUs", "inter-node Gbit/s",
                               "intra-node Gbit/s", "peak TFLOP/s", "memory GiB"), rows))
    lines.append("GPUs by device type:")
    lines += [f"  {name}: {count}" for name, count in spec.gpus_by_device_type().items()]
    lines.append(f"total: {spec.num_gpus} GPUs, {_num(spec.peak_tflops)} TFLOP/s peak (dense bf16), "
                 f"{_num(spec.memory_gib)} GiB device memory")
    lines.append("links:" if spec.links else "links: none (single island)")
    lines += [f"  {a} <-> {b}: {_num(link.bandwidth_gbps)} Gbit/s per GPU, {_num(link.latency_us)} us"
              for link in spec.links for a, b in [link.between]]
    if spec.emulation:
        lines.append("emulation (CPU):")
        lines += [f"  {name}: slowdown {e.slowdown:g}" + (f" ({e.clock} clock)" if e.clock != "wall" else "")
                  for name, e in spec.emulation.items()]
    else:
        lines.append("emulation: none")
    return "\n".join(lines)


def format_catalog(catalog: Mapping[str, DeviceType], *, sources: bool = True) -> str:
    header = ("name", "vendor", "comm", "peak TFLOP/s", "memory GiB", "mem GB/s", "intra-node Gbit/s")
    rows = [(d.name, d.vendor, d.collective_library, _num(d.peak_tflops), _num(d.memory_gib),
             _num(d.memory_bandwidth_gbs), _num(d.intra_node_bandwidth_gbps)) for d in catalog.values()]
    text = format_table(header, rows, indent="")
    if sources:
        text += "\n\nsources:\n" + "\n".join(f"  {d.name}: {d.source}" for d in catalog.values())
    return text


def format_model(spec: ModelSpec) -> str:
    fields = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
              "ffn_hidden_size", "seq_length", "max_position_embeddings", "vocab_size", "swiglu",
              "untie_embeddings_and_output_weights", "normalization", "position_embedding_type", "add_bias_linear")
    lines = [f"model: {spec.name or '(unnamed)'}"]
    lines += [f"  {f}: {getattr(spec, f)}" for f in fields]
    return "\n".join(lines)
