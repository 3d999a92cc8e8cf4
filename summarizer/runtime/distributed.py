"""Data parallelism and the model's wrappers: DDP, torch.compile, unwrapping a wrapped model, collective sums and
gathers, and leaving the process group."""
from __future__ import annotations

import multiprocessing

import torch
import torch.distributed as dist
from torch import Tensor, nn

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
    """train.compile: the model under torch.compile (in train.compile_mode) with every batch dimension and length
    symbolic from the first compile (dynamic=True). Length-bucketed batches change shape nearly every step; torch's
    default (dynamic=None) compiles for the first batch's exact shape and again, dynamically, at the next shape
    (torch.compile docs, "Dealing with Recompilations"). base.yaml's model with torch's dropout on the CPU, 8 batch
    shapes: 77.8 s and 6 graphs with the default, 31.5 s and one graph with this (docs/results.md, "On a GPU").
    A recompilation stalls training as long as the first compile did, so each one is printed with the guard that
    failed (torch's `recompiles` log; the TORCH_LOGS variable, where set, takes precedence)."""
    torch._logging.set_logs(recompiles=True)
    return torch.compile(model, dynamic=True, mode=mode)


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
