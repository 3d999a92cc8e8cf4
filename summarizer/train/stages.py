"""A config's runs trained in order (`config.load.load_stages`): one for most configs, one per stage for a recipe
(configs/two_stage.yaml). A finished stage is skipped, an unfinished one resumes, so the same command carries a
killed recipe on from the stage it was in."""
from __future__ import annotations

import sys
from pathlib import Path

from summarizer.config.schema import Config, TrainConfig
from summarizer.model import checkpoint
from summarizer.train.loop import time_is_up, train
from summarizer.train.session import check_finished


def is_finished(progress: dict, t: TrainConfig) -> bool:
    """Training stopped for good (max_steps, max_minutes or patience), not by a signal or a crash."""
    return (progress["step"] >= t.max_steps or time_is_up(progress, t)
            or (t.patience > 0 and progress["bad_evals"] >= t.patience))


def training_finished(cfg: Config) -> int | None:
    """The step a finished run stopped at, or None when it must (still) be trained, or owes what a stop left
    undone (its last log row or validation: loop.owe). A finished run of other settings than `cfg`'s (a model,
    data or recipe a resume could not change) is refused, not taken for `cfg`'s."""
    found = checkpoint.load_latest(cfg.run_dir)  # the newest readable one, as a resume reads it
    if found is None:
        return None
    progress = found[0]["progress"]
    if not is_finished(progress, cfg.train) or "owed" in progress:
        return None
    check_finished(found[0], cfg)
    return progress["step"]


def resolve_start(before: Config | None, cfg: Config) -> None:
    """A stage whose predecessor ended before its max_steps (time limit, early stopping) starts from that
    stage's last step checkpoint instead of the one at max_steps that `load_stages` named."""
    named = Path(cfg.train.init_from)
    if before is None or named.is_file() or named.parent != before.run_dir:
        return
    latest = checkpoint.latest_path(before.run_dir)
    if latest is not None:
        cfg.train.init_from = str(latest)


def train_stages(stages: list[tuple[str, Config]]) -> dict | None:
    """Train each run that is not finished yet; the summary of the last one trained (None when every one was
    finished before), with `stages_left`, the stages after it. Stops after a run that a stop signal ended (cut
    short, or after its last validation): the same command resumes there."""
    summary = None
    for number, (name, cfg) in enumerate(stages, start=1):
        where = f"stage {number}/{len(stages)} ({name}, {cfg.run_dir})" if name else str(cfg.run_dir)
        done_at = training_finished(cfg)
        if done_at is not None:
            print(f"{where}: finished at step {done_at}", file=sys.stderr)
            continue
        resolve_start(stages[number - 2][1] if number > 1 else None, cfg)
        if name:
            start = ("resuming" if checkpoint.latest_path(cfg.run_dir) is not None
                     else f"training from {cfg.train.init_from}" if cfg.train.init_from else "training")
            print(f"{where}: {start}", file=sys.stderr, flush=True)
        summary = {**train(cfg), "stages_left": len(stages) - number}
        if summary["signal"] is not None:  # any other end is for good (max_steps, time limit, early stopping)
            break
    return summary
