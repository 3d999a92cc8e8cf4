"""train.cuda_graphs: the whole training step (forward, loss, backward, clipping, AdamW) of each batch shape
captured once as a CUDA graph and replayed, torch's whole-network capture (its CUDA semantics notes, "CUDA
Graphs"). A small model's GPU step is bound by its host, which launches every kernel from Python: the recipe's
H100 step kept the GPU busy 3.4 ms of its 50.9 (docs/results.md). A replay launches them all at once.

The step that is captured is `train_step` itself, handed its loss factor and learning rates as device tensors,
which are refilled before each replay, since a captured kernel keeps the numbers it was given. The first
`warmup` steps of the process run eagerly on the capture's stream, as the notes ask; every batch shape after
that is captured when first met, its batch copied into fixed input tensors before each replay. The eager step
runs where a graph cannot, the same arithmetic on the same state: on steps logged with train.module_stats
(they read the gradients, which a replay keeps in its graph's memory), and for good once a capture fails (said
once, on stderr). Where the optimizer's state was replaced (a rollback loads a checkpoint's), the graphs, which
write to the tensors they were captured with, are dropped and captured anew."""
from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import nn

from summarizer.config.schema import TrainConfig
from summarizer.runtime import Runtime, graph_capture, on_side_stream, side_stream

INPUTS = ("src_ids", "tgt_in", "tgt_out")  # the batch's tensors the step reads
OUTPUTS = ("loss_sum", "nll_sum", "grad_norm", "finite")


def unsupported(rt: Runtime, cfg: TrainConfig, fused: bool) -> str:
    """Why this run's step cannot be captured ("" when it can); `fused`: the optimizer takes the finiteness flag into
    its kernel (a fused AdamW: `cfg.fused_optimizer` on one GPU)."""
    if rt.device.type != "cuda" or rt.decoder_device != rt.device:
        return "the model is not on one GPU"
    if rt.distributed:
        return "DDP's gradient hooks are not captured here; each rank steps eagerly"
    if cfg.accum_steps != 1:
        return "train.accum_steps > 1"
    if cfg.compile and cfg.compile_mode in ("reduce-overhead", "max-autotune"):
        return f"train.compile_mode={cfg.compile_mode} replays torch.compile's own CUDA graphs"
    if not fused:
        return "the optimizer reads the finiteness flag before it steps (train.fused_optimizer=false)"
    return ""


class StepGraphs:
    """A drop-in for `train_step` (same arguments, same outputs) that replays a captured graph per batch shape.
    `capture=False` runs the same path eagerly (static inputs, tensor loss factor and learning rates): what a
    CPU can test of it."""

    warned = False

    def __init__(self, step: Callable[..., dict], optimizer: torch.optim.Optimizer, device: torch.device,
                 capture: bool = True, warmup: int = 2):
        self.step, self.capture, self.warmup, self.calls = step, capture, warmup, 0
        self.device = device
        self.graphs: dict[tuple, tuple] = {}  # (input shapes) -> (graph or None, static inputs, static outputs)
        self.anchor = None  # an optimizer state tensor the graphs were captured with
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # one memory pool all graphs share
        self.scale = torch.zeros((), dtype=torch.float32, device=device)
        # fused AdamW reads a 1-element float32 tensor lr from device memory; a float is baked into the kernel
        self.lrs = [torch.tensor([g["lr"]], dtype=torch.float32, device=device) for g in optimizer.param_groups]

    def __call__(self, model: nn.Module, optimizer, scaler, micro_batches: list[dict], rt: Runtime,
                 cfg: TrainConfig, stats=None) -> dict:
        batch = micro_batches[0]
        if stats is not None or not optimizer.state or self.calls < self.warmup:  # state made outside the graphs
            self.calls += 1
            if stats is not None or not self.capture:
                return self.step(model, optimizer, scaler, micro_batches, rt, cfg, stats)
            return on_side_stream(self.device, lambda: self.step(model, optimizer, scaler, micro_batches, rt, cfg))
        anchor = next(iter(optimizer.state.values()))["exp_avg"]  # replaced with the rest of the state
        if anchor is not self.anchor:
            self.graphs.clear()
            self.anchor = anchor
        key = tuple(tuple(batch[name].shape) for name in INPUTS)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._record(model, optimizer, scaler, batch, rt, cfg)
            except torch.OutOfMemoryError:  # the loop names the batch and what to lower, as for an eager step
                self._clean(model, scaler)
                raise
            except RuntimeError as exc:  # nothing ran during the capture: this step and the rest run eagerly
                self._give_up(exc, model, scaler, rt, cfg)
                return self.step(model, optimizer, scaler, micro_batches, rt, cfg)
        graph, inputs, outputs = self.graphs[key]
        for name in INPUTS:
            inputs[name].copy_(batch[name], non_blocking=True)
        self.scale.fill_(rt.world_size / batch["n_tgt"])
        for lr, group in zip(self.lrs, optimizer.param_groups, strict=True):
            lr.fill_(group["lr"])
        if graph is None:  # capture=False: the same step, eagerly
            outputs = self._captured_step(model, optimizer, scaler, {**batch, **inputs}, rt, cfg)
        else:
            graph.replay()
        # copies: a later replay of another graph may reuse this one's output memory (they share one pool)
        return {**{name: outputs[name].clone() for name in OUTPUTS}, "tokens": batch["n_tgt"], "modules": {}}

    def _captured_step(self, model, optimizer, scaler, batch: dict, rt: Runtime, cfg: TrainConfig) -> dict:
        """`train_step` with the loss factor and the learning rates read from device tensors."""
        floats = [group["lr"] for group in optimizer.param_groups]
        for group, lr in zip(optimizer.param_groups, self.lrs, strict=True):
            group["lr"], group["capturable"] = lr, self.capture  # capturable: torch's check that capture is meant
        try:
            return self.step(model, optimizer, scaler, [batch], rt, cfg, scale=self.scale)
        finally:
            for group, lr in zip(optimizer.param_groups, floats, strict=True):
                group["lr"], group["capturable"] = lr, False

    def _record(self, model, optimizer, scaler, batch: dict, rt: Runtime, cfg: TrainConfig) -> tuple:
        inputs = {name: batch[name].clone() for name in INPUTS}  # outside the graphs' pool: they outlive replays
        if not self.capture:
            return None, inputs, None
        for p in model.parameters():  # a captured backward writes gradients into memory of its own graph
            p.grad = None
        graph, side = torch.cuda.CUDAGraph(), side_stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        made = set(optimizer.state)
        try:
            with graph_capture(graph, self.device, side, self.pool):  # DataLoader's pinning thread goes on
                outputs = self._captured_step(model, optimizer, scaler, {**batch, **inputs}, rt, cfg)
        finally:  # a capture that failed too: what it made was never run, so eager steps must not find it
            for p in model.parameters():
                p.grad = None  # the graph's memory: what the next replay of any graph overwrites
            new = [p for p in optimizer.state if p not in made]  # made in the capture: never initialised
            for p in new:
                del optimizer.state[p]
        if new:
            raise RuntimeError("a parameter without optimizer state until now got a gradient in the captured step")
        return graph, inputs, outputs

    @staticmethod
    def _clean(model: nn.Module, scaler) -> None:
        """What a failed capture leaves behind: gradients in the graph's memory, a scaler left "unscaled"."""
        for p in model.parameters():
            p.grad = None
        if scaler.is_enabled():  # a disabled scaler (fp32, bf16) keeps no per-optimizer state
            scaler._per_optimizer_states.clear()  # a capture that failed after unscale_ left it "unscaled"

    def _give_up(self, exc: Exception, model: nn.Module, scaler, rt: Runtime, cfg: TrainConfig) -> None:
        self.capture, self.warmup = False, sys.maxsize  # every later step eager, on the current stream
        self.graphs.clear()
        self._clean(model, scaler)
        if not StepGraphs.warned:
            StepGraphs.warned = True
            auto = (f"; train.precision=auto chose {rt.precision} by rule for captured steps, and eagerly fp32 may "
                    f"be faster: train.precision=fp32") if cfg.precision == "auto" and rt.precision != "fp32" else ""
            print(f"warning: the training step could not be captured as a CUDA graph ({exc}); training goes on "
                  f"eagerly{auto}", file=sys.stderr, flush=True)


def step_function(step: Callable[..., dict], model: nn.Module, optimizer, rt: Runtime,
                  cfg: TrainConfig) -> tuple[Callable[..., dict], str]:
    """What the loop calls each step: `step` (loop.train_step), or its graphs where train.cuda_graphs is on and the
    run allows; with a line for the log."""
    if not cfg.cuda_graphs:
        return step, ""
    why = unsupported(rt, cfg, getattr(optimizer, "_step_supports_amp_scaling", False))
    if why and "cuda" not in (rt.device.type, rt.decoder_device.type):  # a CPU run: nothing to say, as pin_memory
        return step, ""
    if why:
        return step, f"train.cuda_graphs: off for this run ({why})"
    return StepGraphs(step, optimizer, rt.device), ("train.cuda_graphs: each batch shape's whole step is captured "
                                                    "as a CUDA graph when first met and replayed")
