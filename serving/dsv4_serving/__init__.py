"""The serving stack: engine, gateway and the ``dsv4`` command line."""

import os

# OpenMP threads that wait passively (sleep at a barrier) instead of spinning. libgomp reads
# this once, when torch loads it, so it is set here, before any of the engine's modules import
# torch (a process that imported torch first keeps its own policy; an explicit setting wins).
# Measured on a loaded 2-CPU machine (load 6-10 from other jobs), dsv3-small 16 x 128 + 32,
# 2 torch threads: spinning 14.9-16.0 s per run, passive 1.3-1.4 s, 1 thread 1.0-1.6 s: a
# spinning thread holds its CPU while the thread it waits for is descheduled, so every parallel
# region costs a scheduler slice (vLLM's CPU worker avoids it by running one OMP thread here).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
