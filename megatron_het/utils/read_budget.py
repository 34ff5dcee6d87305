"""How much host memory one read of a streamed checkpoint load may fill (pure: the memory model
imports it without torch).

``dist_ckpt.load_in_groups`` reads a stage's slots in groups of fp32 values and moments about this
big, so a rank never holds its whole stage's state in host memory at once (a 7B replica's 12 bytes
per parameter are ~84 GB, on each of a node's eight ranks)."""

READ_GROUP_BYTES = 2 * 2**30
