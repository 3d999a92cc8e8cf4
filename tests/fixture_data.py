"""The prepared corpora behind the `tiny_prepared` and `tiny_data` fixtures: made by data_prep, or, where
SUMMARIZER_TEST_PREPARED names a directory, copied from what this module's command prepared there on another
machine. data_prep needs the `datasets` package; a GPU machine that lacks it still runs the tests that train:
    python -m tests.fixture_data DIR                      # here: DIR/tiny_prepared and DIR/tiny
    SUMMARIZER_TEST_PREPARED=DIR python -m pytest ...     # there
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "tests" / "assets"
PREPARED = "SUMMARIZER_TEST_PREPARED"


def prepare_assets_tiny(data_dir: Path) -> None:
    """tests/assets/tiny with the tests' data settings (digits already masked; mask_digits is a no-op on it)."""
    from data_prep import prepare
    from tests.conftest import data_config

    prepare(data_config(data_dir, f"data.source={ASSETS / 'tiny'}", "data.vocab_size=150", "data.mask_digits=true"))


def prepare_tiny(data_dir: Path) -> None:
    """configs/tiny.yaml's fixture, as `make smoke` prepares it."""
    from data_prep.__main__ import main as prep

    assert prep(["--config", str(ROOT / "configs/tiny.yaml"), f"data.dir={data_dir}"]) == 0


MADE_BY = {"tiny_prepared": prepare_assets_tiny, "tiny": prepare_tiny}


def prepared(name: str, data_dir: Path) -> Path:
    """`name`'s corpus in `data_dir` (new): copied from $SUMMARIZER_TEST_PREPARED/<name> where that is set, else
    prepared."""
    source = os.environ.get(PREPARED)
    if source:
        shutil.copytree(Path(source) / name, data_dir, ignore=shutil.ignore_patterns(".hf_cache"))
    else:
        MADE_BY[name](data_dir)
    return data_dir


if __name__ == "__main__":
    out = Path(sys.argv[1])
    for name, make in MADE_BY.items():
        make(out / name)
        shutil.rmtree(out / name / ".hf_cache", ignore_errors=True)  # data_prep's working cache: not needed after
    print(f"prepared {', '.join(MADE_BY)} in {out}; on another machine: {PREPARED}={out} python -m pytest ...")
