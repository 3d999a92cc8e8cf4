import csv
import io
import json
from pathlib import Path

import pytest
import torch

from summarizer.config.load import load_config, save_config
from summarizer.harness.report import collect, markdown
from summarizer.model import checkpoint
from summarizer.train.watch.monitor import write_manifest

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "configs" / "base.yaml"


def make_run(root: Path, name: str, overrides: list[str], valid_rouge: list[float], evaluated: bool) -> Path:
    """A run dir as train and eval write it: config.yaml, manifest.json, metrics.jsonl, checkpoint + pointer."""
    cfg = load_config(BASE, [f"run.name={name}", f"run.dir={root / name}", "data.dir=data/elsewhere", *overrides])
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True)
    save_config(cfg, run_dir / "config.yaml")
    write_manifest(cfg, run_dir, [torch.device("cpu")], "bf16", {"spm_sha256": "x"}, 1)
    records = [{"step": 50, "split": "train", "loss": 5.0}]
    records += [{"step": 100 * (i + 1), "split": "valid", "loss": 4.0, "rouge1": r, "rouge2": r / 3,
                 "rougeL": r - 2} for i, r in enumerate(valid_rouge)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    progress = {"step": 300, "epoch": 1, "position": 0, "elapsed_s": 750.0, "best": None, "bad_evals": 0}
    checkpoint.save_step({"step": 300, "progress": progress, "model": {"w": torch.zeros(2)}}, run_dir, 2)
    if evaluated:
        report = {k: {"f": f, "p": f, "r": f, "f_ci": [f - 1.2, f + 1.1]}
                  for k, f in (("rouge1", 35.7), ("rouge2", 15.9), ("rougeL", 33.5))}
        report.update(settings={"split": "test", "pairs": 2000}, sentences_per_s=103.4)
        (run_dir / "rouge.json").write_text(json.dumps(report))
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    make_run(root, "lr2e-3", ["train.lr=0.002", "model.copy=false", "bench.repeats=9"], [30.0, 34.0], True)
    make_run(root, "recipe", [], [30.0, 35.14, 33.0], False)
    make_run(root, "untested", ["train.rouge_every=0", "train.select_by=loss"], [], False)
    (root / "junk").mkdir()
    (root / "seeds_x.json").write_text("{}")
    return root


def test_markdown_table_shows_diff_progress_provenance_and_rouge(runs, capsys):
    from summarizer.__main__ import main
    assert main(["report", "--root", str(runs)]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith("| run | differs from recipe | steps | minutes |") and len(lines) == 5
    evaluated = next(line for line in lines if line.startswith("| lr2e-3 "))
    cells = [c.strip() for c in evaluated.strip("|").split("|")]
    assert cells[1] == "model.copy=false, train.lr=0.002"  # no run.*/data.dir bookkeeping, no bench section
    assert cells[2:5] == ["300", "12.5", "bf16"]
    assert cells[6].endswith("(dirty)") or len(cells[6]) == 8  # commit of this checkout, dirty or not
    assert cells[7:] == ["test (2000)", "35.7 [34.5–36.8]", "15.9 [14.7–17.0]", "33.5 [32.3–34.6]", "103",
                         "—"]  # a run without FLOPs logged
    assert "note: skipped" in captured.err and "junk" in captured.err and "seeds_x" not in captured.err


def test_an_evaluation_in_recall_at_n_bytes_shows_recall_and_says_so(tmp_path, capsys):
    """DUC's measure: rouge.json's recall, named in the eval column, not the F of truncated summaries."""
    from summarizer.__main__ import main
    run_dir = make_run(tmp_path, "duc", [], [30.0], True)
    report = json.loads((run_dir / "rouge.json").read_text())
    for kind in ("rouge1", "rouge2", "rougeL"):
        report[kind].update(r=report[kind]["f"] - 10, r_ci=[1.0, 2.0], f_ci=None)
    report["settings"].update(truncate_bytes=75)
    (run_dir / "rouge.json").write_text(json.dumps(report))
    assert main(["report", "--root", str(tmp_path)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| duc "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[7:10] == ["test (2000), recall@75", "25.7 [1.0–2.0]", "5.9 [1.0–2.0]"]


def test_an_evaluation_of_another_checkpoint_than_best_names_it(tmp_path, capsys):
    """`eval eval.checkpoint=RUN/ckpt_...` writes into the run dir: its ROUGE is not the run's best.pt's, and the row
    says which checkpoint it scored beside the run's steps."""
    from summarizer.__main__ import main
    run_dir = make_run(tmp_path, "early", [], [30.0], True)
    report = json.loads((run_dir / "rouge.json").read_text())
    for path, step in ((run_dir / "best.pt", 300), (run_dir / "ckpt_00000050.pt", 50)):
        report["settings"]["checkpoint"] = {"path": str(path), "step": step}
        (run_dir / "rouge.json").write_text(json.dumps(report))
        assert main(["report", "--root", str(tmp_path)]) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| early "))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2] == "300" and cells[8] == "35.7 [34.5–36.8]"
        assert cells[7] == ("test (2000)" if step == 300 else "test (2000), ckpt_00000050.pt (step 50)")
    assert main(["report", "--root", str(tmp_path), "--csv"]) == 0
    [row] = csv.DictReader(io.StringIO(capsys.readouterr().out))
    assert row["eval_checkpoint"] == "ckpt_00000050.pt" and row["eval_step"] == "50"


def test_an_evaluation_of_a_best_pt_training_has_replaced_since_names_the_step_it_scored(tmp_path, capsys):
    """rouge.json scored best.pt at step 30, then the run trained on and best.pt is step 60's: its ROUGE is no longer
    the run's best.pt's, and the row says which step it scored and which best.pt holds now."""
    from summarizer.__main__ import main
    run_dir = make_run(tmp_path, "resumed", [], [30.0], True)
    report = json.loads((run_dir / "rouge.json").read_text())
    report["settings"]["checkpoint"] = {"path": str(tmp_path / "copied_from" / "best.pt"), "step": 30}
    (run_dir / "rouge.json").write_text(json.dumps(report))
    for best, cell in ((30, "test (2000)"), (60, "test (2000), best.pt (step 30, now 60)")):
        checkpoint.save({"step": best, "model": {"w": torch.zeros(2)}}, run_dir / checkpoint.BEST)
        assert main(["report", "--root", str(tmp_path)]) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| resumed "))
        assert [c.strip() for c in row.strip("|").split("|")][7:9] == [cell, "35.7 [34.5–36.8]"]
    assert main(["report", "--root", str(tmp_path), "--csv"]) == 0
    [row] = csv.DictReader(io.StringIO(capsys.readouterr().out))
    assert (row["eval_checkpoint"], row["eval_step"], row["best_step"]) == ("best.pt", "30", "60")


def test_an_evaluations_eval_settings_are_the_ones_its_rouge_json_records(tmp_path):
    """Two evaluations of copies of one run, greedy without word rules and 10 resamples against the recipe's: the
    rows differ as their ROUGE does, from each rouge.json's settings, not config.yaml's eval section (training's):
    what auto chose, and what the file does not record, are not claimed."""
    trained = ["model.copy=false", "eval.beam_size=2", "eval.no_repeat_words=false", "eval.limit=9"]
    recorded = {"split": "test", "pairs": 2000, "pairs_file": None, "beam_size": 4, "max_len": 30, "min_len": 8,
                "length_penalty": 2.0, "no_repeat_ngram": 3, "known_words": True, "truncate_bytes": 0,
                "bootstrap_samples": 1000, "quantize": "int8", "precision": "fp32", "shapes": "dynamic",
                "batch_tokens": 16384}  # no no_repeat_words: as an older file
    evals = {"recipe_eval": {}, "greedy": {"beam_size": 1, "known_words": False, "bootstrap_samples": 10},
             "duc": {"split": "duc.jsonl.gz", "pairs_file": "/data/duc.jsonl.gz", "truncate_bytes": 75}}
    for name, changed in evals.items():
        run_dir = make_run(tmp_path, name, trained, [30.0], True)
        report = json.loads((run_dir / "rouge.json").read_text())
        report["settings"] = {**recorded, **changed}
        (run_dir / "rouge.json").write_text(json.dumps(report))
    make_run(tmp_path, "not_evaluated", trained, [30.0], False)
    rows = {row["run"]: row["differs"] for row in collect([], tmp_path, BASE)}
    assert rows == {"recipe_eval": ["model.copy=false"],
                    "greedy": ["eval.beam_size=1", "eval.bootstrap_samples=10", "eval.known_words=false",
                               "model.copy=false"],
                    "duc": ["eval.pairs=/data/duc.jsonl.gz", "eval.truncate_bytes=75", "model.copy=false"],
                    "not_evaluated": ["eval.beam_size=2", "eval.limit=9", "eval.no_repeat_words=false",
                                      "model.copy=false"]}  # its valid ROUGE was measured with them


def test_rouge_json_records_the_eval_settings_report_compares():
    from summarizer.evaluation.evaluate import settings
    from summarizer.harness.report import AUTO, EVAL_RECORDED
    cfg = load_config(BASE, ["eval.beam_size=1", "eval.bootstrap_samples=10", "eval.no_repeat_words=false"])
    pairs = [{"source": "s", "target": "t"}] * 5
    recorded = settings(cfg, "test", pairs, {"quantize": "none", "path": "best.pt", "step": 1}, "fp32")
    assert all(recorded[key] == getattr(cfg.eval, key) for key in EVAL_RECORDED if key not in AUTO)


def test_an_evaluation_on_other_code_than_training_names_both_commits(tmp_path, capsys):
    """rouge.json's git_commit and git_dirty (absent in older files): the commit cell adds the evaluation's where it
    ran on other code than training did."""
    from summarizer.__main__ import main
    run_dir = make_run(tmp_path, "evaluated", [], [30.0], True)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest.update(git_commit="abc12345" * 5, git_dirty=False)
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    report = json.loads((run_dir / "rouge.json").read_text())
    cases = (({}, "abc12345"), ({"git_commit": "abc12345" * 5, "git_dirty": False}, "abc12345"),
             ({"git_commit": "def45678" * 5, "git_dirty": False}, "abc12345, eval def45678"),
             ({"git_commit": "abc12345" * 5, "git_dirty": True}, "abc12345, eval abc12345 (dirty)"))
    for recorded, cell in cases:
        (run_dir / "rouge.json").write_text(json.dumps({**report, "settings": {**report["settings"], **recorded}}))
        assert main(["report", "--root", str(tmp_path)]) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| evaluated "))
        assert [c.strip() for c in row.strip("|").split("|")][6] == cell
    assert main(["report", "--root", str(tmp_path), "--csv"]) == 0
    [row] = csv.DictReader(io.StringIO(capsys.readouterr().out))
    assert (row["commit"], row["eval_commit"], row["eval_dirty"]) == ("abc12345" * 5, "abc12345" * 5, "True")


def test_a_run_without_evaluation_shows_its_best_valid_rouge_marked(runs, capsys):
    rows = {row["run"]: row for row in collect([], runs)}
    table = markdown(list(rows.values()))
    line = next(line for line in table.splitlines() if line.startswith("| recipe "))
    assert "(recipe)" in line and "35.1 (valid)" in line and "11.7 (valid)" in line and "valid, step 200" in line
    untested = next(line for line in table.splitlines() if line.startswith("| untested "))
    assert "train.rouge_every=0, train.select_by=loss" in untested and untested.count("—") >= 4


def test_csv_has_one_row_per_run_with_raw_numbers(runs, capsys):
    from summarizer.__main__ import main
    assert main(["report", str(runs / "lr2e-3"), str(runs / "recipe"), "--csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["run"] for r in rows] == ["lr2e-3", "recipe"]
    assert float(rows[0]["rouge1_low"]) == pytest.approx(34.5) and rows[0]["rouge_from"] == "eval"
    assert rows[1]["rouge_from"] == "valid" and float(rows[1]["rouge1"]) == pytest.approx(35.14)
    assert float(rows[0]["minutes"]) == 12.5 and rows[0]["differs"] == "model.copy=false train.lr=0.002"


def test_empty_or_missing_checkpoints_dir_fails_clearly(tmp_path, capsys):
    from summarizer.__main__ import main
    assert main(["report", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no run dirs in") and "make report DIRS=" in err and "Traceback" not in err
    assert main(["report", "--root", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "skipped" in capsys.readouterr().err


def test_a_config_this_code_no_longer_reads_is_diffed_as_written(runs, tmp_path, capsys):
    old = tmp_path / "old"
    old.mkdir()
    text = (runs / "recipe" / "config.yaml").read_text().replace("\ntrain:\n", "\ntrain:\n  retired_key: 3\n", 1)
    (old / "config.yaml").write_text(text)
    [row] = collect([str(old)])
    assert row["differs"] == ["train.retired_key=3"] and "retired_key" in capsys.readouterr().err
    assert row["steps"] is None and row["rouge_from"] is None
    (old / "config.yaml").write_text("train: [\n")
    assert collect([str(old)])[0]["differs"] == ["(config.yaml unreadable)"]


def test_a_recipes_stages_are_rows_named_with_their_recipe(tmp_path):
    make_run(tmp_path, "plain", [], [30.0], False)
    make_run(tmp_path, "two_stage/pretrain", ["train.select_by=loss"], [], False)
    make_run(tmp_path, "two_stage/finetune", [], [31.0], True)
    rows = collect([], tmp_path, BASE)
    assert [r["run"] for r in rows] == ["plain", "two_stage/finetune", "two_stage/pretrain"]
    assert [r["run"] for r in collect([str(tmp_path / "two_stage")], tmp_path, BASE)] == [
        "two_stage/finetune", "two_stage/pretrain"]


def test_a_run_resumed_with_other_rouge_settings_reports_its_best_among_rouge_measured_alike(tmp_path):
    """Steps 100-200 scored summaries of up to 30 pieces, then the run resumed with 4: step 200's 35.0 says nothing
    against step 300's 20.0; best.pt (step 200), re-scored under the new settings at 300, is 22.0."""
    run = make_run(tmp_path, "resumed", [], [], False)
    long, short = {"eval.max_len": 30}, {"eval.max_len": 4}
    records = [{"step": 100, "split": "valid", "rouge1": 30.0, "rouge2": 10.0, "rougeL": 28.0, "rouge_settings": long},
               {"step": 200, "split": "valid", "rouge1": 35.0, "rouge2": 12.0, "rougeL": 33.0, "rouge_settings": long},
               {"step": 300, "split": "valid", "rouge1": 20.0, "rouge2": 8.0, "rougeL": 19.0, "rouge_settings": short,
                "best_step": 200, "best_rouge1": 22.0, "best_rouge2": 9.0, "best_rougeL": 21.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    [row] = collect([str(run)])
    assert (row["valid_step"], row["rouge1"], row["rouge2"], row["rougeL"]) == (200, 22.0, 9.0, 21.0)
    records.append({"step": 400, "split": "valid", "rouge1": 24.0, "rouge2": 9.5, "rougeL": 23.0,
                    "rouge_settings": short})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    [row] = collect([str(run)])
    assert (row["valid_step"], row["rouge1"]) == (400, 24.0)
    for record in records[:2]:  # written before records named their settings: alike, until a re-score says not
        del record["rouge_settings"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert collect([str(run)])[0]["valid_step"] == 400
    del records[2]["best_step"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert (collect([str(run)])[0]["valid_step"], collect([str(run)])[0]["rouge1"]) == (200, 35.0)
