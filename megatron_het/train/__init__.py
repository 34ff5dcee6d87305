"""The one training loop and what plugs into it (import the modules; this package imports nothing,
so parsing arguments with ``train.config`` does not load torch):

- ``config``: TrainConfig (optimisation settings) and LoopConfig (evaluation, checkpoints);
- ``strategy``: the protocol a parallelism strategy implements, and the shared types;
- ``timer``: the emulation timer;
- ``trainer``: Trainer, the one loop, and its hook points (TrainerHooks, ChainedHooks); ``loop``: Megatron's pretraining loop around it (log lines,
  evaluation, periodic saves, summary).

Strategies: pipeline (``runtime/hetero_trainer.py``), sharded (``sharding/trainer.py``), plain
megatron-core (``runtime/megatron_trainer.py``).
"""
