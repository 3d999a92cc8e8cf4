"""runtime/profiling.py: a profile's cost per step."""
import time

import torch
from torch.profiler import ProfilerActivity, profile

from summarizer.runtime.profiling import per_step


def test_per_step_counts_the_values_read_back_and_the_time_a_step():
    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(4):  # 4 steps: a product, two values read back, one nonzero
            y = x @ x
            float(y.sum()), bool(y[0, 0] > 0)
            (y > 0).nonzero()
        wall = time.perf_counter() - started
    figures = per_step(prof.key_averages(), 4, wall)
    assert figures["steps"] == 4 and figures["host_reads"] == 3  # 2 reads + 1 nonzero a step
    assert 0 < figures["ops_ms"] <= figures["wall_ms"] == 1e3 * wall / 4
    assert "launches" not in figures and "device_ms" not in figures  # no GPU in this profile
