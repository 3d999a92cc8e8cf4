"""The runs table: each run's config diff from the recipe, steps, time, precision, commit, ROUGE (Markdown or CSV)."""
from __future__ import annotations

import argparse
import csv
import io
import json
import pickle
import sys
from pathlib import Path

import torch
import yaml

from summarizer.config.load import load_config, to_dict
from summarizer.config.schema import rules
from summarizer.errors import ConfigError, UserError
from summarizer.evaluation.scoring import ROUGE_TYPES, measure_for
from summarizer.model import checkpoint

DEFAULT_ROOT = Path("checkpoints")
DEFAULT_RECIPE = Path(__file__).resolve().parents[2] / "configs" / "base.yaml"
IGNORED_SECTIONS = ("bench", "overfit")  # sections `train` does not read
# eval settings rouge.json records (summarizer/evaluation/evaluate.py `settings`) under their eval.* names; those
# the recipe leaves to auto record what auto chose on the machine that decoded, not a choice: never a difference
EVAL_RECORDED = ("beam_size", "max_len", "min_len", "length_penalty", "no_repeat_ngram", "known_words",
                 "no_repeat_words", "truncate_bytes", "bootstrap_samples", "precision", "quantize", "shapes",
                 "batch_tokens")
AUTO = {"precision": "auto", "quantize": "auto", "shapes": "auto", "batch_tokens": 0}
COLUMNS = ("run", "differs from recipe", "steps", "minutes", "precision", "device", "commit", "eval",
           "ROUGE-1", "ROUGE-2", "ROUGE-L", "sentences/s", "train PFLOP")


class ReportError(UserError):
    """There is no run to report on."""


def _flat(config: dict) -> dict:
    return {f"{section}.{key}": value for section, values in config.items() if isinstance(values, dict)
            for key, value in values.items()}


def _show(value) -> str:
    """A value as it would be written in a `key=value` override."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        return yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip()
    return str(value)


def ignored(dotted: str) -> bool:
    """Bookkeeping, not part of the experiment: a section `train` does not read, or a key marked as a name or
    path of what a run reads and writes (config.key's `bookkeeping` rule). Everything else is listed."""
    section, name = dotted.split(".", 1)
    if section in IGNORED_SECTIONS:
        return True
    try:
        return rules(section, name).get("bookkeeping", False)
    except KeyError:  # a key this code no longer has: list it
        return False


def config_diff(config_path: Path, recipe: dict) -> list[str]:
    """`key=value` for every setting of the run's config.yaml that differs from the recipe (flattened
    `load_config` dicts); a config this code no longer reads is compared as raw YAML."""
    try:
        run = _flat(to_dict(load_config(config_path)))
    except ConfigError as exc:
        print(f"note: {config_path}: {exc}; compared as written", file=sys.stderr)
        try:
            raw = yaml.safe_load(config_path.read_text())
        except yaml.YAMLError:
            return ["(config.yaml unreadable)"]
        run = _flat(raw if isinstance(raw, dict) else {})
    diff = []
    for key in sorted(set(run) | set(recipe)):
        if ignored(key) or run.get(key) == recipe.get(key):
            continue
        diff.append(f"{key}={_show(run[key])}" if key in run else f"{key}=(absent)")
    return diff


def eval_diff(settings: dict, recipe: dict) -> list[str]:
    """`eval.key=value` for every eval setting a rouge.json's `settings` record that differs from the recipe's (what
    was scored: eval.split, or eval.pairs for a pairs file). A key the file does not record (an older file's, or one
    it never records, such as eval.limit) is left out, as is one the recipe leaves to auto."""
    scored = {key: settings[key] for key in EVAL_RECORDED
              if key in settings and (key not in AUTO or recipe.get(f"eval.{key}") != AUTO[key])}
    if settings.get("pairs_file"):
        scored["pairs"] = settings["pairs_file"]
    elif "split" in settings:
        scored["split"] = settings["split"]
    return [f"eval.{key}={_show(value)}" for key, value in scored.items() if value != recipe.get(f"eval.{key}")]


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a kill: the others still count
    return records


def _peek(path: Path | None, key: str):
    """A checkpoint's `key`, memory-mapped so the weights are not read; None where it cannot be read."""
    if path is None or not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)[key]
    except (OSError, RuntimeError, pickle.UnpicklingError, EOFError, KeyError, TypeError):
        return None


def _progress(run_dir: Path) -> dict | None:
    """The latest checkpoint's progress (step, elapsed_s)."""
    return _peek(checkpoint.latest_path(run_dir), "progress")


def _rouge(run_dir: Path, records: list[dict]) -> dict:
    """ROUGE of the run's evaluation (rouge.json, its settings too) in the measure it scored (F; recall where it
    cut summaries to eval.truncate_bytes) and the checkpoint it scored where that is not the current best.pt
    (eval.checkpoint, or a best.pt that training has replaced since: best_step is the one there now), else the
    best valid ROUGE-1 (F) from training among those measured with the last one's settings (best.pt's, where a
    resumed run re-scored it, among them)."""
    report = _read_json(run_dir / "rouge.json")
    if report and all(kind in report for kind in ROUGE_TYPES):
        settings = report.get("settings") or {}
        cut = settings.get("truncate_bytes") or 0
        measure = measure_for(cut)
        scored = settings.get("checkpoint") or {}
        name, step = Path(scored.get("path") or checkpoint.BEST).name, scored.get("step")
        best_step = _peek(run_dir / checkpoint.BEST, "step") if name == checkpoint.BEST else None
        current = name == checkpoint.BEST and (step is None or best_step is None or step == best_step)
        return {"rouge_from": "eval", "eval_settings": settings, "eval_split": settings.get("split"),
                "eval_pairs": settings.get("pairs"), "eval_checkpoint": None if current else name, "eval_step": step,
                "best_step": best_step, "eval_commit": settings.get("git_commit"),
                "eval_dirty": settings.get("git_dirty"),
                "rouge_measure": f"recall@{cut}" if cut else "F", "sentences_per_s": report.get("sentences_per_s"),
                **{kind: report[kind][measure] for kind in ROUGE_TYPES},
                **{f"{kind}_ci": report[kind].get(f"{measure}_ci") for kind in ROUGE_TYPES}}
    valid = [r for r in records if r.get("split") == "valid" and r.get("rouge1") is not None]
    if not valid:
        return {"rouge_from": None}
    # Only ROUGE measured as the last was (a run resumed with other eval settings re-scores best.pt under them); a
    # record that predates the naming of settings is taken as the last's, unless a re-score came after it
    last, rescored = valid[-1].get("rouge_settings"), max((i for i, r in enumerate(valid) if "best_step" in r),
                                                          default=-1)
    valid = [r for i, r in enumerate(valid)
             if r.get("rouge_settings", last if i > rescored else None) == last]
    scored = [(r["step"], {kind: r.get(kind) for kind in ROUGE_TYPES}) for r in valid]
    scored += [(r["best_step"], {kind: r.get(f"best_{kind}") for kind in ROUGE_TYPES}) for r in valid
               if "best_step" in r]
    step, best = max(scored, key=lambda item: item[1]["rouge1"])
    return {"rouge_from": "valid", "valid_step": step, "rouge_measure": "F", **best}


def _run_name(run_dir: Path) -> str | None:
    """run.name in the run's config.yaml; None where it cannot be read."""
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    run = config.get("run") if isinstance(config, dict) else None
    return run.get("name") if isinstance(run, dict) else None


def run_row(run_dir: Path, recipe: dict) -> dict:
    """Everything the table shows about one run, as plain values. Where its ROUGE is a rouge.json's, the eval.* it
    differs in are that evaluation's (eval_diff), not config.yaml's: the eval section training ran with."""
    records = _metrics(run_dir / "metrics.jsonl")
    rouge, differs = _rouge(run_dir, records), config_diff(run_dir / "config.yaml", recipe)
    if rouge["rouge_from"] == "eval":
        differs = sorted([d for d in differs if not d.startswith("eval.")] + eval_diff(rouge.pop("eval_settings"),
                                                                                      recipe),
                         key=lambda d: d.split("=", 1)[0])
    manifest = _read_json(run_dir / "manifest.json") or {}
    pointer = _read_json(run_dir / checkpoint.LATEST) or {}
    progress = _progress(run_dir) or {}
    steps = pointer.get("step", progress.get("step"))
    if steps is None and records:
        steps = max(r["step"] for r in records)
    devices = list(dict.fromkeys(manifest.get("devices") or []))
    stage = f"{run_dir.parent.name}/{run_dir.name}"  # a recipe's stage is named with its recipe's run
    return {"run": stage if _run_name(run_dir) == stage else run_dir.name, "path": str(run_dir),
            "differs": differs,
            "steps": steps, "minutes": progress["elapsed_s"] / 60 if "elapsed_s" in progress else None,
            "precision": manifest.get("precision"), "device": ", ".join(devices) or None,
            "world_size": manifest.get("world_size"), "commit": manifest.get("git_commit") or None,
            "dirty": manifest.get("git_dirty"), "commits_by_step": _commits_by_step(manifest),
            "train_flops": _train_flops(records), **rouge}


def _train_flops(records: list[dict]) -> float | None:
    """Model FLOPs the run trained with (summarizer/train/watch/flops.py: real tokens, forward + backward), so
    cost compares in FLOPs across machines, not minutes; None for runs that did not log them."""
    logged = [r["train_flops"] for r in records if r.get("split") == "train" and "train_flops" in r]
    return float(sum(logged)) if logged else None


def _stage_dirs(path: Path) -> list[Path]:
    """The run dirs of a recipe's stages (`<run.name>/<stage>`) when `path` is that recipe's dir, else []."""
    return sorted(p for p in path.iterdir() if (p / "config.yaml").is_file()) if path.is_dir() else []


def find_run_dirs(dirs: list[str], root: Path) -> list[Path]:
    """The given dirs, or every dir under `root`, a recipe's dir standing for its stages' run dirs; those
    without a config.yaml are skipped with a note."""
    if dirs:
        candidates = [Path(d) for d in dirs]
    elif not root.is_dir():
        raise ReportError(f"{root}/ does not exist: train a run first (`make train`), or name run dirs: "
                          f"make report DIRS=\"dir ...\"")
    else:
        candidates = sorted(p for p in root.iterdir() if p.is_dir())
    runs = []
    for path in candidates:
        if (path / "config.yaml").is_file():
            runs.append(path)
        elif stage_dirs := _stage_dirs(path):
            runs += stage_dirs
        else:
            why = "does not exist" if not path.exists() else "is not a run dir (no config.yaml)"
            print(f"note: skipped {path}: {why}", file=sys.stderr)
    if not runs:
        where = ", ".join(dirs) if dirs else f"{root}/"
        raise ReportError(f"no run dirs in {where}: a run dir holds the config.yaml that `make train` writes; "
                          f"train a run first, or name run dirs: make report DIRS=\"dir ...\"")
    return runs


def collect(dirs: list[str], root: Path = DEFAULT_ROOT, recipe_path: Path = DEFAULT_RECIPE) -> list[dict]:
    recipe = _flat(to_dict(load_config(recipe_path)))
    return [run_row(path, recipe) for path in find_run_dirs(dirs, root)]


def _cell(row: dict, kind: str) -> str:
    value = row.get(kind)
    if value is None:
        return "—"
    if row["rouge_from"] == "valid":
        return f"{value:.1f} (valid)"
    ci = row.get(f"{kind}_ci")
    return f"{value:.1f} [{ci[0]:.1f}–{ci[1]:.1f}]" if ci else f"{value:.1f}"


def _commit(commit: str | None, dirty: bool | None) -> str:
    return commit[:8] + (" (dirty)" if dirty else "") if commit else "—"


def _commits_by_step(manifest: dict) -> str | None:
    """Where a resume trained on other code than the run's earlier steps: "STEP: COMMIT" from each step the code
    changed at (manifest.json's sessions), e.g. "0: a2f7dfa1; 30: 88c04211"; None where one commit ran every step."""
    changes, last = [], None
    for session in manifest.get("sessions") or []:
        code = (session.get("git_commit"), bool(session.get("git_dirty")))
        if code != last:
            changes.append(f"{session.get('from_step')}: {_commit(*code)}")
            last = code
    return "; ".join(changes) if len(changes) > 1 else None


def commit_cell(row: dict) -> str:
    """The commit training ran (manifest.json; each from its step where a resume ran other code), and the
    evaluation's where rouge.json names other code."""
    cell = row.get("commits_by_step") or _commit(row["commit"], row["dirty"])
    if row.get("eval_commit") and (row["eval_commit"], bool(row.get("eval_dirty"))) != (row["commit"],
                                                                                        bool(row["dirty"])):
        cell += f", eval {_commit(row['eval_commit'], row.get('eval_dirty'))}"
    return cell


def markdown_cells(row: dict) -> list[str]:
    commit = commit_cell(row)
    device = row["device"] or "—"
    if (row["world_size"] or 1) > 1:
        device = f"{row['world_size']}× {device}"
    measure = "" if row.get("rouge_measure", "F") == "F" else f", {row['rouge_measure']}"
    now = f", now {row['best_step']}" if row.get("best_step") is not None else ""  # a best.pt replaced since
    other = f", {row['eval_checkpoint']} (step {row['eval_step']}{now})" if row.get("eval_checkpoint") else ""
    evaluated = f"{row['eval_split']} ({row['eval_pairs']}){measure}{other}" if row["rouge_from"] == "eval" else (
        f"valid, step {row['valid_step']}" if row["rouge_from"] == "valid" else "—")
    return [row["run"], ", ".join(row["differs"]) or "(recipe)",
            f"{row['steps']:,}" if row["steps"] is not None else "—",
            f"{row['minutes']:.1f}" if row["minutes"] is not None else "—", row["precision"] or "—", device,
            commit, evaluated, *(_cell(row, kind) for kind in ROUGE_TYPES),
            f"{row['sentences_per_s']:.0f}" if row.get("sentences_per_s") else "—",
            f"{row['train_flops'] / 1e15:.3g}" if row.get("train_flops") else "—"]


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in markdown_cells(row)) + " |")
    return "\n".join(lines)


def csv_text(rows: list[dict]) -> str:
    """One line per run, numbers unformatted; ROUGE intervals in their own columns."""
    fields = ["run", "path", "differs", "steps", "minutes", "precision", "device", "world_size", "commit", "dirty",
              "commits_by_step", "eval_commit", "eval_dirty", "rouge_from", "eval_split", "eval_pairs",
              "eval_checkpoint", "eval_step", "best_step", "valid_step", "rouge_measure"]
    for kind in ROUGE_TYPES:
        fields += [kind, f"{kind}_low", f"{kind}_high"]
    fields += ["sentences_per_s", "train_flops"]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=fields, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        flat = {**row, "differs": " ".join(row["differs"])}
        for kind in ROUGE_TYPES:
            ci = row.get(f"{kind}_ci") or [None, None]
            flat[f"{kind}_low"], flat[f"{kind}_high"] = ci
        writer.writerow(flat)
    return out.getvalue()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dirs", nargs="*", metavar="DIR", help=f"run dirs (default: every dir under {DEFAULT_ROOT}/)")
    parser.add_argument("--csv", action="store_true", help="write CSV instead of a Markdown table")
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="where run dirs are looked for (checkpoints)")
    parser.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE,
                        help="config the runs are compared against (configs/base.yaml)")


def cli(args: argparse.Namespace) -> int:
    rows = collect(args.dirs, args.root, args.recipe)
    sys.stdout.write(csv_text(rows) if args.csv else markdown(rows) + "\n")
    return 0
