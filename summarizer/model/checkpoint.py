"""Versioned, atomic checkpoints holding everything needed to resume exactly; latest/best pointers."""
from __future__ import annotations

import errno
import json
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from summarizer.config.load import from_dict
from summarizer.errors import CheckpointError, DataError
from summarizer.model.transformer import Seq2Seq
from summarizer.outputs import atomic_open, atomic_write

# 2: configs carry the recipe's defaults (relu, no biases, ...) and the best score is named. A
# checkpoint stores its whole config, so no older default needs keeping; older files are refused.
FORMAT_VERSION = 2
LATEST, BEST = "latest.json", "best.pt"


def rng_state(cuda: Sequence[torch.device] = ()) -> dict:
    """This process's random streams: python's, numpy's, torch's on the CPU, and those of the CUDA devices the run
    uses (`cuda`, in order), not every GPU the machine has: a resume on a machine with fewer GPUs restores them."""
    # numpy's key array is stored as a tensor so that weights_only loading needs no numpy globals.
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss]}
    if cuda:
        state["cuda"] = [torch.cuda.get_rng_state(device) for device in cuda]
    return state


def set_rng_state(state: dict, cuda: Sequence[torch.device] = ()) -> None:
    """`rng_state`'s streams back; its CUDA states go to the run's CUDA devices `cuda`, in order (a state saved
    on a CPU has none; one saved for more devices than `cuda` gives its first ones)."""
    random.setstate(_as_python_state(state["python"]))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    for device, cuda_state in zip(cuda, state.get("cuda", ()), strict=False):
        torch.cuda.set_rng_state(cuda_state, device)


def _as_python_state(state):
    # random.setstate wants tuples; a weights_only round trip may hand back lists.
    return tuple(tuple(x) if isinstance(x, list) else x for x in state)


def save(state: dict, path: Path) -> None:
    """Write `state` (a dict of state_dicts and plain values) to path, atomically."""
    state = {"format_version": FORMAT_VERSION, **state}
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_open(path) as fh:
            torch.save(state, fh)
    except RuntimeError as exc:  # torch's writer reports a failed write ("enforce fail at inline_container.cc"),
        # with the file's own OSError (ENOSPC, EFBIG) as its context where the write reached Python
        cause = exc.__cause__ or exc.__context__
        if not isinstance(cause, OSError) and "write" not in str(exc).lower():
            raise
        code = cause.errno if isinstance(cause, OSError) and cause.errno else errno.ENOSPC
        why = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(exc).splitlines()[0]
        raise OSError(code, f"cannot write the checkpoint (the disk is full or a file-size limit is "
                            f"set: {why})", str(path)) from None


def load(path: str | Path, map_location="cpu") -> dict:
    """Load with weights_only=True (no arbitrary code), checking the format version."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a directory: give a .pt file in it (best.pt, ckpt_*.pt), or "
                              f"run.dir={path} to evaluate that run's best.pt")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist; train first (`make train`) "
                              f"or point eval.checkpoint at an existing .pt file")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch.load raises many types for a truncated, empty or foreign file
        first_line = (str(exc).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"checkpoint {path} is unreadable: corrupt, truncated or not a checkpoint "
                              f"({type(exc).__name__}{': ' + first_line if first_line else ''})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} is unreadable: it holds a {type(state).__name__}, not a checkpoint")
    version = state.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {version}, but this code reads version "
                              f"{FORMAT_VERSION}; evaluate it with the release that wrote it (its manifest.json "
                              f"names the git commit), or train a new run with this one")
    return state


def require_model(state: dict, path: str | Path) -> dict:
    """`state` if it holds what decoding needs (weights, their config, the data they were trained on)."""
    missing = [k for k in ("model", "config", "data_meta") if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {', '.join(missing)}: it was not written by this product's "
                              f"train or average; evaluate a checkpoint of a run (best.pt or ckpt_*.pt)")
    return state


def restore_model(state: dict) -> Seq2Seq:
    """The model a checkpoint describes, built from its own model config and vocabulary (never the current
    config's), with its weights, on the CPU: every path that loads weights builds the model here. Only
    the model section is read: settings of decoding or logging may change between releases. The initial weights
    it replaces are drawn from a fork of the CPU's random stream: a training run that re-scores best.pt draws the
    same dropout masks after it (validation.rescore_best)."""
    with torch.random.fork_rng(devices=[]):
        model = Seq2Seq(from_dict({"model": state["config"]["model"]}).model, state["data_meta"]["vocab_size"])
    model.load_state_dict(state["model"])
    return model


def step_path(run_dir: Path, step: int) -> Path:
    return run_dir / f"ckpt_{step:08d}.pt"


def save_step(state: dict, run_dir: Path, keep_last: int) -> Path:
    """Save a step checkpoint, point `latest` at it, then prune all but the newest `keep_last`: this one and the
    ones before it. Any after it are of a timeline the run left when it resumed before them (a checkpoint torn
    by a crash, or written just before one, its pointer not yet moved): they go, and never push this one out."""
    path = step_path(run_dir, state["step"])
    save(state, path)
    atomic_write(run_dir / LATEST, json.dumps({"checkpoint": path.name, "step": state["step"]}))
    files = sorted(run_dir.glob("ckpt_*.pt"))
    after, upto = [f for f in files if f.name > path.name], [f for f in files if f.name <= path.name]
    for old in after + upto[:-max(keep_last, 1)]:
        old.unlink(missing_ok=True)
    return path


def step_checkpoints(run_dir: Path) -> list[Path]:
    """The run's step checkpoints, newest first: the `latest` pointer's target, then every ckpt_*.pt by step."""
    files = sorted(Path(run_dir).glob("ckpt_*.pt"), reverse=True)
    try:
        pointed = Path(run_dir) / json.loads((Path(run_dir) / LATEST).read_text())["checkpoint"]
    except (OSError, ValueError, KeyError, TypeError):
        return files
    return [pointed] + [f for f in files if f != pointed] if pointed.is_file() else files


def latest_path(run_dir: Path) -> Path | None:
    files = step_checkpoints(run_dir)
    return files[0] if files else None


def load_latest(run_dir: Path) -> tuple[dict, Path, list[str]] | None:
    """(state, path, problems) of the newest readable step checkpoint; None when the run has none.

    An unreadable checkpoint (a crash mid-copy, a full disk, a file replaced by hand) is skipped and
    its problem returned, so the run resumes from the newest one that loads; if none loads, the error
    lists them all.
    """
    problems = []
    for path in step_checkpoints(run_dir):
        try:
            return load(path), path, problems
        except CheckpointError as exc:
            problems.append(str(exc))
    if problems:
        raise CheckpointError(f"no checkpoint of run {run_dir} is readable: {'; '.join(problems)}. Start a new run "
                              f"(run.name=NEW_NAME), or restore a checkpoint from a backup")
    return None


def check_tokenizer(ckpt_meta: dict, data_meta: dict, where: str) -> None:
    """Refuse data whose tokenizer differs from the one the weights were trained with."""
    have, want = data_meta.get("spm_sha256"), ckpt_meta.get("spm_sha256")
    if have != want:
        raise DataError(f"tokenizer mismatch: {where} was trained with tokenizer sha256 {str(want)[:12]}…, "
                        f"but the prepared data uses {str(have)[:12]}…; point data.dir at the data the "
                        f"model was trained on, or train a new run on this data")
