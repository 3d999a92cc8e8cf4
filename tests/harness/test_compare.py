import gzip
import json
import random
from pathlib import Path

import numpy as np
import pytest

from summarizer.decode.inference import truncate_bytes
from summarizer.errors import DataError
from summarizer.evaluation.scoring import rouge_report
from summarizer.harness.compare import CompareError, compare, pair_scores, permutation_means, significance

TINY = Path(__file__).resolve().parents[1] / "assets" / "tiny"
TEST_PAIRS = [json.loads(line) for line in (TINY / "test.jsonl").read_text().splitlines()]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def systems(tmp_path_factory):
    """`good` copies each reference; `bad` is five random words from other headlines."""
    tmp = tmp_path_factory.mktemp("compare")
    rng = random.Random(0)
    words = [w for p in TEST_PAIRS for w in p["target"].split()]
    good = write_lines(tmp / "good.txt", [p["target"] for p in TEST_PAIRS])
    bad = write_lines(tmp / "bad.txt", [" ".join(rng.sample(words, 5)) for _ in TEST_PAIRS])
    half = write_lines(tmp / "half.txt", [" ".join(p["target"].split()[:3]) for p in TEST_PAIRS])
    return tmp, good, bad, half


def test_identical_systems_differ_by_zero_with_p_one(systems):
    tmp, _, _, half = systems
    report = compare(str(half), str(half), str(TINY / "test.jsonl"), tmp / "same", samples=500)
    for m in report["metrics"].values():
        assert m["diff"] == 0 and m["diff_ci"] == [0, 0]
        assert m["bootstrap_p"] == 1 and m["permutation_p"] == 1


def test_a_references_only_file_serves_as_references(systems, tmp_path):
    """compare reads references alone: a file without sources (no key, or an empty one) scores as the pairs
    file it was cut from; a blank reference is still refused."""
    _, good, bad, _ = systems
    refs = tmp_path / "refs.jsonl"
    refs.write_text("".join(json.dumps({"target": p["target"]} if i % 2 else {"source": "", "target": p["target"]})
                            + "\n" for i, p in enumerate(TEST_PAIRS)))
    full = compare(str(bad), str(good), str(TINY / "test.jsonl"), tmp_path / "full", samples=50)
    only = compare(str(bad), str(good), str(refs), tmp_path / "only", samples=50)
    assert only["metrics"] == full["metrics"]
    refs.write_text(json.dumps({"target": " "}) + "\n")
    with pytest.raises(DataError, match="refs.jsonl:1: the reference 1 is empty"):
        compare(str(bad), str(good), str(refs), tmp_path / "blank", samples=50)


def test_references_beat_random_words_significantly(systems):
    tmp, good, bad, _ = systems
    report = compare(str(bad), str(good), str(TINY / "test.jsonl"), tmp, samples=2000)
    assert json.loads((tmp / "compare.json").read_text()) == report
    for m in report["metrics"].values():
        assert m["b"] == pytest.approx(100) and m["diff"] > 50 and m["diff_ci"][0] > 0
        # nothing as extreme in any sample: the add-one smoothed p is its floor 1/(R+1)
        assert m["bootstrap_p"] == m["permutation_p"] == pytest.approx(1 / 2001)
        assert m["b_wins"] == 1.0


def test_same_seed_same_numbers_other_seed_other_numbers(systems):
    tmp, _, bad, half = systems
    runs = [compare(str(bad), str(half), str(TINY / "test.jsonl"), tmp / f"s{i}", samples=300, seed=seed)
            for i, seed in enumerate((7, 7, 8))]
    assert runs[0]["metrics"] == runs[1]["metrics"]
    assert runs[0]["metrics"]["rouge1"]["diff_ci"] != runs[2]["metrics"]["rouge1"]["diff_ci"]
    assert runs[0]["metrics"]["rouge1"]["diff"] == runs[2]["metrics"]["rouge1"]["diff"]  # not a sample


def test_pair_scores_average_to_rouge_report():
    preds = ["talks on UNK deal", "police arrest suspect", "storm cuts power to thousands"]
    refs = [["talks on <unk> deal"], ["storm hits", "police arrest a suspect"], ["power cut"]]
    scores = pair_scores(preds, refs)  # (pairs, type, p/r/f)
    report = rouge_report(preds, refs, samples=0)
    for j, kind in enumerate(("rouge1", "rouge2", "rougeL")):
        assert 100 * scores[:, j, 2].mean() == pytest.approx(report[kind]["f"])


def test_randomization_is_symmetric_around_zero_and_p_is_smoothed():
    rng = np.random.default_rng(0)
    diffs = rng.normal(0.0, 1.0, size=(200, 3))
    perm = permutation_means(diffs, 4000, np.random.default_rng(1))
    assert abs(perm.mean()) < 0.02 and perm.std(axis=0) == pytest.approx(np.sqrt((diffs**2).mean(0) / 200), rel=0.1)
    result = significance(np.zeros((200, 3)), diffs / 100, samples=999, seed=3)
    for m in result.values():
        assert 1 / 1000 <= m["permutation_p"] <= 1 and 1 / 1000 <= m["bootstrap_p"] <= 1
        assert (m["permutation_p"] * 1000) == pytest.approx(round(m["permutation_p"] * 1000))


def test_references_from_prepared_split_and_gzip(systems, tiny_prepared, tmp_path):
    _, good, bad, _ = systems
    prepared = compare(str(bad), str(good), f"{tiny_prepared}:test", tmp_path / "a", samples=50)
    gz = tmp_path / "refs.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as fh:
        fh.writelines(json.dumps({"source": p["source"], "references": ["x", p["target"]]}) + "\n"
                      for p in TEST_PAIRS)
    zipped = compare(str(bad), str(good), str(gz), tmp_path / "b", samples=50)
    direct = compare(str(bad), str(good), str(tiny_prepared / "test.jsonl"), tmp_path / "c", samples=50)
    assert prepared["pairs"] == zipped["pairs"] == direct["pairs"] == 40
    assert prepared["metrics"] == direct["metrics"]
    assert zipped["metrics"]["rouge1"]["b"] == pytest.approx(100)  # best of the references


def test_eval_output_dir_is_accepted(systems, tmp_path):
    _, good, bad, _ = systems
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "predictions.txt").write_text(good.read_text())
    report = compare(str(bad), str(tmp_path / "run"), str(TINY / "test.jsonl"), tmp_path, samples=10)
    assert report["b"] == str(tmp_path / "run" / "predictions.txt")


def test_an_evaluation_compared_against_references_of_another_split_is_warned_of(systems, tiny_prepared, tmp_path,
                                                                                    capsys):
    """Two splits of the same size line up pair for pair, so nothing else would tell: rouge.json says which split
    the predictions summarise."""
    _, good, bad, _ = systems
    run = tmp_path / "run"
    run.mkdir()
    (run / "predictions.txt").write_text(good.read_text())
    (run / "rouge.json").write_text(json.dumps({"settings": {"split": "test", "pairs_file": None}}))
    for ref in (f"{tiny_prepared}:test", str(tiny_prepared / "test.jsonl"), str(TINY / "test.jsonl")):
        compare(str(bad), str(run), ref, tmp_path / "same", samples=10)
        assert "warning" not in capsys.readouterr().err
    other = tmp_path / "valid.jsonl"  # another split, as many pairs
    other.write_text((tiny_prepared / "test.jsonl").read_text())
    compare(str(bad), str(run), str(other), tmp_path / "other", samples=10)
    assert f"warning: B {run / 'predictions.txt'} was decoded from test (its rouge.json), but --ref " in \
        capsys.readouterr().err


def test_an_evaluation_scored_against_other_references_is_refused(systems, tiny_prepared, tmp_path):
    """Where rouge.json records the digest of the references it was scored against, other references are
    certain, whatever their split's name (another data dir's `test` may hold other pairs)."""
    from summarizer.evaluation.scoring import references_sha256
    from summarizer.harness.compare import read_references
    _, good, bad, _ = systems
    run = tmp_path / "run"
    run.mkdir()
    (run / "predictions.txt").write_text(good.read_text())
    scored = references_sha256(read_references(f"{tiny_prepared}:test")[1])
    for digest, fine in ((scored, True), ("0" * 64, False)):
        (run / "rouge.json").write_text(json.dumps({"settings": {"split": "test", "references_sha256": digest,
                                                                 "data_dir": "data/elsewhere"}}))
        if fine:
            compare(str(bad), str(run), f"{tiny_prepared}:test", tmp_path / "same", samples=10)
            continue
        with pytest.raises(CompareError, match=rf"B {run / 'predictions.txt'} was scored against other references "
                                               rf"than --ref .* holds \(its rouge.json: test in data/elsewhere\)"):
            compare(str(bad), str(run), f"{tiny_prepared}:test", tmp_path / "other", samples=10)


def test_line_count_mismatch_names_both_files(systems, tmp_path, capsys):
    from summarizer.__main__ import main
    _, good, _, _ = systems
    short = write_lines(tmp_path / "short.txt", ["a"] * 39)
    assert main(["compare", str(short), str(good), "--ref", str(TINY / "test.jsonl"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(short) in err and str(good) in err and "39" in err and "40" in err
    assert main(["compare", str(good), str(good), "--ref", str(TINY / "train.jsonl"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "train.jsonl" in err and "300" in err and "40" in err and "Traceback" not in err


def test_user_mistakes_end_in_one_clear_message(systems, tmp_path, capsys):
    from summarizer.__main__ import main
    _, good, _, _ = systems
    ref = str(TINY / "test.jsonl")
    no_target = tmp_path / "no_target.jsonl"
    no_target.write_text("".join(json.dumps({"source": p["source"]}) + "\n" for p in TEST_PAIRS))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cases = {"does not exist": [str(tmp_path / "nope.txt"), str(good), "--ref", ref],
             "no text field 'target'": [str(good), str(good), "--ref", str(no_target)],
             "is empty": [str(empty), str(good), "--ref", ref],
             "references": [str(good), str(good), "--ref", str(tmp_path / "nothing:test")],
             "without predictions.txt": [str(tmp_path), str(good), "--ref", ref],
             "--samples": [str(good), str(good), "--ref", ref, "--samples", "0"]}
    for needle, argv in cases.items():
        assert main(["compare", *argv, "--out", str(tmp_path / "out")]) == 2, needle
        err = capsys.readouterr().err
        assert err.startswith("error: ") and needle in err and "Traceback" not in err
    clash = tmp_path / "compare.json"
    clash.write_text(good.read_text())
    with pytest.raises(CompareError, match="one of the inputs"):
        compare(str(clash), str(good), ref, tmp_path, samples=1)


def test_compare_never_replaces_a_file_it_did_not_write(systems, tmp_path, capsys):
    from summarizer.__main__ import main
    _, good, bad, _ = systems
    ref = str(TINY / "test.jsonl")
    mine = tmp_path / "compare.json"
    mine.write_text("keep\n")
    assert main(["compare", str(bad), str(good), "--ref", ref, "--out", str(tmp_path), "--samples", "10"]) == 2
    assert "was not written by `summarizer compare`" in capsys.readouterr().err and mine.read_text() == "keep\n"
    mine.unlink()
    for _ in range(2):  # its own file it replaces
        assert main(["compare", str(bad), str(good), "--ref", ref, "--out", str(tmp_path), "--samples", "10"]) == 0
    assert json.loads(mine.read_text())["written_by"] == "summarizer compare"
    assert main(["compare", str(bad), str(good), "--ref", ref, "--out", str(mine), "--samples", "10"]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    assert main(["compare", str(bad), str(good), "--ref", ref, "--out", str(mine / "sub"), "--samples", "10"]) == 2
    assert f"cannot write in --out {mine / 'sub'} (Not a directory)" in capsys.readouterr().err
    assert main(["compare", str(bad), str(good), "--ref", ref, "--out", "/proc/no_such_dir", "--samples", "10"]) == 2
    assert "cannot write in --out /proc/no_such_dir" in capsys.readouterr().err
    assert main(["compare", str(bad), str(good), "--ref", ref, "--out", "/proc", "--samples", "10"]) == 2  # exists
    err = capsys.readouterr().err  # but takes no file, even from root: refused before the scoring, not after it
    assert "cannot write in --out /proc" in err and "Traceback" not in err
    latin = tmp_path / "latin1.txt"
    latin.write_bytes(good.read_text().replace("a", "\xe9").encode("latin-1"))
    assert main(["compare", str(latin), str(good), "--ref", ref, "--out", str(tmp_path), "--samples", "10"]) == 2
    err = capsys.readouterr().err
    assert "is not UTF-8 text" in err and "Traceback" not in err


def eval_dir(path: Path, lines: list[str], cut: int) -> Path:
    """An eval output dir as `eval` writes one: predictions (cut to `cut` bytes) and rouge.json's settings."""
    path.mkdir()
    write_lines(path / "predictions.txt", [truncate_bytes(line, cut, whole_words=True) for line in lines])
    (path / "rouge.json").write_text(json.dumps({"settings": {"split": "test", "truncate_bytes": cut}}))
    return path


def test_summaries_cut_by_eval_are_compared_only_at_their_cut(systems, tmp_path, capsys):
    """Summaries eval cut to 30 bytes, scored as full-length F against uncut ones, would show their shortness as a
    significant loss: the cut each was decoded with must be the same for both and the one compared at."""
    from summarizer.__main__ import main
    _, good, _, _ = systems
    ref = str(TINY / "test.jsonl")
    targets = [p["target"] for p in TEST_PAIRS]
    cut30, cut75, full = (eval_dir(tmp_path / name, targets, cut)
                          for name, cut in (("cut30", 30), ("cut75", 75), ("full", 0)))
    for a, b, flag, needle in ((cut30, full, "0", "with 0"), (cut30, cut75, "30", "with 75"),
                               (cut30, good, "0", "--truncate-bytes 30"), (good, cut30, "75", "--truncate-bytes 30")):
        argv = ["compare", str(a), str(b), "--ref", ref, "--out", str(tmp_path / "out"), "--truncate-bytes", flag]
        assert main(argv) == 2, (a, b, flag)
        err = capsys.readouterr().err
        assert err.startswith("error: ") and needle in err and "eval.truncate_bytes=30" in err
        assert "Traceback" not in err and not (tmp_path / "out" / "compare.json").exists()
    argv = ["compare", str(cut30), str(good), "--ref", ref, "--out", str(tmp_path), "--truncate-bytes", "30",
            "--samples", "10"]
    assert main(argv) == 0
    assert "measure: ROUGE recall of the first 30 bytes" in capsys.readouterr().out
    report = json.loads((tmp_path / "compare.json").read_text())
    assert all(m["diff"] == 0 for m in report["metrics"].values())  # the same summaries, cut alike
    assert main(["compare", str(full), str(good), "--ref", ref, "--out", str(tmp_path), "--samples", "10"]) == 0
    assert "measure: ROUGE F-measure, full length" in capsys.readouterr().out
