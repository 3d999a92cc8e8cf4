"""scripts/gpu_check.sh's helpers: synthetic pairs at Gigaword's lengths, and the Markdown table of its results.

    python scripts/gpu_check_report.py synth DATA_DIR PAIRS_DIR [--pairs 100000]
    python scripts/gpu_check_report.py report OUT [--device cuda|cpu]   # prints the table, writes OUT/gpu_check.md
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
from pathlib import Path

PARTS = {1: "1 train", 2: "2 bench", 3: "3 eval", 4: "4 placement", 5: "5 gigaword.yaml", 6: "6 profile"}


def read_jsonl(path: Path) -> list[dict]:
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line torn by a run killed at its timeout
            pass
    return records


def run_summary(run_dir: Path) -> dict | None:
    """A run's train records: mean tokens/s (and MFU) over its first third of steps and over its last third,
    the loss at its last logged step, its peak memory; None when it logged nothing."""
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("split") == "train"]
    if not records:
        return None
    last = records[-1]["step"]
    first = [r for r in records if r["step"] <= last // 3] or records[:1]
    later = [r for r in records if r["step"] > last - last // 3] or records[-1:]
    start = records.index(later[0])
    mean = lambda rs, key: statistics.fmean(r[key] for r in rs)  # noqa: E731
    out = {"first": mean(first, "tokens_per_s"), "first_steps": f"1-{first[-1]['step']}",
           "later": mean(later, "tokens_per_s"),
           "later_steps": f"{records[start - 1]['step'] + 1 if start else 1}-{last}",
           "loss": records[-1]["loss"], "last_step": last}
    if all("mfu" in r for r in later):
        out["mfu"] = mean(later, "mfu")
    for key, name in (("peak_memory_mb", "peak_mb"), ("peak_reserved_mb", "reserved_mb")):
        if any(key in r for r in records):
            out[name] = max(r.get(key, 0.0) for r in records)
    return out


NO_RATIO = ("mfu",)  # each precision's MFU is of its own peak (TF32's 495 TF vs bf16's 989 TF on an H100)


def ratio(value: float, base: float | None) -> float | None:
    return value / base if base else None


def chosen(run_dir: Path) -> tuple[str, str | None]:
    """The precision a run trained in (manifest.json), and the probe's timings when a probe timed them (None where
    a rule chose: a CPU's auto, or a captured step's)."""
    try:
        manifest = json.loads((run_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return "?", None
    from summarizer.train.precision import timings
    probe = manifest.get("precision_probe")
    return manifest.get("precision", "?"), timings(probe) if probe and not probe.get("captured") else None


def train_rows(out: Path) -> tuple[list[tuple], list[str]]:
    """Part 1: each precision's tokens/s early and late, loss and MFU, as a ratio to fp32's; `auto` is labelled
    with the precision it chose, and its probe's timings (on a GPU) are a note; <precision>_captured is that
    precision with train.cuda_graphs."""
    names = ("fp32", "bf16", "fp16", "auto")
    names += tuple(f"{p}_captured" for p in names)
    runs = {p: s for p in names if (s := run_summary(out / "train" / p))}
    base, rows, notes = runs.get("fp32", {}), [], []
    for p, s in runs.items():
        label = p.replace("_captured", ", train.cuda_graphs=true")
        if p.startswith("auto"):
            precision, times = chosen(out / "train" / p)
            notes.append(f"{PARTS[1]}, train.precision={label}: {precision}, "
                         + (f"by the probe's timings of forward and backward: {times}" if times else "by rule"))
            label = label.replace("auto", f"auto ({precision})")
        figures = [("first", f"tokens/s, steps {s['first_steps']}"), ("later", f"tokens/s, steps {s['later_steps']}"),
                   ("loss", f"loss at step {s['last_step']}"), ("mfu", f"MFU, steps {s['later_steps']}")]
        rows += [(PARTS[1], f"train.precision={label}: {what}", s[key],
                  None if key in NO_RATIO else ratio(s[key], base.get(key))) for key, what in figures if key in s]
    return rows, notes


def bench_rows(out: Path) -> tuple[list[tuple], list[str]]:
    """Part 2: bench.json's measured rows (on, on/off); skipped or failed rows become notes."""
    path = out / "bench" / "bench.json"
    results = json.loads(path.read_text()) if path.is_file() else []
    rows = [(PARTS[2], f"{r['practice']} ({r['unit']}, on)", r["on"]["median"], r["ratio"])
            for r in results if "ratio" in r]
    notes = [f"{PARTS[2]}, {r['practice']}: {r.get('skipped') or 'failed: ' + r.get('error', '?')}"
             for r in results if "ratio" not in r]
    return rows, notes


def eval_rows(out: Path) -> list[tuple]:
    """Part 3: each eval dir (SEARCH_PRECISION_SHAPES) against the dynamic fp32 search of the same beam: sentences/s
    (ratio: its speed over that one's), ROUGE-1 F, and the share of predictions equal to that one's."""
    reports = {d.name: (json.loads((d / "rouge.json").read_text()), (d / "predictions.txt").read_text().splitlines())
               for d in sorted((out / "eval").glob("*")) if (d / "rouge.json").is_file()}
    rows = []
    for name, (r, predictions) in reports.items():
        search = name.split("_", 1)[0]
        base, base_predictions = reports.get(f"{search}_fp32_dynamic", ({}, []))
        s = r["settings"]
        setting = (f"{search}, {s['precision']}, {s.get('shapes', '?')} shapes, batch {s.get('batch_tokens', '?')}"
                   f" ({name})")
        rows.append((PARTS[3], f"{setting}: sentences/s", r["sentences_per_s"],
                     ratio(r["sentences_per_s"], base.get("sentences_per_s"))))
        rows.append((PARTS[3], f"{setting}: ROUGE-1 F", r["rouge1"]["f"],
                     ratio(r["rouge1"]["f"], base.get("rouge1", {}).get("f"))))
        if base_predictions and len(base_predictions) == len(predictions):
            same = sum(a == b for a, b in zip(predictions, base_predictions, strict=True)) / len(predictions)
            rows.append((PARTS[3], f"{setting}: share of predictions equal to the dynamic fp32 search's", same, None))
    return rows


def run_rows(out: Path, part: int, folder: str, figures: tuple, base: dict) -> list[tuple]:
    """Parts 4 and 5: each run under out/folder, its `figures` ((key, label), ...) as a ratio to `base`'s."""
    rows = []
    for run_dir in sorted((out / folder).glob("*")):
        if (s := run_summary(run_dir)) is not None:
            rows += [(PARTS[part], f"{run_dir.name}: {label.format(**s)}", s[key],
                      None if key in NO_RATIO else ratio(s[key], base.get(key))) for key, label in figures if key in s]
    return rows


def compile_rows(out: Path) -> list[tuple]:
    """Part 5's compiled runs, from their logs: the seconds the first step took (compiling) and the recompilations
    torch printed; a run killed inside its first step gets the second row alone."""
    rows = []
    for log in sorted((out / "logs").glob("5-gigaword_*.log")):
        text, name = log.read_text(errors="replace"), log.stem.removeprefix("5-gigaword_")
        if "torch.compile (" not in text:
            continue
        if first := re.search(r"^step \d+: compiled and ran in ([\d.]+) s$", text, re.M):
            rows.append((PARTS[5], f"{name}: first step, compiling (s)", float(first[1]), None))
        rows.append((PARTS[5], f"{name}: recompilations", text.count("Recompiling function"), None))
    return rows


def top_operators(table: Path, n: int = 5) -> list[str]:
    """The first `n` operators of a torch.profiler table (key_averages().table(), sorted as it was written)."""
    lines = table.read_text().splitlines() if table.is_file() else []
    header = next((ln for ln in lines if "Self CPU %" in ln), None)
    if header is None:
        return []
    width = header.index("Self CPU %")
    names = [ln[:width].strip() for ln in lines[lines.index(header) + 2:] if ln.strip() and not ln.startswith("-")]
    return [name for name in names if name and not name.startswith("ProfilerStep")][:n]


TRAIN_PROFILES = (("train_fp32", "train fp32, first steps"), ("train_bf16", "train bf16, first steps"),
                  ("gigaword_bf16_captured", "gigaword.yaml bf16 captured, steps after its first epoch's shapes"),
                  ("gigaword_bf16", "gigaword.yaml bf16, steps after its first epoch's shapes"))
STEP_FIGURES = (("wall_ms", "ms a step"), ("device_ms", "ms the GPU is busy a step"),
                ("launches", "kernel launches a step"), ("host_reads", "values read back to the host a step"))
DECODE_FIGURES = (("wall_s", "seconds"), ("host_reads_per_step", "values read back to the host a step"),
                  ("device_syncs_per_step", "waits for the GPU a step (sync debug mode)"),
                  ("launches_per_step", "kernel launches a step"),
                  ("device_share", "share of the time the GPU is busy"))


def profile_rows(out: Path) -> tuple[list[tuple], list[str]]:
    """Part 6: the decode profiles' figures (beam 4, greedy) and each training profile's cost a step
    (profile.json) as rows; each profile's top operators as notes."""
    rows, notes = [], []
    for decode in ("decode", "decode_greedy"):
        bench = out / "profile" / decode / "bench.json"
        for r in json.loads(bench.read_text()) if bench.is_file() else []:
            if r.get("practice") != "decode_profile" or "wall_s" not in r:
                continue
            search = "greedy" if r["beam"] == 1 else f"beam {r['beam']}"
            label = f"decode {search}, {r['sentences']} sentences"
            rows += [(PARTS[6], f"{label}: {what}", r[key], None) for key, what in DECODE_FIGURES if key in r]
            notes.append(f"{PARTS[6]}, {label}: most time: " + ", ".join(
                top_operators(out / "profile" / decode / "decode_profile.txt")))
    for name, label in TRAIN_PROFILES:
        summary = out / "profile" / name / "profile.json"
        figures = json.loads(summary.read_text()) if summary.is_file() else {}
        rows += [(PARTS[6], f"{label}: {what}", figures[key], None) for key, what in STEP_FIGURES if key in figures]
        if ops := top_operators(out / "profile" / name / "profile.txt"):
            notes.append(f"{PARTS[6]}, {label}: most time: {', '.join(ops)}")
    return rows, notes


def all_rows(out: Path) -> tuple[list[tuple], list[str]]:
    trained, notes = train_rows(out)
    bench, bench_notes = bench_rows(out)
    notes += bench_notes
    one_device = run_summary(out / "train" / "fp32") or {}
    placement = (("later", "tokens/s, steps {later_steps} (ratio: to one device, fp32)"),)
    gigaword = (("later", "tokens/s, steps {later_steps}"), ("mfu", "MFU, steps {later_steps}"),
                ("peak_mb", "peak memory MiB"), ("reserved_mb", "peak memory reserved MiB (CUDA graphs' pools too)"))
    rows = (trained + bench + eval_rows(out) + run_rows(out, 4, "placement", placement, one_device)
            + run_rows(out, 4, "ddp", placement, one_device)
            + run_rows(out, 5, "gigaword", gigaword, run_summary(out / "gigaword" / "fp32") or {}) + compile_rows(out))
    profiled, profile_notes = profile_rows(out)
    rows += profiled
    notes += profile_notes
    notes_file = out / "notes.txt"
    for line in notes_file.read_text().splitlines() if notes_file.is_file() else []:
        part, label, message = line.split("|", 2)
        notes.append(f"{PARTS[int(part)]}, {label}: {message}")
    return rows, sorted(notes, key=lambda n: n[0])


def machine(device: str) -> str:
    import torch
    if device == "cuda" and torch.cuda.is_available():
        name = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    else:
        cpuinfo = Path("/proc/cpuinfo")
        models = [ln.split(":", 1)[1].strip() for ln in (cpuinfo.read_text().splitlines() if cpuinfo.is_file() else [])
                  if ln.startswith("model name")]
        name = f"CPU {models[0] if models else platform.processor()} ({torch.get_num_threads()} threads)"
    try:
        # "-dirty" when the tree differs from the commit: the code that ran is then not the commit named
        commit = os.environ.get("GPU_CHECK_COMMIT") or subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True, text=True,
            check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown (no git here: set GPU_CHECK_COMMIT)"
    return f"{name}; torch {torch.__version__}; commit {commit}"


def fmt(x: float | None) -> str:
    if x is None:
        return ""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def markdown(rows: list[tuple], notes: list[str], header: str) -> str:
    lines = [header, "", "| part | setting | figure | ratio |", "|---|---|---|---|"]
    lines += [f"| {part} | {setting} | {fmt(value)} | {fmt(r) + 'x' if r is not None else ''} |"
              for part, setting, value, r in rows]
    return "\n".join(lines + ([""] + [f"- {n}" for n in notes] if notes else [])) + "\n"


def synth(data_dir: Path, pairs_dir: Path, pairs: int, seed: int = 0) -> None:
    """train/validation/test.jsonl of random words: word counts of source and target drawn together from
    data_dir's train pairs (Gigaword's, for the recipe's data); words from a Zipf-distributed 60k-word list,
    text enough for gigaword.yaml's 32k SentencePiece vocabulary; a third of each target copied from its source."""
    import numpy as np
    lengths = np.array([(len(p["source"].split()), len(p["target"].split()))
                        for p in read_jsonl(data_dir / "train.jsonl")])
    rng = np.random.default_rng(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["an", "er", "in", "on", "st"]
    words = list(dict.fromkeys("".join(rng.choice(syllables, size=rng.integers(1, 5))) for _ in range(90_000)))
    words = np.array(words[:60_000])
    zipf = 1.0 / np.arange(1, len(words) + 1)
    zipf /= zipf.sum()
    pairs_dir.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", pairs), ("validation", 500), ("test", 200)):
        picked = lengths[rng.integers(len(lengths), size=n)]
        src_words = iter(words[rng.choice(len(words), size=int(picked[:, 0].sum()), p=zipf)].tolist())
        tgt_words = iter(words[rng.choice(len(words), size=int(picked[:, 1].sum()), p=zipf)].tolist())
        with open(pairs_dir / f"{split}.jsonl", "w") as f:
            for n_src, n_tgt in picked.tolist():
                source = [next(src_words) for _ in range(n_src)]
                target = [source[rng.integers(n_src)] if i % 3 == 0 else next(tgt_words) for i in range(n_tgt)]
                # the hub's column names, which gigaword.yaml reads
                f.write(json.dumps({"document": " ".join(source), "summary": " ".join(target)}) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("synth")
    s.add_argument("data_dir", type=Path)
    s.add_argument("pairs_dir", type=Path)
    s.add_argument("--pairs", type=int, default=100_000)
    r = sub.add_parser("report")
    r.add_argument("out", type=Path)
    r.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    if args.command == "synth":
        synth(args.data_dir, args.pairs_dir, args.pairs)
        return 0
    rows, notes = all_rows(args.out)
    table = markdown(rows, notes, f"GPU check, {machine(args.device)}")
    (args.out / "gpu_check.md").write_text(table)
    print(table, end="")
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
