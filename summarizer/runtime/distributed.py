"""Data parallelism and the model's wrappers: DDP, torch.compile, unwrapping a wrapped model, collective sums and
gathers, and leaving the process group."""
from __future__ import annotations

import copy
import multiprocessing

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.fx.experimental import _config as fx_config

from summarizer.runtime.device import Runtime


def teardown() -> None:
    """Leave the process group, and stop any child process still alive (DataLoader workers ignore SIGTERM, so
    multiprocessing's own exit handler, which terminates then joins them, would wait forever)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=10)


def wrap_ddp(model: nn.Module, rt: Runtime) -> nn.Module:
    if not rt.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP
    if rt.device != rt.decoder_device:
        # A module spanning two devices: DDP requires device_ids=None (DDP docs).
        return DDP(model, device_ids=None, broadcast_buffers=False)
    # The only buffer is the constant position table: broadcasting it every forward is wasted traffic.
    return DDP(model, device_ids=[rt.device.index] if rt.device.type == "cuda" else None,
               broadcast_buffers=False)


def compile_model(model: nn.Module, mode: str = "default") -> nn.Module:
    """train.compile: a view of `model` whose repeated blocks (the layers its nn.ModuleLists hold) run under
    torch.compile, in train.compile_mode: torch's regional compilation. The blocks of one kind share one compiled
    graph, so compiling costs what one block does: gigaword.yaml's first compiled step took 25.4 s against 55.5 s
    with the whole model compiled, at the same compiled tokens/s (this CPU, bf16, torch's dropout; docs/results.md).
    Every batch dimension and length is symbolic from the first compile (dynamic=True): length-bucketed batches
    change shape nearly every step, and torch's default (dynamic=None) compiles for the first batch's shape and
    again at the next (torch.compile docs, "Dealing with Recompilations"). The view shares every parameter and
    buffer with `model`, which stays eager for validation, decoding and checkpoints (`unwrap` returns it); wrap it
    in DDP, not the other way round. A recompilation stalls training as long as the first compile did, so each one
    is printed with the guard that failed (torch's `recompiles` log; the TORCH_LOGS variable, where set, takes
    precedence). Sizes are never matched up (duck sizing off): with it, a first batch of 64 rows, or 64 positions,
    beside a head size of 64 compiles a graph for that equality and the next batch recompiles it (the advice of
    torch's own guard message; base.yaml, this CPU: 3.8-7.2 s of recompiling in 7 batch shapes, none after)."""
    torch._logging.set_logs(recompiles=True)
    fx_config.use_duck_shape = False
    if isinstance(model, nn.ModuleList):
        return nn.ModuleList(torch.compile(block, dynamic=True, mode=mode) for block in model)
    if not any(isinstance(m, nn.ModuleList) for m in model.modules()):
        return model
    view = copy.copy(model)  # the same parameters, buffers and hooks; its own children, some of them compiled
    object.__setattr__(view, "_modules", {name: None if child is None else compile_model(child, mode)
                                          for name, child in model._modules.items()})
    object.__setattr__(view, "_orig_mod", model)  # what unwrap returns, as for torch.compile's own wrapper
    return view


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP and torch.compile wrappers: what decoding calls `encode`/`decode` on and
    checkpoints take the state dict of (a placed model's state dict is its inner model's)."""
    while hasattr(model, "module") or hasattr(model, "_orig_mod"):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def all_reduce_sum(value: Tensor, rt: Runtime) -> Tensor:
    if rt.distributed:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def all_gather_object(value, rt: Runtime) -> list:
    """Every rank's `value`, by rank ([value] without DDP): a collective, so every rank must call it."""
    if not rt.distributed:
        return [value]
    gathered = [None] * rt.world_size
    dist.all_gather_object(gathered, value)
    return gathered
