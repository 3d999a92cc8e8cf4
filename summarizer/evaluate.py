"""Decode a split and score it: predictions.txt, rouge.json (ROUGE-1/2/L with 95% CIs, lead-N baselines); summarize."""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch
from rouge_score import rouge_scorer, scoring

from summarizer import checkpoint, runtime
from summarizer.config import Config
from summarizer.decoding import decode_all
from summarizer.errors import CheckpointError, DataError
from summarizer.outputs import atomic_write, claim_dir, refuse_overlap
from summarizer.placement import place_model
from summarizer.prepared import load_split, open_tokenizer, read_meta, read_pairs
from summarizer.runtime import Runtime

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")
_UNK = re.compile(r"(?<!\S)(?:UNK|<unk>)(?!\S)")


def unify_unk(text: str) -> str:
    """Gigaword writes the unknown word `<unk>` in train/valid and `UNK` in its test set: score them alike."""
    return _UNK.sub("unk", text)


def load_model(path: str | Path, rt: Runtime, meta: dict) -> tuple[torch.nn.Module, dict]:
    """The checkpoint's own model (its config, not the current one), placed, in eval mode; refused if
    `meta` (the data it will read) has another tokenizer."""
    try:
        state = checkpoint.load(path)
    except CheckpointError as exc:
        others = [p for p in checkpoint.step_checkpoints(Path(path).parent) if p != Path(path)]
        if not others:
            raise
        raise CheckpointError(f"{exc}. Checkpoints of the same run that could replace it: "
                              f"{', '.join(str(p) for p in others)}; use one with eval.checkpoint=PATH") from None
    checkpoint.check_tokenizer(state["data_meta"], meta, f"checkpoint {path}")
    model = place_model(checkpoint.restore_model(state), rt).eval()
    return model, {"path": str(path), "step": state["step"]}


def eval_checkpoint(cfg: Config) -> Path:
    """`eval.checkpoint`, or the run's best."""
    return Path(cfg.eval.checkpoint) if cfg.eval.checkpoint else cfg.run_dir / checkpoint.BEST


def rouge_report(predictions: list[str], references: list[list[str]], samples: int, seed: int = 0) -> dict:
    """Mean ROUGE F/P/R (percent) over pairs, best-of-references, with bootstrap 95% CIs of F
    (`samples` resamples; 0 = no interval)."""
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    per_pair = [scorer.score_multi([unify_unk(r) for r in refs], unify_unk(pred))
                for pred, refs in zip(predictions, references, strict=True)]
    bounds = None
    if samples > 0:
        np.random.seed(seed)  # BootstrapAggregator resamples with numpy's global RNG
        aggregator = scoring.BootstrapAggregator(confidence_interval=0.95, n_samples=samples)
        for score in per_pair:
            aggregator.add_scores(score)
        bounds = aggregator.aggregate()
    report = {}
    for kind in ROUGE_TYPES:
        report[kind] = {
            "f": 100 * float(np.mean([s[kind].fmeasure for s in per_pair])),
            "p": 100 * float(np.mean([s[kind].precision for s in per_pair])),
            "r": 100 * float(np.mean([s[kind].recall for s in per_pair])),
            "f_ci": [100 * bounds[kind].low.fmeasure, 100 * bounds[kind].high.fmeasure] if bounds else None}
    return report


def evaluate(cfg: Config) -> dict:
    """Decode `eval.split` with the run's best checkpoint (or eval.checkpoint); write predictions + report."""
    rt = runtime.setup(cfg)
    meta = read_meta(cfg.data.dir)
    if cfg.eval.split not in meta["splits"]:
        raise DataError(f"split '{cfg.eval.split}' was not prepared in {cfg.data.dir} (prepared: "
                        f"{', '.join(meta['splits'])}); map it in data.splits and re-run prep, or set eval.split")
    out_dir = Path(cfg.eval.out_dir) if cfg.eval.out_dir else cfg.run_dir
    refuse_overlap(out_dir, [cfg.data.dir], "eval.out_dir")
    claim_dir(out_dir, "eval", "eval.out_dir", legacy=("rouge.json",), also=("run", "overfit"))
    tokenizer = open_tokenizer(cfg.data.dir)
    model, source = load_model(eval_checkpoint(cfg), rt, meta)
    pairs = read_pairs(cfg.data.dir, cfg.eval.split)
    arrays = load_split(cfg.data.dir, cfg.eval.split)
    n = min(len(pairs), cfg.eval.limit) if cfg.eval.limit else len(pairs)
    sources = [arrays.src[arrays.src_offsets[i]:arrays.src_offsets[i + 1]][:cfg.data.max_source_len].tolist()
               for i in range(n)]
    started = time.perf_counter()
    hyps = decode_all(model, sources, cfg.eval, rt, f"decode {cfg.eval.split}")
    seconds = time.perf_counter() - started
    predictions = [tokenizer.decode(h) for h in hyps]
    references = [p.get("references") or [p["target"]] for p in pairs[:n]]
    report = rouge_report(predictions, references, cfg.eval.bootstrap_samples)
    report["lead"] = {f"lead-{k}": {kind: v["f"] for kind, v in rouge_report(
        [" ".join(p["source"].split()[:k]) for p in pairs[:n]], references, 0).items()}
        for k in cfg.eval.lead_baselines}
    report["settings"] = {
        "scorer": "rouge-score (Google) with Porter stemming, default tokenizer (lower-cased, alphanumeric)",
        "aggregation": "mean over pairs of per-pair F/P/R; best reference per metric; bootstrap 95% CI",
        "unk": "UNK and <unk> scored as the same word", "split": cfg.eval.split, "pairs": n,
        "beam_size": cfg.eval.beam_size, "max_len": cfg.eval.max_len, "min_len": cfg.eval.min_len,
        "length_penalty": cfg.eval.length_penalty, "no_repeat_ngram": cfg.eval.no_repeat_ngram,
        "checkpoint": source, "precision": rt.precision}
    report["sentences_per_s"] = n / seconds
    atomic_write(out_dir / "predictions.txt", "".join(p.replace("\n", " ") + "\n" for p in predictions))
    atomic_write(out_dir / "rouge.json", json.dumps(report, indent=2))
    lead = " ".join(f"{k} R1 {v['rouge1']:.1f}" for k, v in report["lead"].items())
    print(f"{cfg.eval.split} ({n} pairs, beam {cfg.eval.beam_size}): ROUGE-1/2/L F "
          f"{report['rouge1']['f']:.2f}/{report['rouge2']['f']:.2f}/{report['rougeL']['f']:.2f}; {lead}; "
          f"{report['sentences_per_s']:.0f} sentences/s; written to {out_dir}", file=sys.stderr)
    return report
