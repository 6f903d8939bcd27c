"""Tensor parallelism over torch.distributed: shard layout, the rank group's collectives, rank 0's executor
and the follower ranks' loop.

layout.py (which slice of each weight a rank holds, start-up checks), group.py (process groups, the
fixed-order all-reduce, the vocabulary gather, the step broadcast), executor.py (rank 0: start the
followers, broadcast each step, fail clearly when a rank dies), worker.py (a follower rank's main loop).
"""
