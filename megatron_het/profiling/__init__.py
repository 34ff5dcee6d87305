"""Measurements of this host that feed a profile (``tools/profile_host.py``): layers, stage parts, the
optimizer step, links. Unlike ``megatron_het.perf`` (pure model), these run torch and process groups."""
