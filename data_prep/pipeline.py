"""The preparation pipeline: raw pairs -> cleaned -> SentencePiece -> memory-mappable token arrays + meta.json."""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from data_prep.clean import clean_split, hold_out
from data_prep.hub import is_hub
from data_prep.mix import sha256
from data_prep.sources import PRODUCT_SPLITS, input_files, load_splits
from data_prep.tokenize import encode_split, token_dtype, write_split
from data_prep.train_spm import train_spm
from summarizer.config.schema import DataConfig
from summarizer.data.prepared import FORMAT_VERSION, META_FILE, SHAPING_KEYS, SPM_FILE, split_files
from summarizer.data.tokenizer import BOS, EOS, PAD, UNK
from summarizer.errors import ConfigError, DataError
from summarizer.outputs import atomic_write, claim_dir, refuse_overlap

# Bump when cleaning or tokenization changes: `make prep` then refuses a dir of another version (naming it) until
# rebuilt, and `make train`/`make eval` use it with a note. A meta.json without it is version 1's.
PREP_VERSION = 1
CACHE_DIR = ".hf_cache"  # datasets' cache inside data.dir: nothing is written to the home directory
# Every data key that changes what prep writes; loader-only keys (batching, workers) are left out.
OUTPUT_KEYS = ("source", "source_field", "target_field", "references_field", "splits", "valid_holdout",
               "lowercase", "mask_digits", "word_tokenizer", "max_source_words", "max_target_words", "vocab_size",
               "spm_model_type", "spm_character_coverage", "spm_input_sentence_size")
# Below this many rows per process, starting worker processes costs more than it saves.
MIN_ROWS_PER_PROC = 20_000


def fingerprint(cfg: DataConfig) -> str:
    """sha256 over the inputs (paths, sizes, mtimes; or the hub name) and every output-affecting key."""
    payload = {"format_version": FORMAT_VERSION, "prep_version": PREP_VERSION, "data": _settings(cfg)}
    if not is_hub(cfg.source):
        payload["files"] = [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in input_files(cfg)]
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _settings(cfg: DataConfig) -> dict:
    """The data keys prep's output depends on, as meta.json gives them back (tuples as lists, paths as text)."""
    data = {key: getattr(cfg, key) for key in OUTPUT_KEYS}
    if cfg.source_tag:  # only when set, so dirs prepared before the key existed stay up to date
        data["source_tag"] = cfg.source_tag
    return json.loads(json.dumps(data, default=str))


def prepared_from(cfg: DataConfig, made: dict) -> dict:
    """The data keys and each input file (size, modification time, sha256) that prep's output depends on. A file's
    sha256 is taken from `made`, meta.json's record of an earlier prep, while its size and time are unchanged."""
    files = {}
    for path in [] if is_hub(cfg.source) else input_files(cfg):
        stat, name = path.stat(), str(path.resolve())
        stamp, old = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}, made.get("files", {}).get(name, {})
        same = all(old.get(key) == value for key, value in stamp.items())
        files[name] = {**stamp, "sha256": old["sha256"] if same else sha256(path)}
    return {"data": _settings(cfg), "files": files}


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _changes(meta: dict, cfg: DataConfig) -> list[str]:
    """What differs between what a prepared dir's meta.json was made from and what `cfg` asks for."""
    changed = [f"prep version {meta.get('prep_version', 1)} -> {PREP_VERSION}"] \
        if meta.get("prep_version", 1) != PREP_VERSION else []
    made, legacy = meta.get("prepared_from"), "prepared_from" not in meta
    if legacy:  # written before prepared_from: its fingerprint covers every key and file, its record fewer
        if meta.get("fingerprint") == fingerprint(cfg):
            return changed
        made = {"data": {**_settings(cfg), **meta.get("settings", {}), "source": meta.get("source")},
                "files": {str(Path(i["path"]).resolve()): i for i in meta.get("inputs", []) if "sha256" in i}}
    now = prepared_from(cfg, made)
    old_data, new_data = made["data"], now["data"]
    changed += [f"data.{key} {_shown(old_data.get(key))} -> {_shown(new_data.get(key))}"
                for key in sorted(old_data.keys() | new_data.keys()) if old_data.get(key) != new_data.get(key)]
    for name in sorted(made["files"].keys() | now["files"].keys()):
        old, new = made["files"].get(name), now["files"].get(name)
        if old is None and legacy:  # not recorded (a Rush title): the note below says so
            continue
        if old is None or new is None:
            changed.append(f"{name} {'is no longer' if new is None else 'is now'} an input")
        elif old["sha256"] != new["sha256"]:
            changed.append(f"{name} changed (another sha256)")
    if not changed and legacy:
        changed.append("its meta.json predates the record of each input and data key: the same recorded input "
                       "contents and keys, but other file times, a Rush title's contents, or another "
                       "data.source_field, target_field, references_field or splits")
    return changed


def prepared_changes(data_dir: Path, cfg: DataConfig) -> list[str] | None:
    """None when data_dir holds no prepared data (no readable meta.json); else what differs between what it was
    prepared from (inputs, data.* keys, PREP_VERSION) and what `cfg` asks for, each named: [] when up to date."""
    try:
        meta = json.loads((data_dir / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    needed = [SPM_FILE] + [f for split in meta.get("splits", {}) for f in split_files(split).values()]
    return [f"{name} is missing" for name in needed if not (data_dir / name).is_file()] + _changes(meta, cfg)


def worker_count(rows: int, num_proc: int) -> int | None:
    """Processes for a `Dataset.map` over `rows` rows; None means in-process."""
    procs = min(num_proc, rows // MIN_ROWS_PER_PROC)
    return procs if procs > 1 else None


def unpaired_tags(inputs: list[dict]) -> list[str]:
    """The tags of the unpaired (sentence-only) train files, as `load_splits` recorded them."""
    return sorted({info["tag"] for info in inputs if info.get("unpaired")})


def _load_and_clean(cfg: DataConfig, data_dir: Path) -> tuple[dict, dict, dict, int, list]:
    """(cleaned splits, raw pair counts, drops per split and rule, pairs held out of train as valid, inputs read)."""
    raw, ignored, inputs = load_splits(cfg, data_dir / CACHE_DIR)
    paired = {info.get("tag", "") for info in inputs if not info.get("unpaired")}
    shared = sorted(set(unpaired_tags(inputs)) & paired)
    if shared:
        raise ConfigError(f"data.source: tag(s) {', '.join(shared)} name both headline pairs and unpaired "
                          f"sentences: give the unpaired files a tag of their own (training noises every pair of it)")
    source_tags(raw, cfg.source_tag)  # a tag no entry has is named before the hold-out finds no pairs of it
    if ignored:
        print(f"note: source split(s) {', '.join(ignored)} are not mapped to train/valid/test and are ignored; "
              f"to use one, give data.splits whole, e.g. data.splits='{{train: [train], test: [{ignored[0]}]}}'",
              flush=True)
    cleaned, dropped = {}, {}
    for split, ds in raw.items():
        cleaned[split], dropped[split] = clean_split(ds, cfg, split, worker_count(len(ds), cfg.num_proc))
    if len(cleaned["train"]) == 0:
        raise DataError(f"cleaning dropped every train pair ({dropped['train']}): check data.max_source_words, "
                        f"data.max_target_words and data.source_field/target_field")
    held = 0
    if cfg.valid_holdout > 0 and "valid" in cleaned:
        print("note: data.valid_holdout is ignored because a valid split is mapped", flush=True)
    elif cfg.valid_holdout > 0:
        before = len(cleaned["train"])
        cleaned["train"], cleaned["valid"] = hold_out(cleaned["train"], cfg.valid_holdout,
                                                      tuple(unpaired_tags(inputs)), cfg.source_tag)
        held = len(cleaned["valid"])
        if copies := before - held - len(cleaned["train"]):  # a held-out source under another tag, or unpaired
            dropped["train"]["held-out source"] = copies
    for split in [s for s, ds in cleaned.items() if len(ds) == 0]:
        print(f"note: every {split} pair was dropped ({dropped[split]}); no {split} split is written", flush=True)
        del cleaned[split]
    raw_pairs = {split: len(ds) for split, ds in raw.items()}
    if held:  # the held-out valid split starts clean: raw == pairs, nothing dropped
        raw_pairs["valid"], dropped["valid"] = held, dict.fromkeys(dropped["train"], 0)
    ordered = {split: cleaned[split] for split in PRODUCT_SPLITS if split in cleaned}
    return ordered, raw_pairs, dropped, held, inputs


def source_tags(splits: dict, source_tag: str) -> list[str]:
    """The tags that get a piece (data.source_tag set): every split's, which must include data.source_tag."""
    if not source_tag:
        return []
    tags = sorted({t for ds in splits.values() for t in ds.unique("tag")} - {""})
    if source_tag not in tags:
        raise DataError(f"data.source_tag={source_tag!r} is not the tag of any data.source entry (tags: "
                        f"{', '.join(tags) or 'none'}): give one entry `tag: {source_tag}`, or set data.source_tag=''")
    return tags


def refuse_silent_rebuild(data_dir: Path, changed: list[str]) -> None:
    """A prepared dir whose inputs or settings changed is rebuilt only when asked (data.rebuild=true): the
    rebuild trains a new tokenizer, and runs trained on the old one could no longer be resumed or evaluated."""
    raise DataError(f"data.dir={data_dir} holds data prepared from other inputs or settings ({'; '.join(changed)}). "
                    f"Rebuilding it replaces its tokenizer, and runs trained on it could no longer resume or be "
                    f"evaluated. Give the data.* settings it was prepared from, prepare into a new data.dir, or "
                    f"pass data.rebuild=true to replace it")


def _clear_outputs(data_dir: Path) -> None:
    """Without meta.json the dir reads as unprepared, so a crash from here on is never mistaken for success."""
    (data_dir / META_FILE).unlink(missing_ok=True)
    for split in PRODUCT_SPLITS:
        for name in split_files(split).values():
            (data_dir / name).unlink(missing_ok=True)


def prepare(cfg: DataConfig) -> dict | None:
    """Prepare cfg.dir from cfg.source; returns the new meta, or None when it was already up to date."""
    start = time.perf_counter()
    data_dir = Path(cfg.dir)
    if not is_hub(cfg.source):
        refuse_overlap(data_dir, input_files(cfg) + ([cfg.source] if isinstance(cfg.source, str) else []), "data.dir")
    changed = prepared_changes(data_dir, cfg)
    if not cfg.rebuild and changed == []:  # asked to rebuild: inputs may change unseen (size, mtime)
        print(f"{data_dir} is up to date (same inputs and data settings): nothing to do", flush=True)
        return None
    # only a dir this product marked as its data dir is ever rebuilt: a meta.json beside a user's files proves nothing
    claim_dir(data_dir, "data", "data.dir")
    if changed and not cfg.rebuild:
        refuse_silent_rebuild(data_dir, changed)
    made, fp = prepared_from(cfg, {}), fingerprint(cfg)  # the inputs as they are before prep reads them
    cleaned, raw_pairs, dropped, held, inputs = _load_and_clean(cfg, data_dir)
    tags = source_tags(cleaned, cfg.source_tag)
    unpaired = unpaired_tags(inputs)
    spm_model, spm_info = train_spm(cleaned["train"], cfg, tags, mask=bool(unpaired))
    _clear_outputs(data_dir)  # only now: every failure a user can cause has happened by here
    atomic_write(data_dir / SPM_FILE, spm_model)
    dtype = token_dtype(spm_info["vocab_size"])
    stats = {}
    for split, pairs in cleaned.items():
        encoded = encode_split(pairs, data_dir / SPM_FILE, spm_info["sha256"], split,
                               worker_count(len(pairs), cfg.num_proc), cfg.source_tag)
        stats[split] = write_split(data_dir, split, pairs, encoded, dtype)
    meta = {
        "format_version": FORMAT_VERSION, "prep_version": PREP_VERSION, "vocab_size": spm_info["vocab_size"],
        "requested_vocab_size": spm_info["requested_vocab_size"],
        "special_ids": {"pad": PAD, "unk": UNK, "bos": BOS, "eos": EOS},
        "spm_model": SPM_FILE, "spm_sha256": spm_info["sha256"], "dtype": dtype.name,
        "normalization": {"lowercase": cfg.lowercase, "mask_digits": cfg.mask_digits, "words": cfg.word_tokenizer,
                          **({"source_tag": cfg.source_tag} if cfg.source_tag else {})},
        "source": cfg.source, "splits": stats, "raw_pairs": raw_pairs, "dropped": dropped,
        "held_out_as_valid": held, "inputs": inputs, "fingerprint": fp, "prepared_from": made,
        "settings": {key: getattr(cfg, key) for key in SHAPING_KEYS},
        **({"unpaired_tags": unpaired} if unpaired else {}),
        "seconds": round(time.perf_counter() - start, 2),
    }
    # Written last: its presence (with this fingerprint) is what marks the dir as prepared.
    atomic_write(data_dir / META_FILE, json.dumps(meta, indent=2) + "\n")
    print(summary_line(data_dir, meta), flush=True)
    return meta


def summary_line(data_dir: Path, meta: dict) -> str:
    names = [META_FILE, SPM_FILE] + [f for split in meta["splits"] for f in split_files(split).values()]
    size = sum((data_dir / name).stat().st_size for name in names)
    pairs = ", ".join(f"{split} {s['pairs']:,}" for split, s in meta["splits"].items())
    rules = {}
    for counts in meta["dropped"].values():
        for rule, n in counts.items():
            rules[rule] = rules.get(rule, 0) + n
    drops = ", ".join(f"{rule} {n:,}" for rule, n in rules.items() if n) or "none"
    return (f"prepared {data_dir}: pairs {pairs}; dropped {sum(rules.values()):,} ({drops}); "
            f"vocab {meta['vocab_size']:,}; {meta['seconds']:.1f}s; {size / 2**20:.1f} MiB")
