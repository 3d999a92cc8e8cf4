"""Checkpoint averaging: the element-wise mean of a run's last N step checkpoints, saved as an eval-ready checkpoint."""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from summarizer.config.load import load_config
from summarizer.config.schema import Config
from summarizer.errors import CheckpointError
from summarizer.model import checkpoint

_STEP_FILE = re.compile(r"ckpt_(\d+)\.pt$")


def checkpoints_by_step(run_dir: Path) -> list[Path]:
    """The run's step checkpoints (ckpt_<step>.pt), oldest first by step."""
    found = [(int(m.group(1)), p) for p in run_dir.glob("ckpt_*.pt") if (m := _STEP_FILE.search(p.name))]
    return [p for _, p in sorted(found)]


def output_path(run_dir: Path, last: int) -> Path:
    return run_dir / f"averaged_last{last}.pt"


def _check_compatible(state: dict, first: dict, path: Path, first_path: Path) -> None:
    """Weights of different models or vocabularies cannot be averaged: refuse, naming both files."""
    if state["config"]["model"] != first["config"]["model"]:
        diff = sorted(k for k in set(state["config"]["model"]) | set(first["config"]["model"])
                      if state["config"]["model"].get(k) != first["config"]["model"].get(k))
        raise CheckpointError(f"{path} has another model config than {first_path} (model.{', model.'.join(diff)} "
                              f"differ): only checkpoints of one model can be averaged; lower --last")
    have, want = state["data_meta"].get("spm_sha256"), first["data_meta"].get("spm_sha256")
    if have != want:
        raise CheckpointError(f"{path} was trained with tokenizer sha256 {str(have)[:12]}…, {first_path} with "
                              f"{str(want)[:12]}…: only checkpoints of one tokenizer can be averaged; lower --last")


def average_states(paths: list[Path]) -> tuple[dict, dict]:
    """(averaged model state_dict, newest checkpoint's state without optimizer). Sums in float64, one
    checkpoint in memory at a time, then casts each tensor back to its own dtype."""
    sums: dict[str, torch.Tensor] = {}
    first = newest = None
    for path in tqdm(paths, desc="average", unit="checkpoint", file=sys.stderr, leave=False,
                     disable=None):  # disable=None: no bar when stderr is not a terminal
        state = checkpoint.load(path)
        if first is None:
            first = {"config": state["config"], "data_meta": state["data_meta"]}
        _check_compatible(state, first, path, paths[0])
        if sums and set(state["model"]) != set(sums):
            raise CheckpointError(f"{path} holds other weights than {paths[0]}: it cannot be averaged with it")
        for name, tensor in state["model"].items():
            if not tensor.is_floating_point():
                sums[name] = tensor.clone()  # integer buffers are not averaged: the newest is kept
            elif name in sums:
                sums[name] += tensor.double()
            else:
                sums[name] = tensor.double()
        newest = {k: v for k, v in state.items() if k in ("config", "data_meta", "step", "model")}
        del state
    averaged = {name: (total / len(paths)).to(newest["model"][name].dtype) if total.is_floating_point() else total
                for name, total in sums.items()}
    return averaged, newest


def average_checkpoints(cfg: Config, last: int | None = None) -> tuple[Path, list[int]]:
    """Write <run_dir>/averaged_last<N>.pt, the mean of the newest N ckpt_*.pt (None: every one the run kept),
    loadable by eval.checkpoint; returns its path and the averaged steps."""
    run_dir = cfg.run_dir
    if last is not None and last < 1:
        raise CheckpointError(f"--last must be at least 1, got {last}")
    if not run_dir.is_dir():
        raise CheckpointError(f"run dir {run_dir} {'is a file' if run_dir.exists() else 'does not exist'}: set "
                              f"run.name (or run.dir) to a trained run")
    found = checkpoints_by_step(run_dir)
    if not found:
        raise CheckpointError(f"{run_dir} holds no step checkpoint (ckpt_*.pt) to average: train the run first")
    last = len(found) if last is None else last
    if len(found) < last:
        raise CheckpointError(f"{run_dir} holds {len(found)} step checkpoint(s) (ckpt_*.pt), fewer than the "
                              f"{last} asked for: lower --last (N), or train with train.keep_last={last} or more "
                              f"(a run keeps its newest train.keep_last, one per train.ckpt_every steps)")
    paths = found[-last:]
    averaged, newest = average_states(paths)
    state = {**newest, "model": averaged,
             "averaged_from": [{"file": p.name, "step": int(_STEP_FILE.search(p.name).group(1))} for p in paths]}
    out = output_path(run_dir, last)
    checkpoint.save(state, out)
    return out, [entry["step"] for entry in state["averaged_from"]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML experiment file (see configs/)")
    parser.add_argument("--last", type=int, metavar="N",
                        help="average the newest N ckpt_*.pt (default: every one the run kept, train.keep_last)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides (run.name=...)")


def cli(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    out, steps = average_checkpoints(cfg, args.last)
    print(f"averaged steps {', '.join(map(str, steps))} into {out}; evaluate it with eval.checkpoint={out} "
          f"eval.out_dir=evals/{cfg.run.name}-{out.stem} (a dir of its own: best.pt's evaluation in the run dir "
          f"stays)", file=sys.stderr)
    return 0
