"""Offline tokenization of cleaned splits into flat token arrays + offsets, written atomically."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset, Features, List, Value

from summarizer.data.prepared import split_files
from summarizer.data.tokenizer import Tokenizer
from summarizer.outputs import atomic_open


def token_dtype(vocab_size: int) -> np.dtype:
    # ids run 0..vocab_size-1, so a 65,536-piece vocabulary still fits uint16 (half the bytes of int32)
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.int32)


class _Encoder:
    """Batched encode for `Dataset.map`; pickled to worker processes, where the model is loaded once."""

    def __init__(self, model_path: Path, sha256: str, source_tag: str):
        # sha256 is part of the pickled state, so datasets' fingerprint of this map changes with the model.
        self.model_path, self.sha256, self.source_tag, self._tokenizer = str(model_path), sha256, source_tag, None

    def __getstate__(self):
        return {**self.__dict__, "_tokenizer": None}

    def __call__(self, batch: dict) -> dict:
        if self._tokenizer is None:
            self._tokenizer = Tokenizer(self.model_path)
        sources = self._tokenizer.encode_batch(batch["source"])
        if self.source_tag:  # each pair's tag piece first; untagged pairs get data.source_tag's
            sources = [[self._tokenizer.tag_id(tag or self.source_tag), *ids]
                       for tag, ids in zip(batch["tag"], sources, strict=True)]
        return {"src_ids": sources, "tgt_ids": self._tokenizer.encode_batch(batch["target"])}


def encode_split(pairs: Dataset, model_path: Path, sha256: str, name: str, num_proc: int | None,
                 source_tag: str = "") -> Dataset:
    """Columns src_ids, tgt_ids (no BOS/EOS: the data loader adds them), in the order of `pairs`; with
    `source_tag` (data.source_tag), each source starts with its pair's tag piece, or that tag's."""
    features = Features({"src_ids": List(Value("int32")), "tgt_ids": List(Value("int32"))})
    return pairs.map(_Encoder(model_path, sha256, source_tag), batched=True, num_proc=num_proc, features=features,
                     remove_columns=pairs.column_names, keep_in_memory=True, desc=f"Tokenizing {name}")


def _flat(column: pa.ChunkedArray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """A list column -> (concatenated values, int64 offsets of length n + 1 starting at 0)."""
    lists = column.combine_chunks()
    lengths = pc.list_value_length(lists).to_numpy(zero_copy_only=False)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = pc.list_flatten(lists).to_numpy(zero_copy_only=False).astype(dtype)
    return values, offsets


def _save_npy(path: Path, array: np.ndarray) -> None:
    with atomic_open(path, "wb") as f:
        np.save(f, array)  # a file object, so np.save adds no `.npy` to the temp name


def _write_pairs(path: Path, pairs: Dataset) -> None:
    with atomic_open(path, "w") as f:
        for batch in pairs.select_columns(["source", "target", "references", "tag"]).iter(batch_size=10_000):
            for src, tgt, refs, tag in zip(batch["source"], batch["target"], batch["references"], batch["tag"],
                                           strict=True):
                record = {"source": src, "target": tgt, **({"references": refs} if refs else {}),
                          **({"tag": tag} if tag else {})}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")


def write_split(data_dir: Path, split: str, pairs: Dataset, encoded: Dataset, dtype: np.dtype) -> dict:
    """Write the split's arrays and its cleaned-text jsonl; returns its meta.json entry."""
    files = split_files(split)
    table = encoded.with_format("arrow")[:]
    stats = {"pairs": len(pairs)}
    tags = pairs.unique("tag")
    if tags != [""]:  # several sources, or a tagged one: the split's pairs per source tag
        counts = pairs.with_format("numpy", columns=["tag"])[:]["tag"]
        stats["pairs_by_tag"] = {tag or "(untagged)": int((counts == tag).sum()) for tag in sorted(tags)}
    for side, column in (("src", "src_ids"), ("tgt", "tgt_ids")):
        values, offsets = _flat(table.column(column), dtype)
        _save_npy(data_dir / files[side], values)
        _save_npy(data_dir / files[f"{side}_offsets"], offsets)
        long_name = "source" if side == "src" else "target"
        stats[f"{long_name}_tokens"] = int(values.size)
        stats[f"max_{long_name}_len"] = int(np.diff(offsets).max(initial=0))
    _write_pairs(data_dir / files["pairs"], pairs)
    return stats
