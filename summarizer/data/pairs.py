"""Pairs files (`.jsonl[.gz]`: `source`, `target`, optional `references`), read with one clear error per fault."""
from __future__ import annotations

import gzip
import json
import unicodedata
import zlib
from collections.abc import Iterator
from pathlib import Path

from summarizer.errors import DataError


def numbered_lines(path: str | Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw bytes) of a text file, gunzipped when it ends in .gz or starts as gzip does; a
    file that is not the gzip it claims to be, or is cut short, is a DataError naming it."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path} is a directory: give a pairs file (.jsonl or .jsonl.gz) inside it")
    if not path.is_file():
        raise DataError(f"{path} does not exist: check the path")
    with open(path, "rb") as fh:  # a gzip file by its first bytes too: readers (datasets) take it so by any name
        opener = gzip.open if path.name.endswith(".gz") or fh.read(2) == b"\x1f\x8b" else open
    try:
        with opener(path, "rb") as fh:
            yield from enumerate(fh, start=1)
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise DataError(f"{path} is not a readable gzip file ({type(exc).__name__}: {exc}): it is truncated, "
                        f"corrupt or not compressed; re-create it, or drop the .gz ending if it is plain "
                        f"text") from None


def parse_record(raw: bytes) -> dict | str:
    """A JSON object from one line, or the reason it is not one."""
    try:
        record = json.loads(raw.decode("utf-8-sig", errors="replace"))
    except json.JSONDecodeError as exc:
        return f"malformed JSON: {exc.msg} at column {exc.colno}"
    return record if isinstance(record, dict) else f"expected a JSON object, got {type(record).__name__}"


def visible(text: str) -> bool:
    """Whether `text` holds a character that shows: not a space, control or format character (a byte-order
    mark, a zero-width space), which str.strip() keeps and the tokenizer drops. A line without one is blank."""
    return any(unicodedata.category(ch)[0] not in "ZC" for ch in text)


def read_pairs_file(path: str | Path, need_target: bool = True, need_source: bool = True) -> list[dict]:
    """Every pair of a pairs file as {"source", "target", "references"} (references defaults to [target]).

    Blank lines are skipped. A line that is not a JSON object, lacks a text `source` (when `need_source`; else
    it reads as "") or `target` (when `need_target`), or whose `references` is not a list of texts, is an error
    naming file and line; so is a source or reference that is needed but has no visible character (a summary of
    nothing, a reference every summary scores 0 against).
    """
    pairs = []
    for number, raw in numbered_lines(path):
        if not raw.strip():
            continue
        record = parse_record(raw)
        if isinstance(record, str):
            if not pairs:  # its first line: likely not a pairs file at all (CSV, plain text)
                raise DataError(f"{path}:{number}: {record}: a pairs file is JSON Lines (.jsonl, or .jsonl.gz), one "
                                f"object with 'source' and 'target' texts a line")
            raise DataError(f"{path}:{number}: {record}: fix or remove that line")
        refs = record.get("references") or ([record["target"]] if isinstance(record.get("target"), str) else [])
        if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
            raise DataError(f"{path}:{number}: 'references' must be a list of texts")
        if not need_source:
            record["source"] = record.get("source") if isinstance(record.get("source"), str) else ""
        missing = [f for f, ok in (("source", isinstance(record.get("source"), str)), ("target", bool(refs)))
                   if not ok and (f == "source" or need_target)]
        if missing:
            raise DataError(f"{path}:{number}: no text field {' or '.join(repr(f) for f in missing)} (it has "
                            f"{sorted(record)}): a pairs file holds source, target and optional references")
        needed = ([("source", record["source"])] if need_source else []) + \
            ([(f"reference {i}", r) for i, r in enumerate(refs, start=1)] if need_target else [])
        empty = [name for name, text in needed if not visible(text)]
        if empty:
            raise DataError(f"{path}:{number}: the {' and '.join(empty)} {'is' if len(empty) == 1 else 'are'} empty "
                            f"(no visible character): fix or remove that line")
        pairs.append({"source": record["source"], "target": record.get("target") or (refs[0] if refs else ""),
                      "references": refs})
    if not pairs:
        raise DataError(f"{path} holds no pairs: fill it with one JSON object per line")
    return pairs
