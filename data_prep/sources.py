"""Raw pairs from a hub dataset, a directory of split files or a {split: [files]} mapping, via `datasets` builders."""
from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import pyarrow.compute as pc
from datasets import Dataset, Value

from data_prep.files import FEATURES, load_builder, load_rush, rush_title, undecodable_lines
from data_prep.hub import is_hub, load_hub
from data_prep.mix import FileSpec, apply_cleaning, apply_filter, parse_entry, sha256, under
from summarizer.config.schema import DataConfig
from summarizer.data.pairs import numbered_lines, parse_record
from summarizer.errors import ConfigError, DataError

PRODUCT_SPLITS = ("train", "valid", "test")
_SUFFIXES = (".jsonl.gz", ".jsonl", ".csv", ".article.txt", ".title.txt")



def _split_name(path: Path) -> tuple[str, str] | None:
    """(NAME, suffix) for a recognised split file, else None."""
    for suffix in _SUFFIXES:
        if path.name.endswith(suffix) and len(path.name) > len(suffix):
            return path.name[: -len(suffix)], suffix
    return None


def _scan_directory(root: Path) -> dict[str, list[FileSpec]]:
    """Source split name -> its files (one data file, or a Rush article/title pair)."""
    found: dict[str, dict[str, Path]] = {}
    unread = []
    for path in sorted(root.iterdir()):
        named = _split_name(path) if path.is_file() else None
        if named:
            found.setdefault(named[0], {})[named[1]] = path
        elif path.is_file() and re.search(r"\.(jsonl?|csv|tsv|parquet)(\.\w+)?$|\.(article|title)\.txt\.\w+$",
                                           path.name):
            unread.append(path.name)  # data by its name, in no format read here: a split the user may miss
    if unread:
        print(f"note: {root}: {', '.join(unread)} not read (split files are NAME.jsonl, NAME.jsonl.gz, NAME.csv, "
              f"or NAME.article.txt + NAME.title.txt)", flush=True)
    splits = {}
    for name, by_suffix in found.items():
        rush = {s: by_suffix.pop(s) for s in (".article.txt", ".title.txt") if s in by_suffix}
        if len(rush) == 1:
            have, = rush.values()
            want = root / (name + (".title.txt" if have.name.endswith(".article.txt") else ".article.txt"))
            raise DataError(f"{have} has no partner file {want}: Rush-style splits need both "
                            f"NAME.article.txt and NAME.title.txt")
        if len(by_suffix) + bool(rush) > 1:
            names = [p.name for p in by_suffix.values()] + [p.name for p in rush.values()]
            raise DataError(f"split '{name}' in {root} is given by several files ({', '.join(names)}): "
                            f"keep one format per split name")
        splits[name] = [FileSpec(p) for p in ([rush[".article.txt"]] if rush else by_suffix.values())]
    if not splits:
        raise DataError(f"{root} holds no split files: expected NAME.jsonl, NAME.jsonl.gz, NAME.csv, "
                        f"or NAME.article.txt + NAME.title.txt")
    return splits


def _mapping_files(source: dict, root: str) -> dict[str, list[FileSpec]]:
    splits = {}
    for split, entries in source.items():
        if split not in PRODUCT_SPLITS:
            raise ConfigError(f"data.source maps unknown split '{split}': use {', '.join(PRODUCT_SPLITS)}")
        entries = [entries] if isinstance(entries, (str, dict)) else entries
        if not isinstance(entries, list) or not entries:
            raise ConfigError(f"data.source's split '{split}' lists {entries!r}: give a file, an entry "
                              f"({{path: FILE, ...}}) or a non-empty list of them (leave a split out to have none)")
        specs = [parse_entry(e, split, root) for e in entries]
        for spec in specs:
            path = spec.path
            if not path.is_file():
                raise DataError(f"data.source lists {path} for split '{split}', but it does not exist: fix the path")
            if _split_name(path) is None or path.name.endswith(".title.txt"):
                raise DataError(f"{path} has an unknown format: list .jsonl, .jsonl.gz, .csv, or the "
                                f"NAME.article.txt of a Rush pair (its NAME.title.txt is read alongside)")
        splits[split] = specs
    listed: dict[Path, tuple[str, tuple]] = {}
    for split, specs in splits.items():
        for spec in specs:
            other, wanted = listed.setdefault(spec.path.resolve(), (split, spec.filter))
            # both filtered, and differently: one file may hold several splits, told apart by a field
            if other != split and not (wanted and spec.filter and wanted != spec.filter):
                raise ConfigError(f"data.source lists {spec.path} under both {other} and {split}: its pairs would be "
                                  f"in both; list it under one (or tell its records apart with a 'filter' in each)")
    return splits


def local_files(source, root: str = "") -> dict[str, list[FileSpec]]:
    """Split name -> input files (and how to read each) for a directory or a mapping source (not the hub);
    relative paths are read from `root` (data.root) where it is set."""
    if root and not Path(root).is_dir():
        raise DataError(f"data.root={root} is not a directory: set data.root=DIR, the directory that data.source's "
                        f"relative paths are read from (for configs/two_stage.yaml, the one holding gigaword/ and "
                        f"news_extra/)")
    if isinstance(source, dict):
        return _mapping_files(source, root)
    if not isinstance(source, str) or not source:
        raise ConfigError("data.source is empty: set it to hf:NAME[:SUBSET], a directory, "
                          "or (in YAML) a mapping {train: [files], ...}")
    root = under(root, source)
    if root.is_file():
        raise DataError(f"data.source={root} is a file; give the directory that holds it (its name, e.g. "
                        f"train.jsonl, names the split), or in YAML a mapping {{train: [{root}]}}")
    if not root.is_dir():
        raise DataError(f"data.source directory {root} does not exist: fix the path, or use hf:NAME for a hub dataset")
    return _scan_directory(root)


def split_mapping(cfg: DataConfig, available: list[str]) -> dict[str, list[str]]:
    """Product split -> the available source split names mapped to it (empty product splits left out)."""
    if isinstance(cfg.source, dict):
        return {split: [split] for split in available}
    unknown = set(cfg.splits) - set(PRODUCT_SPLITS)
    if unknown:
        raise ConfigError(f"data.splits has unknown product split(s) {sorted(unknown)}: "
                          f"use {', '.join(PRODUCT_SPLITS)}")
    mapping = {}
    for product, names in cfg.splits.items():
        if names is None or not isinstance(names, (str, list)):
            raise ConfigError(f"data.splits.{product} is {names!r}: give a source split name or a list of them "
                              f"([] for none)")
        names = [names] if isinstance(names, str) else list(names)
        present = [n for n in names if n in available]
        if present:
            mapping[product] = present
    owners: dict[str, str] = {}
    for product, names in mapping.items():
        for name in names:
            if name in owners:  # trained on and measured with, or scored on what it learned
                raise ConfigError(f"data.splits maps source split '{name}' to both {owners[name]} and {product}: its "
                                  f"pairs would be in both; map it to one, e.g. data.splits.train=[train] "
                                  f"data.splits.{product}=[{name}] (the recipe's train takes [train, valid])")
            owners[name] = product
    if "train" not in mapping:
        raise DataError(f"no train split in {cfg.source!r}: data.splits.train={cfg.splits.get('train')} but the "
                        f"source has {sorted(available)}; name a train file or map one, e.g. "
                        f"data.splits.train=[{sorted(available)[0] if available else 'NAME'}]")
    return mapping


# Other names the default fields go by (the hub's Gigaword: document/summary; CNN/DM: article). Only the
# defaults fall back to them: a field named explicitly must exist.
FIELD_ALIASES = {"source": ("document", "article"), "target": ("summary", "headline", "title")}


def _field(ds: Dataset, name: str, key: str, origin: str) -> str:
    """The column holding data.`key` (`name`, or, for the default name, its first alias present)."""
    found = [c for c in (name, *FIELD_ALIASES.get(name, ())) if c in ds.column_names]
    if not found:
        raise DataError(f"{origin} has no field '{name}' (it has {ds.column_names}): set data.{key} to the right "
                        f"name")
    return found[0]


def _refuse_non_text(ds: Dataset, fields: list[str], origin: str) -> None:
    """A source or target that is not text (a list, a number) is refused, at its line in a JSON Lines `origin`:
    cast to text, a list became its JSON and a number its digits, and one number among texts made datasets read
    the whole column as JSON, every text in quotes."""
    for field in fields:
        if ds.features[field] in (Value("string"), Value("large_string"), Value("null")):
            continue
        where, value = origin, f"{ds.features[field]} values"
        if origin.endswith((".jsonl", ".jsonl.gz")):
            records = ((n, parse_record(raw)) for n, raw in numbered_lines(origin) if raw.strip())
            where, value = next(((f"{origin}:{n}", json.dumps(r[field])[:80]) for n, r in records if
                                 isinstance(r, dict) and not isinstance(r.get(field, ""), (str, type(None)))),
                                (where, value))
        raise DataError(f"{where}: field '{field}' holds {value}, not text: fix or remove that line, or set "
                        f"data.source_field/target_field to the fields that hold the texts")


def _standardize(ds: Dataset, cfg: DataConfig, origin: str) -> Dataset:
    """Rename the configured fields to source/target/references and cast to FEATURES."""
    source_field = _field(ds, cfg.source_field, "source_field", origin)
    target_field = _field(ds, cfg.target_field, "target_field", origin)
    has_refs = cfg.references_field in ds.column_names
    _refuse_non_text(ds, [source_field, target_field], origin)
    keep = [source_field, target_field] + ([cfg.references_field] if has_refs else [])
    ds = ds.select_columns(keep)
    names = zip(keep, ("source", "target", "references")[:len(keep)], strict=True)
    ds = ds.rename_columns({old: new for old, new in names if old != new})
    if not has_refs:
        ds = ds.add_column("references", [[]] * len(ds))
    ds = ds.add_column("tag", [""] * len(ds))
    try:
        return ds.cast(FEATURES)
    except Exception as exc:  # e.g. references given as a string, or a nested object as the source
        raise DataError(f"{origin}: fields {keep} cannot be read as text (source, target) and a list of "
                        f"texts (references): {type(exc).__name__}: {' '.join(str(exc).split())}; "
                        f"fix the data or the data.*_field names") from None


def _standardize_unpaired(ds: Dataset, cfg: DataConfig, origin: str) -> Dataset:
    """Sentences without headlines (data.source_field, or `text`) as pairs of each sentence with itself."""
    field = "text" if "text" in ds.column_names and cfg.source_field not in ds.column_names \
        else _field(ds, cfg.source_field, "source_field", origin)
    _refuse_non_text(ds, [field], origin)
    sentences = ds.select_columns([field]).rename_columns({field: "source"} if field != "source" else {})
    ds = sentences.add_column("target", sentences["source"])
    ds = ds.add_column("references", [[]] * len(ds)).add_column("tag", [""] * len(ds))
    try:
        return ds.cast(FEATURES)
    except Exception as exc:
        raise DataError(f"{origin}: field {field!r} cannot be read as text ({type(exc).__name__}): fix the data or "
                        f"data.source_field") from None


def load_file(spec: FileSpec, cfg: DataConfig, cache_dir: Path) -> tuple[Dataset, dict]:
    """A file's pairs as read by its spec (filter, cleaning rules, tag), and what reading did: its sha256,
    rows read, rows the filter kept, pairs each cleaning rule changed."""
    path = spec.path
    if not path.is_file():
        raise DataError(f"{path} does not exist: fix data.source")
    if path.name.endswith(".article.txt"):
        ds = load_rush(path)
        rows = kept = len(ds)
    else:
        builder = "csv" if path.name.endswith(".csv") else "json"
        raw = load_builder(builder, path, cache_dir, cfg.rebuild)
        filtered = apply_filter(raw, spec)
        rows, kept = len(raw), len(filtered)
        ds = (_standardize_unpaired if spec.unpaired else _standardize)(filtered, cfg, str(path))
    ds, changed = apply_cleaning(ds, spec) if spec.clean or spec.tag else (ds, {})
    info = {"path": str(path), "sha256": sha256(path), "tag": spec.tag, "rows": rows, "kept_by_filter": kept,
            "cleaned": changed, **({"unpaired": True} if spec.unpaired else {}), **_not_utf8(ds, path)}
    return ds, info


def _not_utf8(ds: Dataset, path: Path) -> dict:
    """{"not_utf8_lines": N} for a file with lines that are not UTF-8, named in a note: their bytes read as U+FFFD,
    and cleaning drops such pairs (bad_chars), all but every pair of a Latin-1 file with an accent; else {}."""
    if not any(pc.any(pc.match_substring(ds.data.column(c), "\ufffd")).as_py() for c in ("source", "target")):
        return {}
    files = [path, rush_title(path)] if path.name.endswith(".article.txt") else [path]
    found = {p: lines for p in files if (lines := undecodable_lines(p))[0]}
    for where, (count, first) in found.items():
        print(f"note: {where}: {count:,} line(s) are not UTF-8 (the first: line {first}); their pairs are dropped "
              f"(bad_chars); if it is in another encoding, convert it to UTF-8 first (from Latin-1: iconv -f LATIN1 "
              f"-t UTF-8 {where.name} > NEW)",
              flush=True)
    return {"not_utf8_lines": sum(count for count, _ in found.values())} if found else {}


def load_splits(cfg: DataConfig, cache_dir: Path) -> tuple[dict[str, Dataset], list[str], list[dict]]:
    """Product split -> concatenated standardized Dataset, the source split names left unmapped, and one
    record per input file read (`load_file`'s info, with its split)."""
    inputs: list[dict] = []
    if is_hub(cfg.source):
        hub = load_hub(cfg.source, cache_dir)
        available = list(hub)

        def read(name: str) -> Dataset:
            ds = _standardize(hub[name], cfg, f"hub dataset {cfg.source} split {name}")
            inputs.append({"path": f"{cfg.source}:{name}", "rows": len(ds)})
            return ds
    else:
        files = local_files(cfg.source, cfg.root)
        available = list(files)

        def read(name: str) -> Dataset:
            parts = []
            for spec in files[name]:
                ds, info = load_file(spec, cfg, cache_dir)
                parts.append(ds)
                inputs.append({"split": name, **info})
            return datasets.concatenate_datasets(parts)
    mapping = split_mapping(cfg, available)
    if merged := [name for name in mapping.get("train", []) if name in ("valid", "validation")]:
        held = f", and validation is on data.valid_holdout={cfg.valid_holdout} pairs held out of train" \
            if cfg.valid_holdout > 0 and not mapping.get("valid") else ""
        print(f"note: source split(s) {', '.join(merged)} are mapped to train (data.splits.train={mapping['train']})"
              f"{held}; to validate on {merged[0]} instead: data.splits.train=[train] data.splits.valid=[{merged[0]}]",
              flush=True)
    used = [name for names in mapping.values() for name in names]
    raw = {name: read(name) for name in dict.fromkeys(used)}  # only mapped splits are read
    splits = {product: datasets.concatenate_datasets([raw[name] for name in names])
              for product, names in mapping.items()}
    return splits, sorted(set(available) - set(used)), inputs


def input_files(cfg: DataConfig) -> list[Path]:
    """The local files the mapped splits read, Rush titles included (what the prep fingerprint covers)."""
    files = local_files(cfg.source, cfg.root)
    mapping = split_mapping(cfg, list(files))
    paths = []
    for names in mapping.values():
        for path in (spec.path for name in names for spec in files[name]):
            paths += [path, rush_title(path)] if path.name.endswith(".article.txt") else [path]
    return paths
