import json

import pytest

from summarizer.evaluate import rouge_report, unify_unk


def test_rouge_of_a_text_against_itself_is_100():
    texts = ["police arrest suspect in bank robbery", "storm cuts power to thousands"]
    report = rouge_report(texts, [[t] for t in texts], samples=50)
    for kind in ("rouge1", "rouge2", "rougeL"):
        assert report[kind]["f"] == pytest.approx(100.0)
        assert report[kind]["f_ci"] == pytest.approx([100.0, 100.0])


def test_multi_reference_takes_the_best_reference():
    pred = ["police arrest suspect"]
    single = rouge_report(pred, [["storm cuts power"]], samples=10)
    multi = rouge_report(pred, [["storm cuts power", "police arrest suspect"]], samples=10)
    assert single["rouge1"]["f"] == 0.0 and multi["rouge1"]["f"] == pytest.approx(100.0)


def test_unk_spellings_score_alike():
    assert unify_unk("a UNK b <unk> c") == "a unk b unk c"
    assert unify_unk("UNKNOWN <unk>s") == "UNKNOWN <unk>s"
    report = rouge_report(["talks on UNK deal"], [["talks on <unk> deal"]], samples=10)
    assert report["rouge1"]["f"] == pytest.approx(100.0)


def test_confidence_interval_brackets_the_mean():
    preds = ["a b c", "a b d", "x y z", "a q c", "b c d"]
    refs = [["a b c"], ["a b c"], ["a b c"], ["a b c"], ["a b c"]]
    r = rouge_report(preds, refs, samples=200)["rouge1"]
    assert r["f_ci"][0] <= r["f"] <= r["f_ci"][1] and r["f_ci"][0] < r["f_ci"][1]
    assert json.dumps(r)  # plain floats, serialisable


@pytest.fixture(scope="module")
def trained_tiny(tmp_path_factory):
    from pathlib import Path

    from data_prep.__main__ import main as prep
    from summarizer.__main__ import main
    root = Path(__file__).resolve().parents[1]
    tmp = tmp_path_factory.mktemp("e2e")
    args = ["--config", str(root / "configs/tiny.yaml"), f"data.dir={tmp / 'data'}", f"run.dir={tmp / 'run'}",
            f"run.tensorboard_dir={tmp / 'tb'}", "train.max_steps=40", "train.eval_every=20", "model.d_model=32",
            "model.ffn_dim=64", "eval.bootstrap_samples=20"]
    assert prep(args[:4]) == 0
    assert main(["train", *args]) == 0
    return tmp, args


def test_eval_writes_predictions_and_report(trained_tiny, capsys):
    from summarizer.__main__ import main
    tmp, args = trained_tiny
    assert main(["eval", *args, "eval.beam_size=2", f"eval.out_dir={tmp / 'eval'}"]) == 0
    predictions = (tmp / "eval" / "predictions.txt").read_text().splitlines()
    report = json.loads((tmp / "eval" / "rouge.json").read_text())
    assert len(predictions) == 40  # one line per test pair, in order
    for kind in ("rouge1", "rouge2", "rougeL"):
        assert set(report[kind]) == {"f", "p", "r", "f_ci"} and 0 <= report[kind]["f"] <= 100
    assert set(report["lead"]) == {"lead-8", "lead-10", "lead-12"}
    assert report["settings"]["beam_size"] == 2 and report["sentences_per_s"] > 0


def test_summarize_reads_stdin_and_writes_one_line_each(trained_tiny, monkeypatch, capsys):
    import io

    from summarizer.__main__ import main
    _, args = trained_tiny
    text = "The Mayor of Springfield opened 3 parks on Monday.\n\nSecond line\n"
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    assert main(["summarize", *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[1] == "" and lines[0]


def test_missing_checkpoint_and_tokenizer_mismatch_are_clear(trained_tiny, capsys):
    from data_prep.__main__ import main as prep
    from summarizer.__main__ import main
    tmp, args = trained_tiny
    assert main(["eval", *args, f"eval.checkpoint={tmp / 'nope.pt'}"]) == 2
    assert "does not exist" in capsys.readouterr().err
    other = [f"data.dir={tmp / 'other'}", "data.vocab_size=120"]
    assert prep(args[:2] + other) == 0
    assert main(["eval", *args, *other]) == 2
    assert "tokenizer mismatch" in capsys.readouterr().err


def test_eval_builds_the_checkpoints_own_model_whatever_the_current_config(trained_tiny):
    from summarizer.__main__ import main
    tmp, args = trained_tiny
    assert main(["eval", *args, "model.d_model=48", "model.encoder_layers=1", "eval.limit=4",
                 f"eval.out_dir={tmp / 'other_config'}"]) == 0
    assert len((tmp / "other_config" / "predictions.txt").read_text().splitlines()) == 4
