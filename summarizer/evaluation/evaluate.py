"""`eval`: decode a prepared split or any pairs file with a trained run; predictions.txt and rouge.json
(ROUGE-1/2/L with 95% intervals, quality rates, lead-N baselines)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from summarizer import runtime
from summarizer.config.schema import Config
from summarizer.data.prepared import open_tokenizer, read_meta, training_words
from summarizer.data.tokenizer import normalize_as
from summarizer.decode.inference import (
    check_beam,
    copied_numbers,
    eval_checkpoint,
    load_model,
    read_eval_pairs,
    summary_text,
    truncate_bytes,
)
from summarizer.decode.lexicon import lexicon
from summarizer.decode.quantize import decoding_precision
from summarizer.decode.search import copied_unknowns, decode_all, decode_batch_tokens, static_shapes
from summarizer.evaluation.scoring import (
    measure_for,
    pair_references,
    quality,
    references_sha256,
    rouge_report,
    words,
)
from summarizer.outputs import claim_dir, code_version, refuse_overlap, write_together


def score(cfg: Config, meta: dict, pairs: list[dict], predictions: list[str]) -> dict:
    """ROUGE (F, or recall at eval.truncate_bytes as DUC reports it), the quality rates and lead-N."""
    e, norm = cfg.eval, meta["normalization"]
    measure = measure_for(e.truncate_bytes)
    references = pair_references(pairs)
    report = rouge_report(predictions, references, e.bootstrap_samples, measure=measure)
    sources = [[words(normalize_as(p["source"], norm)), words(p["source"])]
               for p in pairs]
    report.update(quality(predictions, sources, references, training_words(cfg.data.dir)))

    def lead(k: int) -> dict:  # the first k source words, cut as the summaries are (whole words within the bytes)
        cut = [truncate_bytes(" ".join(p["source"].split()[:k]), e.truncate_bytes, whole_words=True) for p in pairs]
        scores = rouge_report(cut, references, 0, measure=measure)
        return {kind: v[measure] for kind, v in scores.items() if kind.startswith("rouge")}
    report["lead"] = {f"lead-{k}": lead(k) for k in e.lead_baselines}
    return report


def settings(cfg: Config, name: str, pairs: list[dict], source: dict, precision: str) -> dict:
    """What a rouge.json's scores mean and what produced them: the scoring, the pairs and their references'
    digest, the decoding settings, the checkpoint, the data dir and the code's commit."""
    e = cfg.eval
    references = ("each pair's references pooled, hits and counts summed (ROUGE-1.5.5's -f A)" if e.truncate_bytes
                  else "best reference per ROUGE type")
    return {
        "scorer": "rouge-score (Google) with Porter stemming, default tokenizer (lower-cased, alphanumeric)",
        "aggregation": f"mean over pairs; {references}; bootstrap 95% interval",
        "measure": f"recall of the first {e.truncate_bytes} bytes" if e.truncate_bytes else "F-measure, full length",
        "unk": "UNK and <unk> scored as the same word", "split": name, "pairs": len(pairs),
        "pairs_file": e.pairs or None, "data_dir": str(cfg.data.dir),
        "references_sha256": references_sha256(pair_references(pairs)),
        "beam_size": e.beam_size, "max_len": e.max_len, "min_len": e.min_len, "length_penalty": e.length_penalty,
        "bootstrap_samples": e.bootstrap_samples,
        "no_repeat_ngram": e.no_repeat_ngram, "known_words": e.known_words, "no_repeat_words": e.no_repeat_words,
        "truncate_bytes": e.truncate_bytes, "quantize": source["quantize"],
        "checkpoint": {"path": source["path"], "step": source["step"]}, "precision": precision, **code_version()}


def evaluate(cfg: Config) -> dict:
    """Decode `eval.pairs` or `eval.split` with the run's best checkpoint (or eval.checkpoint); write
    predictions.txt (what was scored, one line per pair) and rouge.json to eval.out_dir."""
    begun = time.perf_counter()
    rt = runtime.setup(cfg.system, cfg.placement, decoding_precision(cfg))
    meta = read_meta(cfg.data.dir)
    check_beam(cfg, meta)
    out_dir = Path(cfg.eval.out_dir) if cfg.eval.out_dir else cfg.run_dir
    refuse_overlap(out_dir, [cfg.data.dir] + ([cfg.eval.pairs] if cfg.eval.pairs else []), "eval.out_dir")
    tokenizer = open_tokenizer(cfg.data.dir, meta)
    name, pairs, ids = read_eval_pairs(cfg, meta, tokenizer)
    ckpt = eval_checkpoint(cfg)
    model, source = load_model(ckpt, rt, meta, cfg.eval.quantize, cfg)
    # a run's dir holds the eval of its own weights only: another run's predictions and rouge.json stay its own
    own_run = ckpt.resolve().parent == out_dir.resolve()
    claim_dir(out_dir, "eval", "eval.out_dir", also=("run", "overfit") if own_run else (),
              note=f"an eval writes into a run's dir only when it evaluates that run's checkpoint, not {ckpt}")
    rules_lexicon = lexicon(cfg.data.dir)  # start-up, like loading the model: outside the decoding time
    warm_up(model, ids, cfg, rt, rules_lexicon)
    started = time.perf_counter()
    hyps = decode_all(model, ids, cfg.eval, rt, f"decode {name}", rules_lexicon)
    seconds = time.perf_counter() - started
    numbers = copied_numbers(model, ids, hyps, [p["source"] for p in pairs], tokenizer, meta, rt)
    predictions = [summary_text(h, p["source"], tokenizer, meta, cfg.eval.truncate_bytes, numbers=n)
                   for h, p, n in zip(hyps, pairs, numbers, strict=True)]
    for_people = [summary_text(h, p["source"], tokenizer, meta, cfg.eval.truncate_bytes, copied, n)
                  for h, p, copied, n in zip(hyps, pairs, copied_unknowns(model, ids, hyps, rt), numbers, strict=True)]
    report = score(cfg, meta, pairs, predictions)
    report["settings"] = settings(cfg, name, pairs, source, rt.precision)
    report["settings"].update(batch_tokens=decode_batch_tokens(cfg.eval, rt),
                              shapes="static" if static_shapes(cfg.eval, rt) else "dynamic")
    report["sentences_per_s"] = len(pairs) / seconds  # decoding alone, as other toolkits time it
    report["startup_s"] = started - begun  # data, checkpoint, quantizing, the word rules' lexicon, a GPU's warm-up
    # rouge.json names the predictions it scored: all three are written in full before any is replaced
    write_together(out_dir, {"predictions.readable.txt": "".join(p + "\n" for p in for_people),
                             "predictions.txt": "".join(p + "\n" for p in predictions),
                             "rouge.json": json.dumps(report, indent=2)}, last="rouge.json")
    print(summary_line(report, out_dir), file=sys.stderr)
    return report


def warm_up(model, ids: list, cfg: Config, rt: runtime.Runtime, rules_lexicon) -> None:
    """On a GPU, decode a few sentences before the clock starts: a process's first decode there pays one-off costs
    (cuBLAS handles, kernel modules loaded on first use: a large share of a decode of 2,000 sentences) that are
    start-up, as loading the model is. A CPU's first-call costs are small; nothing runs there."""
    if "cuda" in (rt.device.type, rt.decoder_device.type):
        decode_all(model, ids[:8], cfg.eval, rt, lexicon=rules_lexicon)


def summary_line(report: dict, out_dir: Path) -> str:
    s = report["settings"]
    measure = f"recall at {s['truncate_bytes']} bytes" if s["truncate_bytes"] else "F"
    m = measure_for(s["truncate_bytes"])
    lead = " ".join(f"{k} R1 {v['rouge1']:.1f}" for k, v in report["lead"].items())
    return (f"{s['split']} ({s['pairs']} pairs, beam {s['beam_size']}): ROUGE-1/2/L {measure} "
            f"{report['rouge1'][m]:.2f}/{report['rouge2'][m]:.2f}/{report['rougeL'][m]:.2f}; "
            f"non-words {report['nonword_rate']:.1f}%, repeats {report['repeat_rate']:.1f}%, "
            f"{report['words_per_prediction']:.1f} words per summary (references "
            f"{report['words_per_reference']:.1f}); {lead}; {report['sentences_per_s']:.0f} sentences/s; "
            f"written to {out_dir}")
