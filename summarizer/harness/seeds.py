"""Seed variance: train and evaluate one config (each of its stages) with seeds 1..N (resumable), then mean ±
sample std of ROUGE."""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import numpy as np

from summarizer.config.load import load_stages
from summarizer.config.schema import Config
from summarizer.data.pairs import read_pairs_file
from summarizer.data.prepared import read_pairs
from summarizer.errors import ConfigError
from summarizer.evaluation.evaluate import evaluate
from summarizer.evaluation.scoring import ROUGE_TYPES, measure_for, pair_references, references_sha256
from summarizer.model import checkpoint
from summarizer.outputs import check_report_target, write_report
from summarizer.train.stages import train_stages

NAMES = {"rouge1": "ROUGE-1", "rouge2": "ROUGE-2", "rougeL": "ROUGE-L"}
# rouge.json settings that must equal the current eval config for an evaluation to be reused (and, where the
# config sets them rather than leaving them to auto, its quantize and precision; its pairs file: `pairs_file`, whose
# name is then the evaluation's `split`)
EVAL_KEYS = ("split", "beam_size", "max_len", "min_len", "length_penalty", "no_repeat_ngram", "known_words",
             "no_repeat_words", "truncate_bytes")


def _seeded(path: str, stage: str, seed: int) -> str:
    """`name` -> `name-seed3`; a stage's `name/stage` -> `name-seed3/stage`."""
    return f"{path[:-len(stage) - 1]}-seed{seed}/{stage}" if stage else f"{path}-seed{seed}"


def seed_stages(stages: list[tuple[str, Config]], seed: int) -> list[tuple[str, Config]]:
    """One seed's runs of a config's stages (`load_stages`): train.seed set in each, its run named
    `<run.name>-seed<N>` (a stage's `<run.name>-seed<N>/<stage>`; an explicit run.dir and eval.out_dir
    likewise), and a stage after the first starting from this seed's stage before it."""
    out: list[tuple[str, Config]] = []
    for name, cfg in stages:
        if cfg.eval.checkpoint:
            raise ConfigError("seeds evaluates each run's own best.pt: drop eval.checkpoint "
                              f"(now {cfg.eval.checkpoint})")
        seeded = copy.deepcopy(cfg)
        seeded.train.seed = seed
        seeded.run.name = _seeded(cfg.run.name, name, seed)
        if cfg.run.dir:
            seeded.run.dir = _seeded(cfg.run.dir.rstrip("/"), name, seed)
        if cfg.eval.out_dir:
            seeded.eval.out_dir = f"{cfg.eval.out_dir.rstrip('/')}-seed{seed}"
        if out and Path(cfg.train.init_from).parent == stages[len(out) - 1][1].run_dir:
            seeded.train.init_from = str(out[-1][1].run_dir / Path(cfg.train.init_from).name)
        out.append((name, seeded))
    return out


def current_evaluation(cfg: Config) -> dict | None:
    """The run's rouge.json when it scored the current best.pt with the current eval settings against the references
    it would score against now, else None."""
    out_dir = Path(cfg.eval.out_dir) if cfg.eval.out_dir else cfg.run_dir
    path, best = out_dir / "rouge.json", cfg.run_dir / checkpoint.BEST
    if not path.is_file() or not best.is_file():
        return None
    try:
        report = json.loads(path.read_text())
        settings = report["settings"]
    except (ValueError, KeyError):
        return None
    if any(settings.get(key) != getattr(cfg.eval, key) for key in EVAL_KEYS if key != "split" or not cfg.eval.pairs):
        return None
    if settings.get("pairs_file") != (cfg.eval.pairs or None) or any(
            getattr(cfg.eval, key) != "auto" and settings.get(key) != getattr(cfg.eval, key)
            for key in ("quantize", "precision")):
        return None
    limit = cfg.eval.limit or None
    pairs = (read_pairs_file(cfg.eval.pairs)[:limit] if cfg.eval.pairs
             else read_pairs(cfg.data.dir, cfg.eval.split, limit))
    scored = settings.get("checkpoint", {})
    if settings.get("references_sha256") != references_sha256(pair_references(pairs)):
        return None  # other pairs (another data dir, an edited file, eval.limit), or a rouge.json that did not say
    if Path(scored.get("path", "")).name != checkpoint.BEST or scored.get("step") != checkpoint.load(best)["step"]:
        return None
    return report


def run_seed(stages: list[tuple[str, Config]]) -> dict:
    """Train (or resume, or skip when finished) one seed's runs, stage by stage, then evaluate the last unless
    already done. A stop signal ends the seeds there (SeedStopped): an unfinished run is never scored."""
    summary = train_stages(stages)
    if summary is not None and summary["signal"] is not None:
        raise SeedStopped(summary["signal"])
    cfg = stages[-1][1]
    report = current_evaluation(cfg)
    if report is None:
        report = evaluate(cfg)
    else:
        print(f"{cfg.run.name}: rouge.json is up to date; not re-evaluated", file=sys.stderr)
    return report


class SeedStopped(Exception):
    """A seed's training was stopped by a signal: the same command resumes it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def summarize_seeds(name: str, runs: list[dict]) -> dict:
    """Mean and sample standard deviation (ddof 1; None for one seed) of each ROUGE score over the runs."""
    summary = {"name": name, "seeds": [r["seed"] for r in runs], "runs": runs, "mean": {}, "std": {}}
    for kind in ROUGE_TYPES:
        values = np.array([r[kind] for r in runs])
        summary["mean"][kind] = float(values.mean())
        summary["std"][kind] = float(values.std(ddof=1)) if len(values) > 1 else None
    return summary


WRITER = "summarizer seeds"


def run_seeds(stages: list[tuple[str, Config]], n: int) -> tuple[dict, Path]:
    """Seeds 1..n of a config's stages (`load_stages`); writes seeds_<run.name>.json beside the run dirs.
    Returns (summary, its path)."""
    if n < 1:
        raise ConfigError(f"--n must be at least 1, got {n}")
    stage, first = stages[0]
    name = first.run.name[:-len(stage) - 1] if stage else first.run.name
    seed_dir = seed_stages(stages, 1)[0][1].run_dir
    path = (seed_dir.parent if stage else seed_dir).parent / f"seeds_{name}.json"
    key = f"run.name (seeds_{name}.json beside the run dirs)"
    check_report_target(path, WRITER, key)  # before hours of training, not after
    runs = []
    for seed in range(1, n + 1):
        seeded = seed_stages(stages, seed)
        report = run_seed(seeded)
        measure = measure_for(report["settings"].get("truncate_bytes"))  # what the evaluation measured
        runs.append({"seed": seed, "run_dir": str(seeded[-1][1].run_dir),
                     **{kind: report[kind][measure] for kind in ROUGE_TYPES},
                     "checkpoint_step": report["settings"]["checkpoint"]["step"]})
    summary = summarize_seeds(name, runs)
    cfg = stages[-1][1]
    summary["eval"] = {key: getattr(cfg.eval, key) for key in EVAL_KEYS}
    # what was scored, as the evaluation names it: a pairs file's name, not eval.split, when eval.pairs is set
    summary["eval"].update({key: report["settings"].get(key) for key in ("split", "pairs", "pairs_file")})
    return write_report(path, summary, WRITER, key), path


def format_summary(summary: dict) -> str:
    e = summary["eval"]
    measure = f"recall of the first {e['truncate_bytes']} bytes" if e.get("truncate_bytes") else "F"
    lines = [f"{summary['name']}, seeds {', '.join(map(str, summary['seeds']))} ({e['split']}, {e['pairs']} pairs, "
             f"beam {e['beam_size']}): ROUGE {measure}, mean ± sample std"]
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
    try:
        summary, path = run_seeds(load_stages(args.config, args.overrides), args.n)
    except SeedStopped as stop:
        print("seeds stopped by a signal, before any summary was written; run the same command again to resume",
              file=sys.stderr)
        return 128 + stop.signum
    print(format_summary(summary))
    print(f"written to {path}", file=sys.stderr)
    return 0
