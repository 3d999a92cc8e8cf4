"""Scoring summaries: ROUGE per pair and with bootstrap intervals, byte truncation, and the quality rates
(non-words, repeated words, length) that ROUGE does not show."""
from __future__ import annotations

import hashlib
import json
import re
import sys
from collections import Counter

import numpy as np
from rouge_score import rouge_scorer, tokenizers
from tqdm import tqdm

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")
MEASURES = ("p", "r", "f")
_UNK = re.compile(r"(?<!\S)(?:UNK|<unk>)(?!\S)")
_CLOSING_PUNCTUATION = re.compile(r"[^\w#]+$")  # what a word's repeat key leaves out (summarizer/decode/constraints.py)


def pair_references(pairs: list[dict]) -> list[list[str]]:
    """Each pair's reference summaries: its `references` (DUC's four), else its `target`."""
    return [p.get("references") or [p["target"]] for p in pairs]


def references_sha256(references: list[list[str]]) -> str:
    """What scores were measured against, as one digest of each pair's references in order: eval's rouge.json
    records it, and compare and seeds check the references they are given or would score against it."""
    return hashlib.sha256(json.dumps(references, ensure_ascii=False).encode("utf-8")).hexdigest()


def unify_unk(text: str) -> str:
    """Gigaword writes the unknown word `<unk>` in train/valid and `UNK` in its test set: score them alike."""
    return _UNK.sub("unk", text)


def measure_for(truncate_bytes: int) -> str:
    """The ROUGE measure a report scores in: recall ("r") of summaries cut to `truncate_bytes` (DUC's), else F."""
    return "r" if truncate_bytes else "f"


def pair_scores(predictions: list[str], references: list[list[str]], measure: str = "f",
                desc: str = "") -> np.ndarray:
    """(pairs, 3 ROUGE types, 3 measures p/r/f) as fractions, over each pair's references.

    For F (`measure` "f"), each ROUGE type takes the best reference, the one with the highest F
    (rouge-score's score_multi), keeping its p, r and f together. For recall ("r", DUC's measure), the
    references are pooled as ROUGE-1.5.5 pools them by default (`-f A`, its computeNGramScore and
    computeLCSScore): recall is the hits summed over the references over their n-grams (ROUGE-L: tokens)
    summed, precision the hits summed over the summary's n-grams counted once per reference, F of those two.
    A summary is credited for what every reference has, not only the closest one, and a long reference
    weighs as much as its n-grams.
    """
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    words = tokenizers.DefaultTokenizer()  # the scorer's tokens (its stemmer maps one to one): for counting them
    pick = MEASURES.index(measure)
    out = np.zeros((len(predictions), len(ROUGE_TYPES), len(MEASURES)))
    pairs = zip(predictions, references, strict=True)
    for i, (pred, refs) in enumerate(tqdm(pairs, total=len(predictions), desc=desc, unit="pair", file=sys.stderr,
                                          disable=None if desc else True, mininterval=1.0, leave=False)):
        pred = unify_unk(pred)
        per_ref = np.array([[(s.precision, s.recall, s.fmeasure) for s in (scores[kind] for kind in ROUGE_TYPES)]
                            for scores in (scorer.score(unify_unk(ref), pred) for ref in refs)])  # (refs, 3, 3)
        if measure == "r":
            out[i] = pooled(per_ref, [len(words.tokenize(unify_unk(ref))) for ref in refs])
        else:
            best = per_ref[:, :, pick].argmax(axis=0)  # per type
            out[i] = per_ref[best, np.arange(len(ROUGE_TYPES))]
    return out


def pooled(per_ref: np.ndarray, lengths: list[int]) -> np.ndarray:
    """(3 ROUGE types, p/r/f) of one summary over its references as ROUGE-1.5.5 `-f A` pools them, from each
    reference's (refs, 3, 3) scores and its length in tokens: a reference's hits are its recall times its
    units (ROUGE-1: tokens, ROUGE-2: tokens - 1, ROUGE-L: tokens), and precision's units are the summary's,
    the same for every reference, so pooled precision is the references' mean."""
    units = np.array([[max(n - 1, 0) if kind == "rouge2" else n for kind in ROUGE_TYPES] for n in lengths], float)
    total = units.sum(axis=0)
    recall = np.divide((per_ref[:, :, 1] * units).sum(axis=0), total, out=np.zeros(len(ROUGE_TYPES)),
                       where=total > 0)
    precision = per_ref[:, :, 0].mean(axis=0)
    both = precision + recall
    f = np.divide(2 * precision * recall, both, out=np.zeros(len(ROUGE_TYPES)), where=both > 0)
    return np.stack([precision, recall, f], axis=1)


def bootstrap_means(values: np.ndarray, samples: int, rng: np.random.Generator) -> np.ndarray:
    """(samples, k) means of `values` (pairs, k) over resamples of the pairs drawn with replacement; the
    same drawn pairs serve every column (so a difference of two systems is a paired test)."""
    n, k = values.shape
    out = np.empty((samples, k))
    chunk = max(1, 2**20 // n)  # about 8 MiB of indices at a time
    for start in range(0, samples, chunk):
        idx = rng.integers(0, n, size=(min(chunk, samples - start), n))  # (chunk, n)
        for j in range(k):
            out[start:start + len(idx), j] = values[idx, j].mean(axis=1)
    return out


def rouge_report(predictions: list[str], references: list[list[str]], samples: int, seed: int = 0,
                 measure: str = "f") -> dict:
    """Mean ROUGE-1/2/L F, P and R (percent) over pairs (several references as `pair_scores` combines
    them for `measure`), with a bootstrap 95% interval of `measure` (`samples` resamples, seeded; 0 = no
    interval): {"rouge1": {"f", "p", "r", "f_ci"}, ...}, with `r_ci` too when recall is the measure."""
    scores = 100.0 * pair_scores(predictions, references, measure)  # (n, 3, 3)
    report = {kind: {m: float(scores[:, j, i].mean()) for i, m in enumerate(MEASURES)}
              for j, kind in enumerate(ROUGE_TYPES)}
    pick = MEASURES.index(measure)
    bounds = None
    if samples > 0 and len(predictions):
        means = bootstrap_means(scores[:, :, pick], samples, np.random.default_rng(seed))
        bounds = np.percentile(means, [2.5, 97.5], axis=0)  # (2, 3)
    for j, kind in enumerate(ROUGE_TYPES):
        interval = [float(bounds[0, j]), float(bounds[1, j])] if bounds is not None else None
        report[kind][f"{measure}_ci"] = interval
        report[kind].setdefault("f_ci", None)
    return report


def words(text: str) -> list[str]:
    """Whitespace words, lower-cased: how the quality rates count."""
    return text.lower().split()


def repeat_key(word: str) -> str:
    """A word without its closing punctuation (punctuation alone is a word as it is): what repeats are
    counted by."""
    return _CLOSING_PUNCTUATION.sub("", word) or word


def quality(predictions: list[str], sources: list[list[str]], references: list[list[str]],
            known: set[str]) -> dict:
    """What ROUGE does not show, over all predictions:

    - nonword_rate: share of predictions holding a word found neither in its source (`sources[i]`, the
      word lists a source may be written as) nor in `known` (the words of the training text);
    - repeat_rate: share of predictions in which some word occurs more than once, compared without the
      punctuation that closes it ("feb" and "feb." are one word, as the decoding rules count them);
    - words_per_prediction, and words_per_reference (the mean over each pair's references).
    """
    n = max(len(predictions), 1)
    nonword = repeated = 0
    for pred, source in zip(predictions, sources, strict=True):
        tokens, in_source = words(pred), {w for variant in source for w in variant}
        nonword += any(w not in known and w not in in_source for w in tokens)
        repeated += any(count > 1 for count in Counter(repeat_key(w) for w in tokens).values())
    ref_words = [np.mean([len(words(r)) for r in refs]) for refs in references if refs]
    return {"nonword_rate": 100.0 * nonword / n, "repeat_rate": 100.0 * repeated / n,
            "words_per_prediction": float(np.mean([len(words(p)) for p in predictions])) if predictions else 0.0,
            "words_per_reference": float(np.mean(ref_words)) if ref_words else 0.0}
