"""Tests for summarizer/outputs.py: a directory is the product's only by the marker it wrote itself."""
from pathlib import Path

import pytest

from summarizer.errors import ConfigError, UserError
from summarizer.outputs import MARKER, claim_dir
from summarizer.train.session import RUN_FILES


def snapshot(directory: Path) -> dict:
    return {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def test_an_empty_or_new_directory_is_claimed_and_marked(tmp_path):
    assert claim_dir(tmp_path / "new" / "run", "run", "run.dir") == tmp_path / "new" / "run"
    assert (tmp_path / "new" / "run" / MARKER).read_text() == "run\n"
    (tmp_path / "empty").mkdir()
    claim_dir(tmp_path / "empty", "eval", "eval.out_dir")
    assert (tmp_path / "empty" / MARKER).read_text() == "eval\n"


def test_a_marked_directory_is_accepted_with_its_files(tmp_path):
    claim_dir(tmp_path, "run", "run.dir")
    (tmp_path / "config.yaml").write_text("written by a run\n")
    assert claim_dir(tmp_path, "run", "run.dir") == tmp_path
    assert claim_dir(tmp_path, "eval", "eval.out_dir", also=("run",)) == tmp_path


@pytest.mark.parametrize("name", [*RUN_FILES, "predictions.txt", "rouge.json", "meta.json", "bench.json"])
def test_a_file_named_like_ours_does_not_make_a_users_directory_ours(tmp_path, name):
    """The names the product writes were once taken as proof it wrote them: a user's config.yaml was overwritten."""
    (tmp_path / name).write_text("the user's own\n")
    before = snapshot(tmp_path)
    with pytest.raises(UserError, match=f"did not write \\({name}\\); nothing was changed. Choose a new or empty"):
        claim_dir(tmp_path, "run", "run.dir")
    assert snapshot(tmp_path) == before  # no marker written


def test_another_kinds_directory_is_refused_with_the_callers_note(tmp_path):
    claim_dir(tmp_path, "run", "run.dir")
    with pytest.raises(ConfigError, match=r"is a run directory of this product, not a eval directory \(only its "
                                          r"own\); nothing was changed. Choose another eval.out_dir"):
        claim_dir(tmp_path, "eval", "eval.out_dir", note="only its own")
    assert (tmp_path / MARKER).read_text() == "run\n"
