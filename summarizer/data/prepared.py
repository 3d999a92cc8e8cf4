"""Reads a prepared data dir: meta.json and memory-mapped token arrays."""
from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from summarizer.config.schema import DataConfig
from summarizer.errors import ConfigError, DataError
from summarizer.data.tokenizer import UNK_WORD, Tokenizer

FORMAT_VERSION = 1
META_FILE = "meta.json"
SPM_FILE = "spm.model"


def _prep_hint(data_dir: Path) -> str:
    return (f"prepare it with this command's config and overrides: make prep CONFIG=FILE ARGS=\"data.dir={data_dir} "
            f"...\" (python -m data_prep --config FILE data.dir={data_dir} ...)")


class SplitArrays(NamedTuple):
    """Flat token ids of all pairs; pair i's source is src[src_offsets[i]:src_offsets[i + 1]]."""
    src: np.ndarray
    src_offsets: np.ndarray
    tgt: np.ndarray
    tgt_offsets: np.ndarray


def split_files(split: str) -> dict[str, str]:
    """File names of one split, keyed by role; prep writes exactly these."""
    return {"src": f"{split}.src.npy", "src_offsets": f"{split}.src_offsets.npy",
            "tgt": f"{split}.tgt.npy", "tgt_offsets": f"{split}.tgt_offsets.npy",
            "pairs": f"{split}.jsonl"}


def check_data_settings(cfg: DataConfig, meta: dict, given: set[str] | None = None) -> None:
    """Refuse data.* values that contradict what the prepared dir was made with: normalisation and vocabulary
    are facts of the prepared data (meta.json), applied from there; a different value would be recorded as if
    it had been used, and silently not be. `given`, where a command applies the dir as prepared whatever its
    config file says (eval, summarize), limits the refusal to those keys (names under data, as
    config.load.overridden gives them): the ones its command line sets."""
    norm = meta.get("normalization", {})
    recorded = {"lowercase": norm.get("lowercase"), "mask_digits": norm.get("mask_digits"),
                "word_tokenizer": norm.get("words"), "source_tag": norm.get("source_tag", ""),
                "vocab_size": meta.get("requested_vocab_size")}
    wrong = [f"data.{k}={getattr(cfg, k)!r} (prepared with {v!r})" for k, v in recorded.items()
             if v is not None and getattr(cfg, k) != v and (given is None or k in given)]
    if not wrong:
        return
    fix = ("leave those keys off the command line (the prepared values apply) or give them the prepared values, "
           "point data.dir at data prepared with them, or prepare a new data.dir with them" if given is not None else
           "point data.dir at data prepared with this config, set those keys (in the config or an override) to the "
           "prepared values, or prepare a new data.dir with them")
    raise ConfigError(f"{'; '.join(wrong)} contradicts the prepared data in data.dir={cfg.dir}, which is applied "
                      f"as it was prepared: {fix}")


# Keys only prep reads (what it kept, how it trained the vocabulary): a run takes them from the data it reads
PREP_ONLY = ("valid_holdout", "max_source_words", "max_target_words", "spm_model_type", "spm_character_coverage",
             "spm_input_sentence_size")
# What meta.json's "settings" records: those, and the normalisation and vocabulary size (check_data_settings)
SHAPING_KEYS = ("lowercase", "mask_digits", "word_tokenizer", "vocab_size", *PREP_ONLY)


def differing_settings(cfg: DataConfig, meta: dict, keys: tuple = SHAPING_KEYS) -> list[tuple[str, object, object]]:
    """(key, as prepared, as `cfg` has it) for each of `keys` that differs from the prepared dir's meta.json
    "settings"; none for a dir prepared before meta.json kept them."""
    made = meta.get("settings", {})
    return [(key, made[key], getattr(cfg, key)) for key in keys if key in made and made[key] != getattr(cfg, key)]


def adopt_prep_settings(cfg: DataConfig, meta: dict) -> list[str]:
    """The PREP_ONLY keys set in `cfg` as the prepared dir was made with them, so a run's config records the data
    it read; returns "data.KEY config -> prepared" for each that differed."""
    changed = differing_settings(cfg, meta, PREP_ONLY)
    for key, made, _ in changed:
        setattr(cfg, key, made)
    return [f"data.{key} {now!r} -> {made!r}" for key, made, now in changed]


def valid_split(meta: dict, speed_only: bool = False) -> str:
    """The split validation reads: `valid`. Without one, training would validate on, and pick best.pt by, its
    own training pairs while calling them valid: refused, unless the caller only measures speed (the bench)."""
    if "valid" in meta["splits"]:
        return "valid"
    if speed_only:
        return "train"
    raise DataError(f"the prepared data has no valid split (prepared: {', '.join(meta['splits'])}), so validation "
                    f"and the choice of best.pt would measure the training pairs. Map one (data.splits.valid=[NAME], and "
                    f"data.splits.train without it) or hold pairs out of train (data.valid_holdout=500), then run "
                    f"prep again")


def read_meta(data_dir: str | Path) -> dict:
    data_dir = Path(data_dir)
    path = data_dir / META_FILE
    if not data_dir.is_dir():
        raise DataError(f"prepared data dir {data_dir} does not exist: {_prep_hint(data_dir)}")
    if not path.is_file():
        raise DataError(f"{data_dir} has no {META_FILE} (not prepared, or prep was interrupted): {_prep_hint(data_dir)}")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DataError(f"{path} is not valid JSON ({exc}): delete it and {_prep_hint(data_dir)}") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path} has format_version {meta.get('format_version')!r}, this code reads "
                        f"{FORMAT_VERSION}: delete {data_dir} and {_prep_hint(data_dir)}")
    return meta


def _check_split(data_dir: Path, split: str, meta: dict) -> None:
    if split not in meta["splits"]:
        raise DataError(f"split '{split}' was not prepared in {data_dir} (prepared: "
                        f"{', '.join(meta['splits']) or 'none'}): map it in data.splits and re-run prep")


def load_split(data_dir: str | Path, split: str) -> SplitArrays:
    """Memory-mapped (read-only) arrays: opening is instant and DataLoader workers share the pages."""
    data_dir = Path(data_dir)
    meta = read_meta(data_dir)
    _check_split(data_dir, split, meta)
    files = split_files(split)
    arrays = {}
    for role in ("src", "src_offsets", "tgt", "tgt_offsets"):
        path = data_dir / files[role]
        if not path.is_file():
            raise DataError(f"{path} is missing although meta.json lists split '{split}': "
                            f"delete {data_dir / META_FILE} and {_prep_hint(data_dir)}")
        arrays[role] = np.load(path, mmap_mode="r")
    return SplitArrays(**arrays)


def iter_pairs(data_dir: str | Path, split: str) -> Iterator[dict]:
    """The cleaned text pairs of a split ({"source", "target"[, "references", "tag"]}), in array order, one at a
    time: a full Gigaword train split is 3.8M pairs, gigabytes as a list of dicts."""
    data_dir = Path(data_dir)
    _check_split(data_dir, split, read_meta(data_dir))
    with open(data_dir / split_files(split)["pairs"], encoding="utf-8") as f:
        yield from map(json.loads, f)


def read_pairs(data_dir: str | Path, split: str, limit: int | None = None) -> list[dict]:
    """The first `limit` (all, if None) pairs of `iter_pairs`, as a list."""
    return list(itertools.islice(iter_pairs(data_dir, split), limit))


@functools.lru_cache(maxsize=4)
def training_words(data_dir: str | Path) -> frozenset[str]:
    """Every word of the prepared train split's text (sources and targets, as normalised): the vocabulary
    a summary's words are checked against (with its own source's)."""
    known: set[str] = set()
    for pair in iter_pairs(data_dir, "train"):
        known.update(pair["source"].lower().split())
        known.update(pair["target"].lower().split())
    return frozenset(known)


def open_tokenizer(data_dir: str | Path, meta: dict | None = None) -> Tokenizer:
    """The dir's tokenizer, checked against the sha256 that meta.json recorded (`meta`, if already read)."""
    data_dir = Path(data_dir)
    meta = meta or read_meta(data_dir)
    tokenizer = Tokenizer(data_dir / meta["spm_model"])
    if tokenizer.sha256 != meta["spm_sha256"]:
        raise DataError(f"{data_dir / meta['spm_model']} does not match the sha256 in meta.json "
                        f"(the model was replaced after prep): delete {data_dir} and {_prep_hint(data_dir)}")
    return tokenizer


def source_weights(cfg: DataConfig, meta: dict, count: int) -> np.ndarray | None:
    """Per train pair (the first `count`), how many times an epoch it is drawn on average: data.source_weights'
    value for its source tag, 1 for a tag it does not name; None when it names none."""
    if not cfg.source_weights:
        return None
    tags = meta["splits"]["train"].get("pairs_by_tag", {})
    unknown = sorted(set(cfg.source_weights) - set(tags))
    if unknown:
        named = ", ".join(t for t in sorted(tags) if t != "(untagged)") or "none"
        raise ConfigError(f"data.source_weights names {', '.join(map(str, unknown))}, not a source tag of the train "
                          f"split in {cfg.dir} (tags: {named}); tag a data.source entry (`tag: NAME`) and prepare "
                          f"again, or drop the name")
    bad = {k: v for k, v in cfg.source_weights.items()
           if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0}
    if bad:
        raise ConfigError(f"data.source_weights must map tags to finite numbers >= 0, got {bad}")
    weights = np.fromiter((float(cfg.source_weights.get(p.get("tag", ""), 1.0))
                           for p in itertools.islice(iter_pairs(cfg.dir, "train"), count)), dtype=np.float64)
    if not weights.any():
        raise ConfigError("data.source_weights weights every train pair 0: nothing would be drawn")
    return weights
