"""Layer 4, the runtime: where and how the model runs (device, precision, seeding, DDP) and its placement.

The layer's public names, used as `runtime.setup(...)`; the code lives in device.py and distributed.py."""
from summarizer.runtime.device import (
    LateRead,
    Runtime,
    cpu_has_fast_bf16,
    device_tensor,
    eval_mode,
    graph_capture,
    make_scaler,
    move,
    move_batch,
    on_side_stream,
    resolve_device,
    resolve_precision,
    seed_everything,
    set_cpu_kernel_cache,
    setup,
    side_stream,
)
from summarizer.runtime.distributed import all_gather_object, all_reduce_sum, compile_model, teardown, unwrap, wrap_ddp

__all__ = ["LateRead", "Runtime", "all_gather_object", "all_reduce_sum", "compile_model", "cpu_has_fast_bf16",
           "device_tensor", "eval_mode", "graph_capture", "make_scaler", "move", "move_batch", "on_side_stream",
           "resolve_device", "resolve_precision", "seed_everything", "set_cpu_kernel_cache", "setup", "side_stream",
           "teardown", "unwrap", "wrap_ddp"]
