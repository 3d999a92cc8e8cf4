"""One local split file read into a datasets table: JSON Lines and CSV through datasets' builders, Rush's
line-aligned `.article.txt`/`.title.txt` pairs by line; each fault of a file one error naming it (and its line)."""
from __future__ import annotations

import codecs
import json
from pathlib import Path

import datasets
import pyarrow as pa
from datasets import Dataset, Features, List, Value

from summarizer.data.pairs import numbered_lines, parse_record
from summarizer.errors import DataError

# Every reader returns exactly these columns, so splits from different files concatenate.
FEATURES = Features({"source": Value("string"), "target": Value("string"),
                     "references": List(Value("string")), "tag": Value("string")})


def _first_bad_json_line(path: Path) -> tuple[int, str] | None:
    """(1-based line number, reason) of the first line that is not a JSON object, or None; a broken
    gzip file is a DataError of its own."""
    for number, raw in numbered_lines(path):
        if raw.strip():
            record = parse_record(raw)
            if isinstance(record, str):
                return number, record
    return None


# Undecodable bytes become U+FFFD, so cleaning drops (and counts) just those pairs instead of the
# whole file failing. The json builder only re-decodes when the encoding is not literally "utf-8";
# "utf-8-sig" is the same codec and also tolerates a leading byte-order mark. A CSV cell is text as written:
# pandas would read "NA", "null", "None", "nan" and the like as missing, and such headlines be dropped as empty.
_DECODE = {"json": {"encoding": "utf-8-sig", "encoding_errors": "replace"},
           "csv": {"encoding": "utf-8-sig", "encoding_errors": "replace", "na_filter": False}}


def _json_features(path: Path) -> Features:
    """Every field of a JSON Lines file of objects, typed by its first value (null until one comes): the json
    builder types a file by its first 10 MB and fails at a field first met after them. A field whose values
    differ in kind (a number, then text) is refused at the first line that differs."""
    first: dict[str, tuple[object, int]] = {}  # field -> (first value not null, its line)
    for number, raw in numbered_lines(path):
        for field, value in (parse_record(raw) if raw.strip() else {}).items():
            seen, line = first.setdefault(field, (value, number))
            if seen is None:
                first[field] = (value, number)
            elif value is not None and type(value) is not type(seen) and {type(value), type(seen)} != {int, float}:
                raise DataError(f"{path}:{number}: field '{field}' holds {json.dumps(value)[:80]}, line {line} "
                                f"{json.dumps(seen)[:80]}: give the field one kind of value on every line")
    schema = pa.schema([(field, pa.float64() if isinstance(value, float) else pa.array([value]).type)
                        for field, (value, _) in first.items()])
    return Features.from_arrow_schema(schema)


def load_builder(builder: str, path: Path, cache_dir: Path, fresh: bool, features: Features | None = None
                 ) -> Dataset:
    """One local file through a datasets builder; `fresh` (data.rebuild) reads it again rather than from the
    cache, which datasets keys by the file's path and modification time, not its contents."""
    if path.stat().st_size == 0:
        raise DataError(f"{path} is empty: remove it or fill it with pairs")
    try:
        # read again; without its checks, which compare the new read with the cache's record of the old one
        again = {"download_mode": "force_redownload", "verification_mode": "no_checks"} if fresh else {}
        ds = datasets.load_dataset(builder, data_files={"data": str(path)}, split="data", cache_dir=str(cache_dir),
                                   **({"features": features} if features else {}), **again, **_DECODE[builder])
    except Exception as exc:  # datasets wraps parser errors and does not say which line
        if not any(raw.strip() for _, raw in numbered_lines(path)):  # blank lines, or a gzip of nothing
            raise DataError(f"{path} holds no rows: remove it or fill it with pairs") from None
        bad = _first_bad_json_line(path) if builder == "json" else None
        if bad:
            raise DataError(f"{path}:{bad[0]}: {bad[1]}: fix or remove that line") from None
        if builder == "json" and features is None:  # every line an object: typed by their fields, all of them
            return load_builder(builder, path, cache_dir, fresh, _json_features(path))
        raise DataError(f"cannot read {path} ({type(exc).__name__}: {exc.__cause__ or exc}): "
                        f"check that it is valid {builder.upper()}") from None
    if len(ds) == 0:
        raise DataError(f"{path} holds no rows: remove it or fill it with pairs")
    return ds


def undecodable_lines(path: Path) -> tuple[int, int]:
    """How many lines of a text file are not UTF-8, and the first one's number (0 if none)."""
    count = first = 0
    for number, raw in numbered_lines(path):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            count, first = count + 1, first or number
    return count, first


def rush_title(article: Path) -> Path:
    """The `.title.txt` file paired with a Rush `.article.txt` file."""
    return article.with_name(article.name[: -len(".article.txt")] + ".title.txt")


def _lines(path: Path) -> pa.ChunkedArray:
    """A text file's lines, split at "\n" alone (a CRLF ending loses its "\r"): universal newlines would split a
    line at a lone "\r" too, and pair every later line of a Rush file with another line's partner."""
    chunks, batch = [], []
    for number, raw in numbered_lines(path):
        raw = raw.removesuffix(b"\n").removesuffix(b"\r")
        batch.append((raw.removeprefix(codecs.BOM_UTF8) if number == 1 else raw).decode("utf-8", "replace"))
        if len(batch) == 100_000:
            chunks.append(pa.array(batch, pa.string()))
            batch = []
    return pa.chunked_array([*chunks, pa.array(batch, pa.string())])


def load_rush(article: Path) -> Dataset:
    """A Rush `.article.txt` file and its `.title.txt` partner as pairs, line i with line i."""
    title = rush_title(article)
    if not title.is_file():
        raise DataError(f"{article} has no partner file {title}: Rush-style splits need both files")
    texts = [_lines(p) for p in (article, title)]
    for path, lines in zip((article, title), texts, strict=True):
        if len(lines) == 0:
            raise DataError(f"{path} holds no rows: remove it or fill it with pairs")
    if len(texts[0]) != len(texts[1]):
        raise DataError(f"{article} has {len(texts[0])} lines but {title} has {len(texts[1])}: line i of "
                        f"one must pair with line i of the other; fix the files (nothing was truncated)")
    ds = Dataset.from_dict({"source": texts[0], "target": texts[1]})
    ds = ds.add_column("references", [[]] * len(ds))
    return ds.add_column("tag", [""] * len(ds)).cast(FEATURES)
