"""What a torch.profiler record says about a loop bound by its host: per step, the kernel launches it queued, the
values it read back, and the time the GPU was busy. Shared by the training profile (train.profile_steps) and the
bench's decode profile."""
from __future__ import annotations

from torch.autograd import DeviceType

# Operators that read a tensor's value back to the host (.item(), bool(), nonzero's output size): on a GPU each
# waits for every kernel queued before it.
HOST_READS = ("aten::_local_scalar_dense", "aten::nonzero")
# The CUDA runtime calls that queue work on the GPU: a step bound by the host costs about its launches.
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


def per_step(averages, steps: int, wall_s: float) -> dict:
    """profiler.key_averages() over `steps` steps that took `wall_s` -> per step: milliseconds of wall time and
    inside torch operators (self times summed), values read back to the host, and on a GPU kernel launches (a
    graph replay counts once) and milliseconds the device was busy (its share of the wall time)."""
    steps = max(steps, 1)
    calls = {e.key: e.count for e in averages}
    ops_s = sum(e.self_cpu_time_total for e in averages) / 1e6
    out = {"steps": steps, "wall_ms": 1e3 * wall_s / steps, "ops_ms": 1e3 * ops_s / steps,
           "host_reads": sum(calls.get(op, 0) for op in HOST_READS) / steps}
    # the kernels' own rows: an operator's self device time repeats its kernels' (as the profiler's table totals it)
    device_s = sum(e.self_device_time_total for e in averages if e.device_type != DeviceType.CPU) / 1e6
    if device_s or any(name in calls for name in LAUNCHES):
        out.update(launches=sum(calls.get(name, 0) for name in LAUNCHES) / steps,
                   device_ms=1e3 * device_s / steps, device_share=device_s / wall_s if wall_s else 0.0)
    return out
