"""Cleaning of raw pairs: normalisation, drop rules counted per rule, dedup, and the deterministic valid hold-out."""
from __future__ import annotations

import hashlib
import re

import numpy as np
from datasets import Dataset

from summarizer.config.schema import DataConfig
from summarizer.data.tokenizer import normalize
from summarizer.errors import ConfigError

# Each dropped pair is counted under the first rule it breaks, so pairs + sum(dropped) == raw pairs.
RULES = ("bad_chars", "empty", "source_too_long", "target_too_long", "duplicate")
# C0/C1 control characters (tab, newline, CR are whitespace and just collapse), lone surrogates
# and U+FFFD, which is what an undecodable byte becomes.
_BAD_CHARS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff\ufffd]")


def hash64(text: str) -> int:
    """Stable across processes and Python versions, unlike hash()."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                          "little", signed=True)


def _drop_rule(raw_src: str, raw_tgt: str, src: str, tgt: str, max_src: int, max_tgt: int) -> str:
    if _BAD_CHARS.search(raw_src) or _BAD_CHARS.search(raw_tgt):
        return "bad_chars"
    if not src or not tgt:
        return "empty"
    if src.count(" ") + 1 > max_src:  # normalised text has single spaces, so words = spaces + 1
        return "source_too_long"
    if tgt.count(" ") + 1 > max_tgt:
        return "target_too_long"
    return ""


def _clean_batch(batch: dict, lowercase: bool, mask_digits: bool, words: str, max_src: int, max_tgt: int) -> dict:
    out = {"source": [], "target": [], "references": [], "drop": [], "pair_hash": [], "source_hash": []}
    for raw_src, raw_tgt, refs in zip(batch["source"], batch["target"], batch["references"], strict=True):
        raw_src, raw_tgt = raw_src or "", raw_tgt or ""  # CSV gives None for an empty cell
        src = normalize(raw_src, lowercase, mask_digits, words)
        tgt = normalize(raw_tgt, lowercase, mask_digits, words)
        out["source"].append(src)
        out["target"].append(tgt)
        out["references"].append([normalize(r or "", lowercase, mask_digits, words) for r in refs or []])
        out["drop"].append(_drop_rule(raw_src, raw_tgt, src, tgt, max_src, max_tgt))
        out["pair_hash"].append(hash64(src + "\n" + tgt))  # normalised text holds no newline
        out["source_hash"].append(hash64(src))
    return out


def clean_split(ds: Dataset, cfg: DataConfig, name: str, num_proc: int | None) -> tuple[Dataset, dict]:
    """Cleaned pairs in input order (columns source, target, references, source_hash) and drops per rule."""
    kwargs = dict(lowercase=cfg.lowercase, mask_digits=cfg.mask_digits, words=cfg.word_tokenizer,
                  max_src=cfg.max_source_words, max_tgt=cfg.max_target_words)
    # keep_in_memory: derived tables are cheap to rebuild; caching them would grow .hf_cache on every run.
    ds = ds.map(_clean_batch, batched=True, fn_kwargs=kwargs, num_proc=num_proc, keep_in_memory=True,
                desc=f"Cleaning {name}")
    columns = ds.with_format("numpy", columns=["drop", "pair_hash"])[:]
    drop, pair_hash = columns["drop"], columns["pair_hash"]
    dropped = {str(rule): int(n) for rule, n in zip(*np.unique(drop, return_counts=True), strict=True) if rule}
    kept = np.flatnonzero(drop == "")
    # First occurrence of each exact (source, target) pair wins, so the output keeps input order.
    # Pairs are compared by 64-bit hash: a false duplicate needs a collision (~1e-7 at 4M pairs).
    _, first = np.unique(pair_hash[kept], return_index=True)
    unique = np.sort(kept[first])
    dropped["duplicate"] = len(kept) - len(unique)
    ds = ds.select(unique).remove_columns(["drop", "pair_hash"]).flatten_indices(keep_in_memory=True)
    return ds, {rule: dropped.get(rule, 0) for rule in RULES}


def hold_out(train: Dataset, n: int, unpaired_tags: tuple = (), only_tag: str = "") -> tuple[Dataset, Dataset]:
    """(train, valid): the n pairs with the smallest source hash, independent of any seed; never a sentence of an
    unpaired source (`unpaired_tags`), which has no headline to score; with `only_tag` (data.source_tag), pairs of
    that tag only.

    Pairs sharing a source share its hash, so the whole group at the boundary goes to valid:
    valid may hold slightly more than n pairs but never shares a source with train. A held-out source's pairs
    of another tag, or unpaired, leave train too (neither split keeps them).
    """
    hashes = np.asarray(train.with_format("numpy", columns=["source_hash"])[:]["source_hash"])
    order = np.lexsort((np.arange(len(hashes)), hashes))
    if unpaired_tags or only_tag:
        tags = np.asarray(train.with_format("numpy", columns=["tag"])[:]["tag"])
        order = order[~np.isin(tags[order], list(unpaired_tags))]
        order = order[tags[order] == only_tag] if only_tag else order
    cut = n
    while cut < len(order) and hashes[order[cut]] == hashes[order[n - 1]]:
        cut += 1
    if cut >= len(order):
        raise ConfigError(f"data.valid_holdout={n} would leave no train pairs (train has {len(order)} after "
                          f"cleaning): lower it, or map a valid split in data.splits")
    held = np.zeros(len(hashes), dtype=bool)
    held[order[:cut]] = True
    kept = ~np.isin(hashes, hashes[held])  # the held-out sources' pairs under every tag
    return (train.select(np.flatnonzero(kept)).flatten_indices(keep_in_memory=True),
            train.select(np.flatnonzero(held)).flatten_indices(keep_in_memory=True))
