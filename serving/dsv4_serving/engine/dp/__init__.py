"""Data parallelism: the leader's router over DP ranks and the cores' lockstep."""
