"""megatron-core models and the process groups they are built on: a GPTModel slice (``gpt.py``) for
any layer range and TP size, and the groups of one homogeneous block (``groups.py``).

Below runtime/ (the pipeline strategy), sharding/ (the sharded strategy) and checkpoint conversion,
which all build megatron-core models; it knows nothing of plans or training.
"""
