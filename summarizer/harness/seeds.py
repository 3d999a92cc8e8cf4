"""Seed variance: train and evaluate one config with seeds 1..N (resumable), then mean ± sample std of ROUGE."""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import numpy as np

from summarizer.config.load import load_config
from summarizer.config.schema import Config, TrainConfig
from summarizer.data.prepared import read_pairs
from summarizer.errors import ConfigError
from summarizer.evaluation.evaluate import evaluate
from summarizer.evaluation.scoring import ROUGE_TYPES
from summarizer.model import checkpoint
from summarizer.outputs import check_report_target, write_report
from summarizer.train.loop import train

NAMES = {"rouge1": "ROUGE-1", "rouge2": "ROUGE-2", "rougeL": "ROUGE-L"}
# rouge.json settings that must equal the current eval config for an evaluation to be reused
EVAL_KEYS = ("split", "beam_size", "max_len", "min_len", "length_penalty", "no_repeat_ngram")


def seed_config(cfg: Config, seed: int) -> Config:
    """The run of one seed: train.seed set, run name (and an explicit run.dir / eval.out_dir) suffixed."""
    if cfg.eval.checkpoint:
        raise ConfigError("seeds evaluates each run's own best.pt: drop eval.checkpoint "
                          f"(now {cfg.eval.checkpoint})")
    out = copy.deepcopy(cfg)
    out.train.seed = seed
    out.run.name = f"{cfg.run.name}-seed{seed}"
    if cfg.run.dir:
        out.run.dir = f"{cfg.run.dir.rstrip('/')}-seed{seed}"
    if cfg.eval.out_dir:
        out.eval.out_dir = f"{cfg.eval.out_dir.rstrip('/')}-seed{seed}"
    return out


def is_finished(progress: dict, t: TrainConfig) -> bool:
    """Training stopped for good (max_steps, max_minutes or patience), not by a signal or a crash."""
    return (progress["step"] >= t.max_steps or (t.max_minutes > 0 and progress["elapsed_s"] >= 60 * t.max_minutes)
            or (t.patience > 0 and progress["bad_evals"] >= t.patience))


def training_finished(cfg: Config) -> int | None:
    """The step a finished run stopped at, or None when it must (still) be trained."""
    latest = checkpoint.latest_path(cfg.run_dir)
    if latest is None:
        return None
    progress = checkpoint.load(latest)["progress"]
    return progress["step"] if is_finished(progress, cfg.train) else None


def current_evaluation(cfg: Config) -> dict | None:
    """The run's rouge.json when it scored the current best.pt with the current eval settings, else None."""
    out_dir = Path(cfg.eval.out_dir) if cfg.eval.out_dir else cfg.run_dir
    path, best = out_dir / "rouge.json", cfg.run_dir / checkpoint.BEST
    if not path.is_file() or not best.is_file():
        return None
    try:
        report = json.loads(path.read_text())
        settings = report["settings"]
    except (ValueError, KeyError):
        return None
    if any(settings.get(key) != getattr(cfg.eval, key) for key in EVAL_KEYS):
        return None
    pairs = len(read_pairs(cfg.data.dir, cfg.eval.split))
    scored = settings.get("checkpoint", {})
    if settings.get("pairs") != (min(pairs, cfg.eval.limit) if cfg.eval.limit else pairs):
        return None
    if Path(scored.get("path", "")).name != checkpoint.BEST or scored.get("step") != checkpoint.load(best)["step"]:
        return None
    return report


def run_seed(cfg: Config) -> dict:
    """Train (or resume, or skip when finished) one seed's run, then evaluate it unless already done."""
    done_at = training_finished(cfg)
    if done_at is None:
        train(cfg)
    else:
        print(f"{cfg.run.name}: training finished at step {done_at}; not retrained", file=sys.stderr)
    report = current_evaluation(cfg)
    if report is None:
        report = evaluate(cfg)
    else:
        print(f"{cfg.run.name}: rouge.json is up to date; not re-evaluated", file=sys.stderr)
    return report


def summarize_seeds(name: str, runs: list[dict]) -> dict:
    """Mean and sample standard deviation (ddof 1; None for one seed) of each ROUGE F over the runs."""
    summary = {"name": name, "seeds": [r["seed"] for r in runs], "runs": runs, "mean": {}, "std": {}}
    for kind in ROUGE_TYPES:
        values = np.array([r[kind] for r in runs])
        summary["mean"][kind] = float(values.mean())
        summary["std"][kind] = float(values.std(ddof=1)) if len(values) > 1 else None
    return summary


WRITER = "summarizer seeds"


def run_seeds(cfg: Config, n: int) -> tuple[dict, Path]:
    """Seeds 1..n of `cfg`; writes seeds_<run.name>.json beside the run dirs. Returns (summary, its path)."""
    if n < 1:
        raise ConfigError(f"--n must be at least 1, got {n}")
    path = seed_config(cfg, 1).run_dir.parent / f"seeds_{cfg.run.name}.json"
    key = f"run.name (seeds_{cfg.run.name}.json beside the run dirs)"
    check_report_target(path, WRITER, key)  # before hours of training, not after
    runs = []
    for seed in range(1, n + 1):
        seed_cfg = seed_config(cfg, seed)
        report = run_seed(seed_cfg)
        runs.append({"seed": seed, "run_dir": str(seed_cfg.run_dir),
                     **{kind: report[kind]["f"] for kind in ROUGE_TYPES},
                     "checkpoint_step": report["settings"]["checkpoint"]["step"]})
    summary = summarize_seeds(cfg.run.name, runs)
    summary["eval"] = {key: getattr(cfg.eval, key) for key in EVAL_KEYS}
    summary["eval"]["pairs"] = report["settings"]["pairs"]
    return write_report(path, summary, WRITER, key), path


def format_summary(summary: dict) -> str:
    e = summary["eval"]
    lines = [f"{summary['name']}, seeds {', '.join(map(str, summary['seeds']))} ({e['split']}, {e['pairs']} pairs, "
             f"beam {e['beam_size']}): ROUGE F, mean ± sample std"]
    for kind in ROUGE_TYPES:
        std = summary["std"][kind]
        values = ", ".join(f"{r[kind]:.2f}" for r in summary["runs"])
        lines.append(f"  {NAMES[kind]} {summary['mean'][kind]:.2f} ± {'n/a' if std is None else f'{std:.2f}'}"
                     f"  [{values}]")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML experiment file (see configs/)")
    parser.add_argument("--n", type=int, required=True, metavar="N", help="train seeds 1..N")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides, applied in order")


def cli(args: argparse.Namespace) -> int:
    summary, path = run_seeds(load_config(args.config, args.overrides), args.n)
    print(format_summary(summary))
    print(f"written to {path}", file=sys.stderr)
    return 0
