"""`eval`: decode a prepared split or any pairs file with a trained run; predictions.txt and rouge.json
(ROUGE-1/2/L with 95% intervals, quality rates, lead-N baselines)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from summarizer import checkpoint, runtime
from summarizer.config import Config
from summarizer.decoding import copied_unknowns, decode_all
from summarizer.errors import CheckpointError, ConfigError, DataError
from summarizer.outputs import claim_dir, refuse_overlap, write_together
from summarizer.pairs import read_pairs_file
from summarizer.placement import place_model
from summarizer.prepared import lexicon, load_split, open_tokenizer, read_meta, read_pairs, training_words
from summarizer.quantize import decoding_form, decoding_precision, resolve_quantize
from summarizer.readable import readable
from summarizer.runtime import Runtime
from summarizer.scoring import quality, rouge_report, truncate_bytes, words
from summarizer.tokenizer import Tokenizer, normalize, restore_digits


def load_model(path: str | Path, rt: Runtime, meta: dict, quantize: str = "none") -> tuple[torch.nn.Module, dict]:
    """The checkpoint's own model (its config, not the current one), placed, in eval mode, int8 if
    `quantize` (eval.quantize) says so, and (path, step, quantize as resolved); refused if `meta` (the data
    it will read) has another tokenizer."""
    try:
        state = checkpoint.require_model(checkpoint.load(path), path)
    except CheckpointError as exc:
        others = [p for p in checkpoint.step_checkpoints(Path(path).parent) if p != Path(path)]
        if not others:
            raise
        raise CheckpointError(f"{exc}. Checkpoints of the same run that could replace it: "
                              f"{', '.join(str(p) for p in others)}; use one with eval.checkpoint=PATH") from None
    checkpoint.check_tokenizer(state["data_meta"], meta, f"checkpoint {path}")
    quantize = resolve_quantize(quantize, rt)
    model = decoding_form(checkpoint.restore_model(state), rt, quantize)
    return place_model(model, rt).eval(), {"path": str(path), "step": state["step"], "quantize": quantize}


def check_beam(cfg: Config, meta: dict) -> None:
    """Beam search keeps the 2K best of the vocabulary at its first step: K can be at most half of it."""
    if 2 * cfg.eval.beam_size > meta["vocab_size"]:
        raise ConfigError(f"eval.beam_size={cfg.eval.beam_size} needs a vocabulary of at least "
                          f"{2 * cfg.eval.beam_size} pieces; this data's has {meta['vocab_size']}: lower "
                          f"eval.beam_size")


def eval_checkpoint(cfg: Config) -> Path:
    """`eval.checkpoint`, or the run's best."""
    return Path(cfg.eval.checkpoint) if cfg.eval.checkpoint else cfg.run_dir / checkpoint.BEST


def summary_text(ids: list[int], source: str, tokenizer: Tokenizer, meta: dict, limit: int,
                 copied: dict[int, int] | None = None) -> str:
    """A decoded summary as scorers see it (or, given `copied` from decoding.copied_unknowns, as readers do:
    each unknown piece written as the source characters it was copied from, and summarizer/readable.py):
    masked digits put back from its source, cut to the whole words that fit in `limit` bytes
    (eval.truncate_bytes; 0 = whole)."""
    norm = meta["normalization"]
    if copied is None:
        text = tokenizer.decode(ids)
    else:
        pieces = tokenizer.pieces_raw(source, norm)
        text = tokenizer.decode(ids, {t: pieces[s] for t, s in copied.items() if s < len(pieces)})
    if norm["mask_digits"]:
        text = restore_digits(text, source)
    if copied is not None:
        text = readable(text, source)
    return truncate_bytes(text.replace("\n", " "), limit, whole_words=True)


def read_eval_pairs(cfg: Config, meta: dict, tokenizer: Tokenizer) -> tuple[str, list[dict], list[list[int]]]:
    """(name, pairs, source ids) of what `eval` scores: `eval.pairs` (a pairs file of raw text, normalised and
    tokenized here as the run's training data was) or the prepared split `eval.split`."""
    e = cfg.eval
    if e.pairs:
        pairs = read_pairs_file(e.pairs)[:e.limit or None]
        ids = [tokenizer.encode_raw(p["source"], meta["normalization"])[:cfg.data.max_source_len] for p in pairs]
        return Path(e.pairs).name, pairs, ids
    if e.split not in meta["splits"]:
        raise DataError(f"split '{e.split}' was not prepared in {cfg.data.dir} (prepared: "
                        f"{', '.join(meta['splits'])}); map it in data.splits and re-run prep, set eval.split, "
                        f"or score a pairs file with eval.pairs=PATH")
    pairs = read_pairs(cfg.data.dir, e.split)[:e.limit or None]
    arrays = load_split(cfg.data.dir, e.split)
    ids = [arrays.src[arrays.src_offsets[i]:arrays.src_offsets[i + 1]][:cfg.data.max_source_len].tolist()
           for i in range(len(pairs))]
    return e.split, pairs, ids


def score(cfg: Config, meta: dict, pairs: list[dict], predictions: list[str]) -> dict:
    """ROUGE (F, or recall at eval.truncate_bytes as DUC reports it), the quality rates and lead-N."""
    e, norm = cfg.eval, meta["normalization"]
    measure = "r" if e.truncate_bytes else "f"
    references = [p.get("references") or [p["target"]] for p in pairs]
    report = rouge_report(predictions, references, e.bootstrap_samples, measure=measure)
    sources = [[words(normalize(p["source"], norm["lowercase"], norm["mask_digits"])), words(p["source"])]
               for p in pairs]
    report.update(quality(predictions, sources, references, training_words(cfg.data.dir)))
    report["lead"] = {f"lead-{k}": {kind: v[measure] for kind, v in rouge_report(
        [truncate_bytes(" ".join(p["source"].split()[:k]), e.truncate_bytes) for p in pairs], references, 0,
        measure=measure).items() if kind.startswith("rouge")} for k in e.lead_baselines}
    return report


def settings(cfg: Config, name: str, n: int, source: dict, precision: str) -> dict:
    e = cfg.eval
    references = ("mean over each pair's references (ROUGE-1.5.5's -f A)" if e.truncate_bytes
                  else "best reference per ROUGE type")
    return {
        "scorer": "rouge-score (Google) with Porter stemming, default tokenizer (lower-cased, alphanumeric)",
        "aggregation": f"mean over pairs; {references}; bootstrap 95% interval",
        "measure": f"recall of the first {e.truncate_bytes} bytes" if e.truncate_bytes else "F-measure, full length",
        "unk": "UNK and <unk> scored as the same word", "split": name, "pairs": n, "pairs_file": e.pairs or None,
        "beam_size": e.beam_size, "max_len": e.max_len, "min_len": e.min_len, "length_penalty": e.length_penalty,
        "no_repeat_ngram": e.no_repeat_ngram, "known_words": e.known_words, "no_repeat_words": e.no_repeat_words,
        "truncate_bytes": e.truncate_bytes, "quantize": source["quantize"],
        "checkpoint": {"path": source["path"], "step": source["step"]}, "precision": precision}


def evaluate(cfg: Config) -> dict:
    """Decode `eval.pairs` or `eval.split` with the run's best checkpoint (or eval.checkpoint); write
    predictions.txt (what was scored, one line per pair) and rouge.json to eval.out_dir."""
    begun = time.perf_counter()
    rt = runtime.setup(cfg, decoding_precision(cfg))
    meta = read_meta(cfg.data.dir)
    check_beam(cfg, meta)
    out_dir = Path(cfg.eval.out_dir) if cfg.eval.out_dir else cfg.run_dir
    refuse_overlap(out_dir, [cfg.data.dir] + ([cfg.eval.pairs] if cfg.eval.pairs else []), "eval.out_dir")
    tokenizer = open_tokenizer(cfg.data.dir)
    name, pairs, ids = read_eval_pairs(cfg, meta, tokenizer)
    model, source = load_model(eval_checkpoint(cfg), rt, meta, cfg.eval.quantize)
    claim_dir(out_dir, "eval", "eval.out_dir", legacy=("rouge.json",), also=("run", "overfit"))
    rules_lexicon = lexicon(cfg.data.dir)  # start-up, like loading the model: outside the decoding time
    started = time.perf_counter()
    hyps = decode_all(model, ids, cfg.eval, rt, f"decode {name}", rules_lexicon)
    seconds = time.perf_counter() - started
    predictions = [summary_text(h, p["source"], tokenizer, meta, cfg.eval.truncate_bytes)
                   for h, p in zip(hyps, pairs, strict=True)]
    for_people = [summary_text(h, p["source"], tokenizer, meta, cfg.eval.truncate_bytes, copied)
                  for h, p, copied in zip(hyps, pairs, copied_unknowns(model, ids, hyps, rt), strict=True)]
    report = score(cfg, meta, pairs, predictions)
    report["settings"] = settings(cfg, name, len(pairs), source, rt.precision)
    report["sentences_per_s"] = len(pairs) / seconds  # decoding alone, as other toolkits time it
    report["startup_s"] = started - begun  # reading data and the checkpoint, quantizing, the word rules' lexicon
    # rouge.json names the predictions it scored: all three are written in full before any is replaced
    write_together(out_dir, {"predictions.readable.txt": "".join(p + "\n" for p in for_people),
                             "predictions.txt": "".join(p + "\n" for p in predictions),
                             "rouge.json": json.dumps(report, indent=2)}, last="rouge.json")
    print(summary_line(report, out_dir), file=sys.stderr)
    return report


def summary_line(report: dict, out_dir: Path) -> str:
    s = report["settings"]
    measure = f"recall at {s['truncate_bytes']} bytes" if s["truncate_bytes"] else "F"
    m = "r" if s["truncate_bytes"] else "f"
    lead = " ".join(f"{k} R1 {v['rouge1']:.1f}" for k, v in report["lead"].items())
    return (f"{s['split']} ({s['pairs']} pairs, beam {s['beam_size']}): ROUGE-1/2/L {measure} "
            f"{report['rouge1'][m]:.2f}/{report['rouge2'][m]:.2f}/{report['rougeL'][m]:.2f}; "
            f"non-words {report['nonword_rate']:.1f}%, repeats {report['repeat_rate']:.1f}%, "
            f"{report['words_per_prediction']:.1f} words per summary (references "
            f"{report['words_per_reference']:.1f}); {lead}; {report['sentences_per_s']:.0f} sentences/s; "
            f"written to {out_dir}")
