"""Fixtures for the data-prep and tokenizer tests: asset paths, a small DataConfig, one prepared tiny corpus."""
from pathlib import Path

import pytest

from summarizer.config.load import load_config
from summarizer.config.schema import DataConfig

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
    """tests/assets/tiny prepared once per session (tests/fixture_data.py)."""
    from tests.fixture_data import prepared
    return prepared("tiny_prepared", tmp_path_factory.mktemp("tiny_prepared") / "data")


@pytest.fixture(autouse=True)
def _denormals_back_to_default():
    """runtime.setup turns flush-to-zero on for the process; each test starts from torch's default."""
    import torch
    yield
    torch.set_flush_denormal(False)


ROOT = Path(__file__).resolve().parent.parent
TRAINED_ARGS = ["model.d_model=32", "model.ffn_dim=64", "train.max_steps=40", "train.eval_every=20",
                "train.ckpt_every=10", "train.keep_last=3", "train.log_every=10", "train.sample_summaries=0",
                "eval.bootstrap_samples=20"]


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> tuple[Path, list[str]]:
    """One tiny run trained once per session, for every test that needs trained weights: (its tmp dir, the
    CLI args naming its config, data and run dir). Step checkpoints 20, 30, 40 and best.pt are kept. Tests may
    add files (evals, averages) but must not train it further."""
    from summarizer.__main__ import main
    from tests.fixture_data import prepared
    tmp = tmp_path_factory.mktemp("trained_run")
    args = ["--config", str(ROOT / "configs/tiny.yaml"), f"data.dir={tmp / 'data'}", f"run.dir={tmp / 'run'}",
            f"run.tensorboard_dir={tmp / 'tb'}", *TRAINED_ARGS]
    prepared("tiny", tmp / "data")
    assert main(["train", *args]) == 0
    return tmp, args


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """configs/tiny.yaml's fixture prepared as `make smoke` prepares it, once per test module
    (tests/fixture_data.py)."""
    from tests.fixture_data import prepared
    return prepared("tiny", tmp_path_factory.mktemp("data") / "tiny")
