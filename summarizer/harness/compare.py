"""Compare two systems on the same references: ROUGE of each, B−A, paired bootstrap and randomization tests."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from summarizer.data.pairs import read_pairs_file
from summarizer.data.prepared import read_pairs
from summarizer.decode.inference import truncate_bytes
from summarizer.errors import UserError
from summarizer.evaluation.scoring import (
    MEASURES,
    ROUGE_TYPES,
    bootstrap_means,
    measure_for,
    pair_scores,
    references_sha256,
)
from summarizer.outputs import check_report_target, write_report

NAMES = {"rouge1": "ROUGE-1", "rouge2": "ROUGE-2", "rougeL": "ROUGE-L"}
PREDICTIONS = "predictions.txt"
OUTPUT = "compare.json"
WRITER = "summarizer compare"
METHODS = {
    "statistic": "d = mean over pairs of (F_B - F_A), per metric, in ROUGE points; B > A when d > 0",
    "bootstrap": "paired bootstrap (Koehn 2004): R resamples of the pairs with replacement, the same pairs for "
                 "both systems; 95% interval = 2.5th-97.5th percentiles of the resampled d*; b_wins = share of "
                 "resamples with d* > 0 (Koehn's 'B better in x% of samples'); p two-sided, on the resampled "
                 "differences shifted to the null: p = (1 + #{|d* - d| >= |d|}) / (R + 1)",
    "permutation": "approximate randomization (Riezler & Maxwell 2005): R shuffles, each swapping the two systems' "
                   "outputs of every pair independently with probability 1/2 (the sign of each pair's difference "
                   "flips); p two-sided: p = (1 + #{|d_shuffled| >= |d|}) / (R + 1)",
    "p_value": "the probability, were A and B equally good (null hypothesis), of a difference at least as large "
               "as the observed one in either direction; the +1s (add-one smoothing) count the observed data "
               "among the samples, so p is never 0 (smallest: 1/(R+1)) and the test keeps its level",
}


class CompareError(UserError):
    """Inputs to `compare` are missing, empty or do not line up."""


def read_predictions(path: str | Path, role: str) -> tuple[Path, list[str]]:
    """A predictions.txt, or an eval output dir holding one: its lines, one summary per pair."""
    path = Path(path)
    if path.is_dir():
        if not (path / PREDICTIONS).is_file():
            raise CompareError(f"{role} {path} is a directory without {PREDICTIONS}: give a predictions file "
                               f"or the eval.out_dir of an evaluation")
        path = path / PREDICTIONS
    if not path.is_file():
        raise CompareError(f"{role} {path} does not exist: give a {PREDICTIONS} (one summary per line) or "
                           f"an eval output dir holding one")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CompareError(f"{role} {path} is not UTF-8 text (byte {exc.start}): give the predictions.txt that "
                           f"eval wrote, or convert the file to UTF-8") from None
    if not text:
        raise CompareError(f"{role} {path} is empty: it should hold one summary per line, one per reference pair")
    lines = text.split("\n")
    return path, lines[:-1] if text.endswith("\n") else lines


def _stem(name: str) -> str:
    """A pairs file's or split's name without .gz and .jsonl: what an evaluation and a --ref are matched by."""
    name = Path(name).name
    return name.removesuffix(".gz").removesuffix(".jsonl")


def eval_settings(predictions: Path) -> dict:
    """The settings of the evaluation that wrote an eval output dir's predictions (its rouge.json); {} if unknown."""
    try:
        settings = json.loads((predictions.parent / "rouge.json").read_text()).get("settings", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return settings if isinstance(settings, dict) else {}


def decoded_from(settings: dict) -> str | None:
    """The split or pairs file an evaluation (its rouge.json settings) decoded, if known."""
    name = settings.get("pairs_file") or settings.get("split")
    return _stem(name) if isinstance(name, str) and name else None


def check_cuts(settings: dict[str, dict], paths: dict[str, Path], truncate: int) -> None:
    """Refuse systems that eval cut to eval.truncate_bytes unless both were cut alike and are compared at that
    cut: summaries cut short and scored as full-length F (or at another cut) would pass a difference of length
    off as one of quality."""
    cuts = {role: s.get("truncate_bytes") or 0 for role, s in settings.items() if "truncate_bytes" in s}
    if len(set(cuts.values())) > 1:
        raise CompareError(f"A {paths['A']} was decoded with eval.truncate_bytes={cuts['A']} but B {paths['B']} "
                           f"with {cuts['B']} (their rouge.json): compare systems decoded with the same "
                           f"eval.truncate_bytes, and give that as --truncate-bytes")
    cut = next(iter(cuts.values()), 0)
    if cut and cut != truncate:
        roles = " and ".join(f"{role} {paths[role]}" for role in cuts)
        raise CompareError(f"{roles} {'was' if len(cuts) == 1 else 'were'} decoded with eval.truncate_bytes={cut} "
                           f"(rouge.json), but --truncate-bytes is {truncate}: compare them with --truncate-bytes "
                           f"{cut} (recall of the first {cut} bytes, as eval scored them)")


def reference_name(ref: str) -> str:
    """--ref's split (DATA_DIR:SPLIT) or pairs file, named as `decoded_from` names it."""
    return _stem(ref if Path(ref).is_file() else ref.rsplit(":", 1)[-1])


def read_references(ref: str) -> tuple[str, list[list[str]]]:
    """References per pair from a pairs file (.jsonl[.gz]) or a prepared split `DATA_DIR:SPLIT`."""
    path = Path(ref)
    if path.is_file():
        pairs, where = read_pairs_file(path, need_source=False), str(path)  # references are all it reads
    elif path.is_dir():
        raise CompareError(f"references {ref} is a directory: give a pairs file (.jsonl[.gz]) or a prepared "
                           f"split as DATA_DIR:SPLIT, e.g. {ref.rstrip('/')}:test")
    elif ":" in ref and Path(ref.rsplit(":", 1)[0]).is_dir():
        data_dir, split = ref.rsplit(":", 1)
        pairs, where = read_pairs(data_dir, split), f"{data_dir}/{split}.jsonl"
    else:
        raise CompareError(f"references {ref} does not exist: give a pairs file (.jsonl[.gz] with source, "
                           f"target and optional references) or a prepared split as DATA_DIR:SPLIT")
    if not pairs:
        raise CompareError(f"references {where} hold no pairs")
    references = []
    for number, pair in enumerate(pairs, 1):
        refs = None
        if isinstance(pair, dict):
            refs = pair.get("references") or ([pair["target"]] if pair.get("target") is not None else None)
        if not refs:
            raise CompareError(f"references {where}, pair {number} has no 'target' (nor a 'references' list): "
                               f"comparing needs the reference summaries of every pair")
        references.append([str(r) for r in refs])
    return where, references


def permutation_means(diffs: np.ndarray, samples: int, rng: np.random.Generator) -> np.ndarray:
    """(samples, k) means of `diffs` (pairs, k) after swapping each pair's two systems with probability
    1/2, i.e. flipping the sign of that pair's difference (the same swaps for every metric)."""
    n, k = diffs.shape
    out = np.empty((samples, k))
    chunk = max(1, 2**20 // n)
    for start in range(0, samples, chunk):
        flips = rng.integers(0, 2, size=(min(chunk, samples - start), n), dtype=np.int8)  # (chunk, n)
        out[start:start + len(flips)] = (1.0 - 2.0 * flips) @ diffs / n  # (chunk, n) @ (n, k) -> (chunk, k)
    return out


def significance(scores_a: np.ndarray, scores_b: np.ndarray, samples: int, seed: int) -> dict:
    """Per metric: both means, d = B−A, its bootstrap 95% interval, b_wins and both two-sided p-values.
    Per-pair scores come in once; every resample and shuffle reuses them."""
    diffs = 100.0 * (scores_b - scores_a)  # (n, k) in ROUGE points
    observed = diffs.mean(axis=0)
    boot_rng, perm_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    boot = bootstrap_means(diffs, samples, boot_rng)
    perm = permutation_means(diffs, samples, perm_rng)
    # A tolerance keeps exact ties (e.g. identical systems, d = 0) from being lost to float rounding.
    tol = 1e-9
    boot_p = (1 + np.sum(np.abs(boot - observed) >= np.abs(observed) - tol, axis=0)) / (samples + 1)
    perm_p = (1 + np.sum(np.abs(perm) >= np.abs(observed) - tol, axis=0)) / (samples + 1)
    low, high = np.percentile(boot, [2.5, 97.5], axis=0)
    return {kind: {"a": 100.0 * float(scores_a[:, j].mean()), "b": 100.0 * float(scores_b[:, j].mean()),
                   "diff": float(observed[j]), "diff_ci": [float(low[j]), float(high[j])],
                   "b_wins": float(np.mean(boot[:, j] > 0)), "bootstrap_p": float(boot_p[j]),
                   "permutation_p": float(perm_p[j])}
            for j, kind in enumerate(ROUGE_TYPES)}


def compare(a: str, b: str, ref: str, out_dir: str | Path = ".", samples: int = 10_000, seed: int = 0,
            truncate: int = 0) -> dict:
    """Score A and B against REF, test B−A, write OUT/compare.json; returns the report. With `truncate` > 0
    both are cut to the whole words within that many bytes and ROUGE recall is compared (as eval does)."""
    if samples < 1:
        raise CompareError(f"--samples must be at least 1, got {samples} (10000 is the usual choice)")
    path_a, preds_a = read_predictions(a, "A")
    path_b, preds_b = read_predictions(b, "B")
    where, references = read_references(ref)
    if len(preds_a) != len(preds_b):
        raise CompareError(f"A {path_a} has {len(preds_a)} lines but B {path_b} has {len(preds_b)}: "
                           f"both must hold one summary per pair of the same references")
    if len(preds_a) != len(references):
        raise CompareError(f"A {path_a} and B {path_b} have {len(preds_a)} lines but references {where} hold "
                           f"{len(references)} pairs: compare predictions of the same split (eval.limit?)")
    named = reference_name(ref)
    paths = {"A": path_a, "B": path_b}
    settings = {role: eval_settings(path) for role, path in paths.items()}
    check_cuts(settings, paths, truncate)
    digest = references_sha256(references)
    for role, path in paths.items():
        source = decoded_from(settings[role])
        if settings[role].get("references_sha256") not in (None, digest):
            raise CompareError(f"{role} {path} was scored against other references than --ref {ref} holds (its "
                               f"rouge.json: {source or 'unknown'} in {settings[role].get('data_dir', 'a data dir')}"
                               f"): give as --ref the pairs it summarises")
        if "references_sha256" not in settings[role] and source is not None and source != named:
            print(f"warning: {role} {path} was decoded from {source} (its rouge.json), but --ref {ref} is {named}: "
                  f"its scores mean something only against the references it summarises", file=sys.stderr, flush=True)
    out = Path(out_dir) / OUTPUT
    if out.resolve() in {path_a.resolve(), path_b.resolve(), Path(where).resolve()}:
        raise CompareError(f"output {out} is one of the inputs; choose another --out")
    check_report_target(out, WRITER, "--out")
    measure = measure_for(truncate)
    cut = {name: [truncate_bytes(p, truncate, whole_words=True) for p in preds]
           for name, preds in (("A", preds_a), ("B", preds_b))}
    scores = [pair_scores(cut[name], references, measure, f"score {name}")[:, :, MEASURES.index(measure)]
              for name in ("A", "B")]
    metrics = significance(*scores, samples, seed)
    report = {
        "a": str(path_a), "b": str(path_b), "references": where, "pairs": len(references), "metrics": metrics,
        "settings": {"scorer": "rouge-score (Google) with Porter stemming, default tokenizer (lower-cased, "
                               "alphanumeric); averaged over pairs",
                     "measure": f"recall of the first {truncate} bytes" if truncate else "F-measure, full length",
                     "references": ("pooled, hits and counts summed (ROUGE-1.5.5's -f A)" if truncate
                                    else "best reference per metric (score_multi)"),
                     "unk": "UNK and <unk> scored as the same word",
                     "samples": samples, "seed": seed, **METHODS}}
    return write_report(out, report, WRITER, "--out")


def format_table(report: dict) -> str:
    """The console view of a compare report: one row per metric."""
    lines = [f"A: {report['a']}", f"B: {report['b']}",
             f"references: {report['references']} ({report['pairs']} pairs); "
             f"{report['settings']['samples']} resamples/shuffles, seed {report['settings']['seed']}",
             f"measure: ROUGE {report['settings']['measure']}", "",
             f"{'metric':<8} {'A':>6} {'B':>6} {'B-A':>7}  {'95% CI of B-A':<19} {'B wins':>6} "
             f"{'p boot':>7} {'p perm':>7}"]
    for kind, m in report["metrics"].items():
        ci = f"[{m['diff_ci'][0]:+.2f}, {m['diff_ci'][1]:+.2f}]"
        lines.append(f"{NAMES[kind]:<8} {m['a']:>6.2f} {m['b']:>6.2f} {m['diff']:>+7.2f}  {ci:<19} "
                     f"{100 * m['b_wins']:>5.1f}% {m['bootstrap_p']:>7.4f} {m['permutation_p']:>7.4f}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", metavar="A", help=f"system A: a {PREDICTIONS} or an eval output dir holding one")
    parser.add_argument("b", metavar="B", help="system B, the same way; differences are B - A")
    parser.add_argument("--ref", required=True, metavar="REF",
                        help="references: a pairs file (.jsonl[.gz]: source, target, optional references) "
                             "or a prepared split DATA_DIR:SPLIT")
    parser.add_argument("--out", default=".", metavar="DIR", help=f"where {OUTPUT} goes (default: .)")
    parser.add_argument("--samples", type=int, default=10_000, help="bootstrap resamples and shuffles (10000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of both tests (0)")
    parser.add_argument("--truncate-bytes", type=int, default=0, metavar="N",
                        help="cut both systems to N bytes and compare ROUGE recall (DUC: 75; default 0 = off)")


def cli(args: argparse.Namespace) -> int:
    if args.truncate_bytes < 0:
        raise CompareError(f"--truncate-bytes must be >= 0, got {args.truncate_bytes}")
    report = compare(args.a, args.b, args.ref, args.out, args.samples, args.seed, args.truncate_bytes)
    print(format_table(report))
    print(f"written to {Path(args.out) / OUTPUT}", file=sys.stderr)
    return 0
