"""Sharded optimizer state, one implementation for both sharded modes.

- ``layout.py``: pure arithmetic of uneven contiguous shards (proportional splits, flat indices);
- ``adamw.py``: ``ShardedAdamW``, AdamW on one rank's flat pieces (the sharded strategy's whole-model
  flat vector, and the pipeline runtime's distributed optimizer);
- ``holders.py``: pure layout of the distributed optimizer over the holders of each full parameter
  (replicas of different TP sizes included);
- ``distributed.py``: ``DistributedOptimizer``, the pipeline runtime's ``--use-distributed-optimizer``.
"""
