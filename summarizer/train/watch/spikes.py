"""Loss spikes rolled back (train.spike_factor > 0; off by default).

A step whose loss (NLL per target token, all ranks together) lies above the mean + spike_factor * std of the
last `spike_window` step losses is a spike: the run goes back to its newest checkpoint in place (weights,
optimizer, scaler, moving average, random streams, data position: session.rollback) and never trains on that
step's batches again. The batches are named by their place in the data order, (epoch, position), so the
replay is exact: the run goes on as a run that never saw them would (tests/test_spikes.py). Each rollback is
recorded in manifest.json (`spike_rollbacks`), which a resumed run reads, and `train.skip_batches` lists
batches to leave out by hand. After `spike_max_rollbacks` rollbacks within `spike_window` steps the run stops:
spikes that keep coming are not a few bad batches.

The window of recent losses is part of the run's progress, so a checkpoint restores it too. Watching costs
one host sync per step (the step's loss), which is why it is off unless asked for.
"""
from __future__ import annotations

import statistics

from summarizer import runtime
from summarizer.config.schema import TrainConfig
from summarizer.runtime import Runtime


def step_loss(out: dict, rt: Runtime) -> float:
    """The step's NLL per target token over all ranks (train_step's local sum over the global count)."""
    # a copy: float() and reshape() of a float32 scalar are views, and the all-reduce writes in place; the loop's
    # window sums the step's own local nll_sum over the ranks after this
    local = out["nll_sum"].detach().float().reshape(1).clone()
    return float(runtime.all_reduce_sum(local, rt)) / float(out["tokens"])


def limit(progress: dict, cfg: TrainConfig) -> float | None:
    """The loss above which a step is a spike, once `spike_window` losses are known; else None."""
    window = progress.get("loss_window", [])
    if len(window) < cfg.spike_window:
        return None
    return statistics.fmean(window) + cfg.spike_factor * statistics.pstdev(window)


def remember(progress: dict, loss: float, cfg: TrainConfig) -> None:
    """Add a step's loss (not a spike's) to the window, which keeps the last `spike_window`."""
    progress["loss_window"] = [*progress.get("loss_window", []), loss][-cfg.spike_window:]


def too_many(rollbacks: list[dict], step: int, cfg: TrainConfig) -> list[int]:
    """The steps of the rollbacks within the last `spike_window` steps, when there are `spike_max_rollbacks`."""
    recent = [r["step"] for r in rollbacks if r["step"] > step - cfg.spike_window]
    return recent if len(recent) >= cfg.spike_max_rollbacks else []


def skipped(manifest: dict, cfg: TrainConfig) -> set[tuple[int, int]]:
    """Every (epoch, position) the run leaves out: those of its rollbacks and `train.skip_batches`."""
    batches = {tuple(b) for b in cfg.skip_batches}
    for record in manifest.get("spike_rollbacks", []):
        batches.update(tuple(b) for b in record["batches"])
    return batches

