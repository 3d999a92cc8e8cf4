"""Several sources in one prepared dir: each file of data.source's mapping may carry its own reader settings
(a filter on the record's fields, named cleaning rules, a source tag), and prep records each input's sha256
and what every rule did, per source.

    data:
      source:
        train:
          - DIR/gigaword/train.jsonl.gz                     # a plain path: read as it is
          - {path: DIR/news_extra/reuters21578/pairs.jsonl.gz, filter: {prose: true},
             clean: [ticker_tags], tag: reuters}
          - {path: DIR/news_extra/ag_news/test_pairs.jsonl.gz, clean: [agency_prefix, agency_suffix], tag: agnews}
          - {path: DIR/news_extra/wmt_newstest/english.jsonl.gz, unpaired: true, tag: news}

An `unpaired` file holds sentences without headlines (its source field, or `text`): each becomes a pair of the
sentence with itself, which training turns into a denoising example (summarizer/data/noise.py): the encoder sees the
sentence with spans of words masked, the decoder writes it whole. Unpaired entries need a tag and belong to train.

Cleaning rules run on the raw text, before the one normalisation (case, digits, word tokenization) that every
source then shares, so headlines of other styles come out as Gigaword's do.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from datasets import Dataset

from summarizer.errors import ConfigError, DataError

# name -> (the field it edits, what it removes). Each is counted per source in meta.json ("inputs").
CLEANING = {
    # Reuters titles carry the company's ticker: "STANDARD OIL <SRD> TO FORM FINANCIAL UNIT".
    "ticker_tags": ("target", re.compile(r"\s*<[^<>\s]{1,12}>")),
    # Wire titles end with their agency: "... Study Peptides (AP)", "... (Reuters)", "... (SPACE.com)".
    "agency_suffix": ("target", re.compile(r"\s*\((?:Reuters|AP|AFP|UPI|[A-Za-z][\w.]*\.com)\)\s*$")),
    # Wire leads start with it: "AP - A company ...", "SPACE.com - TORONTO, Canada -- A second team ...".
    "agency_prefix": ("source",
                      re.compile(r"^(?:AP|AFP|Reuters|UPI|[A-Za-z][\w.]*\.com) - (?:[A-Z][\w.,' ]{0,40}-- )?")),
}
ENTRY_KEYS = ("path", "filter", "clean", "tag", "unpaired")


@dataclass(frozen=True)
class FileSpec:
    """One input file of a split and how to read it."""
    path: Path
    filter: tuple = ()  # ((field, value), ...): keep only records whose field equals the value
    clean: tuple = ()  # names of CLEANING rules, applied in order
    tag: str = ""  # the source's name, recorded with each of its pairs
    unpaired: bool = False  # sentences without headlines: each is paired with itself (a denoising example)


def under(root: str, path: str | Path) -> Path:
    """`path` read from data.root: a relative path is joined to it, when it is set."""
    path = Path(path)
    return Path(root) / path if root and not path.is_absolute() else path


def parse_entry(entry, split: str, root: str = "") -> FileSpec:
    """A data.source mapping entry (a path, or a mapping with path/filter/clean/tag) as a FileSpec; relative paths
    are read from `root` (data.root) where it is set."""
    if isinstance(entry, (str, Path)):
        return FileSpec(under(root, entry))
    if not isinstance(entry, dict) or "path" not in entry:
        raise ConfigError(f"data.source.{split}: each entry is a file path or a mapping with 'path' (and optional "
                          f"'filter', 'clean', 'tag'), got {entry!r}")
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        raise ConfigError(f"data.source.{split}: unknown entry key(s) {unknown} for {entry['path']}: use "
                          f"{', '.join(ENTRY_KEYS)}")
    rules = entry.get("clean") or []
    rules = [rules] if isinstance(rules, str) else list(rules)
    bad = [r for r in rules if r not in CLEANING]
    if bad:
        raise ConfigError(f"data.source.{split}: unknown cleaning rule(s) {bad} for {entry['path']}: the rules are "
                          f"{', '.join(CLEANING)}")
    wanted = entry.get("filter") or {}
    if not isinstance(wanted, dict):
        raise ConfigError(f"data.source.{split}: 'filter' of {entry['path']} must map field names to values, "
                          f"got {wanted!r}")
    tag = entry.get("tag") or ""
    if not isinstance(tag, str) or not re.fullmatch(r"[\w.-]*", tag):
        raise ConfigError(f"data.source.{split}: 'tag' of {entry['path']} must be a plain name, got {tag!r}")
    unpaired = entry.get("unpaired", False)
    if not isinstance(unpaired, bool):
        raise ConfigError(f"data.source.{split}: 'unpaired' of {entry['path']} must be true or false, got {unpaired!r}")
    if unpaired and (split != "train" or not tag):
        raise ConfigError(f"data.source.{split}: the unpaired file {entry['path']} "
                          + ("must be a train entry: valid and test pairs are scored against headlines"
                             if split != "train" else "needs a tag (`tag: NAME`): training tells its sentences apart "
                             "by it, and decoding must never be asked for their style"))
    if str(entry["path"]).endswith(".article.txt") and (wanted or unpaired):
        raise ConfigError(f"data.source.{split}: {entry['path']} is a Rush pair of plain text files: it has no fields "
                          f"to filter and is pairs already; 'filter' and 'unpaired' are for .jsonl and .csv entries")
    return FileSpec(under(root, entry["path"]), tuple(sorted(wanted.items())), tuple(rules), tag, unpaired)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def apply_filter(ds: Dataset, spec: FileSpec) -> Dataset:
    """The records whose fields equal the spec's filter values (raw records: before standardising)."""
    for field, value in spec.filter:
        if field not in ds.column_names:
            raise DataError(f"{spec.path} has no field '{field}' to filter on (it has {ds.column_names}): fix the "
                            f"'filter' of its data.source entry")
        kept = ds.filter(lambda v, value=value: v == value, input_columns=field, keep_in_memory=True,
                         desc=f"Filtering {spec.path.name}")
        if len(ds) and not len(kept):  # a whole source gone, most often a value of another type ("true" for true)
            seen = sorted({repr(v) for v in ds[field][:1000]})[:5]
            raise DataError(f"the filter {field}={value!r} ({type(value).__name__}) of {spec.path} keeps none of its "
                            f"{len(ds)} records; its values include {', '.join(seen)}: fix the 'filter' of its "
                            f"data.source entry")
        ds = kept
    return ds


def apply_cleaning(ds: Dataset, spec: FileSpec) -> tuple[Dataset, dict[str, int]]:
    """The spec's cleaning rules applied to standardised pairs, and how many pairs each rule changed; the
    spec's tag written into every pair's `tag`."""
    changed = dict.fromkeys(spec.clean, 0)

    def clean(batch: dict) -> dict:
        for rule in spec.clean:
            field, pattern = CLEANING[rule]
            new = [pattern.sub("", text or "") for text in batch[field]]
            changed[rule] += sum(a != (b or "") for a, b in zip(new, batch[field], strict=True))  # None: empty
            batch[field] = new
        batch["tag"] = [spec.tag] * len(batch["source"])
        return batch

    # In-process (no num_proc), so the counts above are this process's own.
    return ds.map(clean, batched=True, keep_in_memory=True, desc=f"Cleaning rules {spec.path.name}"), changed
