"""Fixtures for the data-prep and tokenizer tests: asset paths, a small DataConfig, one prepared tiny corpus."""
from pathlib import Path

import pytest

from summarizer.config import DataConfig, load_config

ASSETS = Path(__file__).parent / "assets"


def data_config(data_dir, *overrides: str) -> DataConfig:
    """Test defaults: a small vocab and no worker processes, so each prep takes well under a second; the
    usual split names mapped one to one, no hold-out and no normalisation, so each test sets what it checks."""
    return load_config(None, [f"data.dir={data_dir}", "data.vocab_size=64", "data.num_proc=1",
                              "data.splits={train: [train], valid: [valid, validation, dev], test: [test]}",
                              "data.valid_holdout=0", "data.lowercase=false", "data.mask_digits=false",
                              *overrides]).data


@pytest.fixture(scope="session")
def tiny_prepared(tmp_path_factory) -> Path:
    """tests/assets/tiny prepared once per session (digits already masked; mask_digits is a no-op on it)."""
    from data_prep import prepare

    data_dir = tmp_path_factory.mktemp("tiny_prepared")
    prepare(data_config(data_dir, f"data.source={ASSETS / 'tiny'}", "data.vocab_size=150",
                        "data.mask_digits=true"))
    return data_dir


@pytest.fixture(autouse=True)
def _denormals_back_to_default():
    """runtime.setup turns flush-to-zero on for the process; each test starts from torch's default."""
    import torch
    yield
    torch.set_flush_denormal(False)
