"""Offline data preparation: raw pairs -> cleaned -> SentencePiece -> memory-mappable token arrays + meta.json.

The pipeline is in `data_prep/pipeline.py`. This file imports nothing heavy, so that `python -m data_prep`
is inside its own error handling (a clean Ctrl-C, one-line errors) before torch and datasets load.
"""
from __future__ import annotations


def prepare(cfg):
    """Prepare `cfg.dir` from `cfg.source` (a DataConfig): see data_prep.pipeline.prepare."""
    from data_prep.pipeline import prepare as run
    return run(cfg)
