"""What a user can get wrong: each mistake ends in one clear message (exit 2, no traceback) or the documented
behaviour, and no file the user owns is ever changed. One test per row of the README's "Where things go wrong"."""
import gzip
import io
import json
import os
import shutil
from pathlib import Path

import pytest

from data_prep.__main__ import main as prep
from summarizer.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs/tiny.yaml")
SMALL = ["model.d_model=32", "model.encoder_layers=1", "model.decoder_layers=1", "model.ffn_dim=64",
         "data.batch_tokens=400", "train.log_every=5", "train.eval_every=10", "train.ckpt_every=10",
         "train.rouge_every=0", "train.select_by=loss", "train.warmup_steps=5", "train.sample_summaries=0",
         "eval.bootstrap_samples=10"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("bad") / "data"
    assert prep(["--config", TINY, f"data.dir={data_dir}"]) == 0
    return data_dir


def args(data, run_dir, *extra):
    return ["--config", TINY, f"data.dir={data}", f"run.dir={run_dir}", f"run.tensorboard_dir={run_dir}/tb",
            *SMALL, *extra]


def error_of(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def snapshot(directory: Path) -> dict:
    return {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


# Row 1: the overfit check never deletes a directory it did not make for itself.
def test_overfit_refuses_a_directory_of_the_users_files(data, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    assert main(["overfit", *args(data, mine)]) == 2
    assert "did not write" in error_of(capsys) and snapshot(mine) == {Path("thesis.tex"): b"years of work"}


def test_overfit_refuses_a_training_runs_directory(data, tmp_path, capsys):
    assert main(["train", *args(data, tmp_path / "run", "train.max_steps=10")]) == 0
    before = snapshot(tmp_path / "run")
    assert main(["overfit", *args(data, tmp_path / "run")]) == 2
    assert "not a overfit directory" in error_of(capsys) and snapshot(tmp_path / "run") == before


# Row 2: prep never writes over its own input.
def test_prep_refuses_to_write_into_its_source(tmp_path, capsys):
    source = tmp_path / "raw"
    shutil.copytree(ROOT / "tests/assets/tiny", source)
    before = snapshot(source)
    assert prep(["--config", TINY, f"data.source={source}", f"data.dir={source}"]) == 2
    assert "equals or contains the input" in error_of(capsys) and snapshot(source) == before


def test_prep_refuses_a_directory_of_the_users_files(tmp_path, capsys):
    target = tmp_path / "out"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    assert prep(["--config", TINY, f"data.dir={target}"]) == 2
    assert "did not write" in error_of(capsys) and snapshot(target) == {Path("notes.txt"): b"mine"}


# Row 1 too: a file named like one a run writes does not make a user's directory a run dir (their config.yaml
# was overwritten); only the product's .summarizer marker does.
@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl", "latest.json", "best.pt"])
def test_train_refuses_a_users_directory_holding_a_file_named_like_a_runs(data, tmp_path, capsys, name):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / name).write_text("the user's own\n")
    assert main(["train", *args(data, mine, "train.max_steps=10")]) == 2
    err = error_of(capsys)
    assert f"run.dir={mine} already holds files this product did not write ({name})" in err
    assert "Choose a new or empty directory for run.dir" in err
    assert snapshot(mine) == {Path(name): b"the user's own\n"}


# Rows 3-5: resume compares the new config with the checkpoint's.
@pytest.fixture
def trained(data, tmp_path):
    run = tmp_path / "run"
    assert main(["train", *args(data, run, "train.max_steps=10")]) == 0
    return run


def test_resume_with_a_new_learning_rate_uses_it_and_records_it(data, trained):
    assert main(["train", *args(data, trained, "train.max_steps=20", "train.lr=0.0005")]) == 0
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    lr_20 = next(r["lr"] for r in records if r["split"] == "train" and r["step"] == 20)
    from summarizer.config.load import load_config
    from summarizer.train.optim import lr_factor
    cfg = load_config(TINY, [*SMALL, "train.lr=0.0005"])
    assert lr_20 == pytest.approx(0.0005 * lr_factor(19, cfg.train), abs=1e-6)  # the rate step 20 trained with
    changes = json.loads((trained / "manifest.json").read_text())["config_changes"]
    assert {"step": 10, "key": "train.lr", "old": 0.003, "new": 0.0005} in changes


@pytest.mark.parametrize("override, old, new", [("model.dropout=0.3", "0.1", "0.3"),
                                                ("model.activation=gelu", "'relu'", "'gelu'"),
                                                ("model.d_model=48", "32", "48"),
                                                ("model.bias=true", "False", "True"),
                                                ("data.batch_tokens=600", "400", "600")])
def test_resume_refuses_a_changed_model_or_batch_plan(data, trained, capsys, override, old, new):
    config_before = (trained / "config.yaml").read_bytes()
    assert main(["train", *args(data, trained, "train.max_steps=20", override)]) == 2
    err = error_of(capsys)
    assert f"{override.split('=')[0]}: {old} in the checkpoint, {new} now" in err and "run.name=NEW_NAME" in err
    # what may change instead, as may_change decides it: whole sections and the keys the schema marks
    assert "the run, system, eval, placement, bench, overfit sections and the keys marked resume=True" in err
    assert (trained / "config.yaml").read_bytes() == config_before  # nothing rewritten


# Row 6: an unreadable checkpoint is reported; training resumes from the newest readable one.
@pytest.mark.parametrize("content", [b"", b"just some text\n"])
def test_unreadable_latest_checkpoint_falls_back_to_the_previous(data, tmp_path, capsys, content):
    run = tmp_path / "run"
    assert main(["train", *args(data, run, "train.max_steps=20", "train.keep_last=3")]) == 0
    (run / "ckpt_00000020.pt").write_bytes(content)
    capsys.readouterr()
    assert main(["train", *args(data, run, "train.max_steps=25", "train.keep_last=3")]) == 0
    err = error_of(capsys)
    assert "ckpt_00000020.pt is unreadable" in err and "resuming from ckpt_00000010.pt instead" in err
    assert json.loads((run / "latest.json").read_text())["step"] == 25


def test_eval_with_an_unreadable_best_names_the_checkpoints_that_could_replace_it(data, trained, capsys):
    (trained / "best.pt").write_bytes(b"")
    assert main(["eval", *args(data, trained)]) == 2
    err = error_of(capsys)
    assert "best.pt is unreadable" in err and "ckpt_00000010.pt" in err and "eval.checkpoint=PATH" in err


# Rows 7, 11, 13: settings and config files that cannot work are refused before any work.
@pytest.mark.parametrize("override, message", [
    ("eval.max_len=0", "eval.max_len must be positive"), ("eval.max_len=-3", "eval.max_len must be positive"),
    ("eval.min_len=20", "eval.min_len (20) exceeds eval.max_len (5)"),
    ("model.n_heads=0", "model.n_heads must be positive"), ("train.lr=-1", "train.lr must be positive"),
    ("train.max_minutes=-5", "train.max_minutes must be >= 0"),
])
def test_impossible_settings_are_refused(data, tmp_path, capsys, override, message):
    extra = ["eval.max_len=5"] if override.startswith("eval.min_len") else []
    assert main(["eval", *args(data, tmp_path / "run", *extra, override)]) == 2
    assert message in error_of(capsys)


@pytest.mark.parametrize("content, message", [(b"", "is empty"), (b"train:\n  lr: 0.1\xff\n", "is not UTF-8"),
                                              (None, "is a directory")])
def test_bad_config_files_are_refused(tmp_path, capsys, content, message):
    path = tmp_path / "c.yaml"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    assert main(["train", "--config", str(path)]) == 2
    assert message in error_of(capsys)


# Row 8: a broken gzip input is named, not a traceback.
@pytest.mark.parametrize("content", [b"plain text, not gzip\n", None])
def test_broken_gzip_input_is_named(tmp_path, capsys, content):
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.jsonl").write_text((ROOT / "tests/assets/tiny/train.jsonl").read_text())
    good = gzip.compress((ROOT / "tests/assets/tiny/test.jsonl").read_bytes())
    (src / "test.jsonl.gz").write_bytes(content if content is not None else good[:len(good) // 2])  # or truncated
    assert prep(["--config", TINY, f"data.source={src}", f"data.dir={tmp_path / 'out'}"]) == 2
    assert "test.jsonl.gz is not a readable gzip file" in error_of(capsys)


# Row 9: undecodable input lines are summarised with their bytes replaced, and named.
def test_summarize_survives_non_utf8_input(data, trained, monkeypatch, capsys):
    stdin = b"the mayor opened a park .\ncaf\xe9 owners protest new tax \xff\n\nlast line\n"
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    assert main(["summarize", *args(data, trained)]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 4 and lines[0] and lines[1] and lines[2] == "" and lines[3]
    assert "input line 2 is not valid UTF-8" in err and "Traceback" not in err


# Row 10: output directories that are files or cannot be written.
@pytest.mark.parametrize("key", ["data.dir", "run.dir"])
def test_output_dir_that_is_a_file_is_refused(data, tmp_path, capsys, key):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    if key == "data.dir":
        assert prep(["--config", TINY, f"data.dir={blocker}"]) == 2
    else:
        assert main(["train", *args(data, blocker, "train.max_steps=5")]) == 2
    assert f"{key}={blocker} is an existing file" in error_of(capsys) and blocker.read_text() == "a file"


def test_unwritable_output_dir_is_refused(data, tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked else real_access(p, mode))
    assert main(["train", *args(data, locked, "train.max_steps=5")]) == 2
    assert "is not writable" in error_of(capsys)


# Row 12: an interrupted run exits as shells expect, after its checkpoint (tests/test_train.py sends the signals).


def test_a_closed_pipe_ends_summarize_quietly(trained_run):
    """`summarize ... | head -1`: the reader leaves early; no traceback, no second error at exit."""
    import subprocess
    import sys
    _, args = trained_run
    lines = "".join(f"the mayor opened park number {i} on monday .\n" for i in range(2000))
    cmd = f"{sys.executable} -m summarizer summarize {' '.join(args)} eval.beam_size=1 | head -1"
    proc = subprocess.run(["bash", "-c", cmd], input=lines.encode(), capture_output=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert len(proc.stdout.decode().splitlines()) == 1
    assert b"Traceback" not in proc.stderr and b"BrokenPipe" not in proc.stderr, proc.stderr.decode()[-2000:]


def _write_failed(obj, fh):
    raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 320 vs 256: file write failed")


def _write_failed_in_python(obj, fh):  # the file's own error reached Python first; torch's text names no write
    try:
        raise OSError(27, "File too large")
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 995520 vs 995408")  # noqa: B904


@pytest.mark.parametrize("failure", [_write_failed, _write_failed_in_python])
def test_a_full_disk_at_a_checkpoint_write_is_one_clear_message(trained_run, tmp_path, monkeypatch, capsys,
                                                                failure):
    import torch

    from summarizer.__main__ import main
    monkeypatch.setattr(torch, "save", failure)
    _, args = trained_run
    run_args = [a for a in args if not a.startswith(("run.dir=", "run.tensorboard_dir="))] + [
        f"run.dir={tmp_path / 'run'}", f"run.tensorboard_dir={tmp_path / 'tb'}", "train.max_steps=2",
        "train.ckpt_every=1"]
    assert main(["train", *run_args]) == 1
    err = capsys.readouterr().err
    assert "cannot write the checkpoint" in err and "ckpt_00000001.pt" in err and "Traceback" not in err
    assert not list((tmp_path / "run").glob("*.tmp")) and not list((tmp_path / "run").glob("*.pt"))


def test_each_input_mistake_of_the_second_round_is_one_clear_message(trained_run, tmp_path, capsys):
    """Each case used to end in a traceback or a misleading message."""
    import torch
    tmp, args = trained_run
    ckpt = tmp_path / "bare.pt"
    torch.save({"format_version": 2, "model": {}}, ckpt)
    csv = tmp_path / "pairs.csv"
    csv.write_text("source,target\nthe mayor opened a park,mayor opens park\n")
    cases = {
        f"prepared data dir {tmp_path / 'nodata'} does not exist: prepare it with this command's config and "
        f"overrides: make prep CONFIG=FILE ARGS=\"data.dir={tmp_path / 'nodata'} ...\"": [
            "eval", *args, f"data.dir={tmp_path / 'nodata'}"],
        "pairs.csv:1: malformed JSON: Expecting value at column 1: a pairs file is JSON Lines (.jsonl": [
            "eval", *args, f"eval.pairs={csv}", f"eval.out_dir={tmp_path / 'e0'}"],
        "eval.beam_size": ["eval", *args, "eval.beam_size=200", f"eval.out_dir={tmp_path / 'e1'}"],
        "is a directory: give a .pt file": ["eval", *args, f"eval.checkpoint={tmp / 'run'}",
                                            f"eval.out_dir={tmp_path / 'e2'}"],
        "is a directory: give a pairs file": ["eval", *args, f"eval.pairs={tmp_path}",
                                              f"eval.out_dir={tmp_path / 'e3'}"],
        "lacks config, data_meta": ["eval", *args, f"eval.checkpoint={ckpt}", f"eval.out_dir={tmp_path / 'e4'}"],
        "quote the value to keep it as written (run.name='...' in an override": ["eval", *args, "run.name=2024"],
        "override 'configs/tiny.yaml' must look like key.sub=value (a config file is given as --config "
        "configs/tiny.yaml)": ["eval", *args, "configs/tiny.yaml"],
        "data.splits.valid must be a list": ["eval", *args, "data.splits={train: [train], valid: }"],
        "model.max_positions (512) is shorter": ["eval", *args, "eval.max_len=600"],
    }
    for needle, argv in cases.items():
        assert main(argv) == 2, needle
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, (needle, err)


def test_a_file_as_data_source_and_duplicate_yaml_keys_are_named(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("train:\n  lr: 0.001\n  lr: 0.002\n")
    assert main(["eval", "--config", str(config)]) == 2
    assert "key 'lr' is given twice" in capsys.readouterr().err
    pairs = tmp_path / "train.jsonl"
    pairs.write_text('{"source": "a b c", "target": "a b"}\n')
    assert prep([f"data.source={pairs}", f"data.dir={tmp_path / 'data'}"]) == 2
    assert "is a file; give the directory that holds it" in capsys.readouterr().err


def test_rush_files_with_a_byte_order_mark_and_cr_only_summarize_input(trained_run, tmp_path, monkeypatch, capsys):
    from data_prep.sources import load_splits
    from summarizer.config.load import load_config
    (tmp_path / "train.article.txt").write_bytes("\ufeffthe mayor opened a park .\nrain fell .\n".encode())
    (tmp_path / "train.title.txt").write_bytes("\ufeffmayor opens park\nrain\n".encode())
    cfg = load_config(None, [f"data.source={tmp_path}", "data.splits={train: [train]}"]).data
    splits, _, _ = load_splits(cfg, tmp_path / "cache")
    first = splits["train"][0]
    assert first["source"] == "the mayor opened a park ." and first["target"] == "mayor opens park"
    _, args = trained_run
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"the mayor opened a park .\rrain fell .\r")))
    assert main(["summarize", *args, "eval.beam_size=1"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    monkeypatch.setattr("sys.stdin", None)
    assert main(["summarize", *args]) == 2
    assert "standard input, which is closed" in capsys.readouterr().err


@pytest.mark.slow
def test_a_file_size_limit_at_a_checkpoint_write_is_one_clear_message(data, tmp_path):
    """A real write failure inside torch.save (the limit `ulimit -f` sets): one message naming the file, exit 1,
    the earlier checkpoints intact and no temp file left."""
    import resource
    import subprocess
    import sys
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "summarizer", "train", *args(data, run, "train.max_steps=20")]
    assert subprocess.run(cmd, cwd=ROOT, capture_output=True, timeout=300).returncode == 0
    before = {p.name: p.read_bytes() for p in run.glob("ckpt_*.pt")}
    limit = max(len(b) for b in before.values()) // 2  # above best.pt (no optimizer state), below a step checkpoint

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    proc = subprocess.run([*cmd[:-1], "train.max_steps=30"], cwd=ROOT, capture_output=True, timeout=300,
                          preexec_fn=small_files)
    err = proc.stderr.decode()
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert "ckpt_00000030.pt: " in err and "File too large" in err, err[-1200:]
    assert {p.name: p.read_bytes() for p in run.glob("ckpt_*.pt")} == before and not list(run.glob("*.tmp"))
    assert json.loads((run / "latest.json").read_text())["step"] == 20


@pytest.mark.slow
@pytest.mark.parametrize("command", [["-m", "data_prep", "--config", TINY, "data.num_proc=1"],
                                     ["-m", "summarizer", "train", "--config", TINY]])
def test_ctrl_c_while_the_libraries_load_is_a_clean_exit(tmp_path, command):
    """Ctrl-C while torch or datasets is still importing: exit 130, no traceback. `-X importtime` reports each
    import as it completes, so the signal is sent inside the heavy import, however loaded the machine is."""
    import re
    import signal
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-X", "importtime", *command, f"data.dir={tmp_path / 'data'}",
                             f"run.dir={tmp_path / 'run'}", f"run.tensorboard_dir={tmp_path / 'tb'}"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in proc.stderr:  # "import time: self [us] | cumulative | imported package", one per finished import
        lines.append(line)
        if re.search(r"\|\s+(torch|datasets)\.", line):
            break
    proc.send_signal(signal.SIGINT)
    err = "".join(lines) + proc.stderr.read()
    proc.wait(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert re.search(r"^interrupted", err, re.M)


def test_summarize_with_standard_output_closed_is_one_clear_message(trained_run):
    import subprocess
    import sys
    _, args = trained_run
    proc = subprocess.run([sys.executable, "-m", "summarizer", "summarize", *args], input=b"a line .\n", cwd=ROOT,
                          capture_output=False, stdout=None, stderr=subprocess.PIPE, timeout=300,
                          pass_fds=(), close_fds=True, preexec_fn=lambda: os.close(1))
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "Traceback" not in err and "standard output, which is closed" in err, err[-2000:]


def test_a_pair_without_visible_text_is_refused_with_its_line(tmp_path):
    """A blank source has nothing to summarise (eval made a summary of nothing up, where summarize prints an empty
    line), and a blank reference scores every summary 0: each is a fault of the file, named with its line."""
    from summarizer.data.pairs import read_pairs_file
    from summarizer.errors import DataError
    good = {"source": "the mayor opened a park", "target": "mayor opens park"}
    for bad, needle in (({"source": " \u200b ", "target": "x y"}, "the source is empty"),
                        ({"source": "a b c", "target": ""}, "the reference 1 is empty"),
                        ({"source": "a b", "target": "a", "references": ["a b", "\t"]}, "the reference 2 is empty"),
                        ({"source": "", "target": " "}, "the source and reference 1 are empty")):
        path = tmp_path / "pairs.jsonl"
        path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(DataError, match=f"pairs.jsonl:2: {needle}"):
            read_pairs_file(path)
    path.write_text(json.dumps(good) + "\n" + json.dumps({"source": "a b c", "target": ""}) + "\n")
    assert [p["source"] for p in read_pairs_file(path, need_target=False)] == [good["source"], "a b c"]


# eval and summarize apply the prepared dir's normalisation and vocabulary (meta.json), whatever the config says.
@pytest.mark.parametrize("command, override, named", [
    ("summarize", "data.lowercase=false", "data.lowercase=False (prepared with True)"),
    ("eval", "data.vocab_size=999", "data.vocab_size=999 (prepared with 160)"),
    ("eval", "data={lowercase: false}", "data.lowercase=False (prepared with True)"),
])
def test_a_data_key_given_on_the_command_line_against_the_prepared_data_is_refused(trained_run, monkeypatch, capsys,
                                                                                  command, override, named):
    """A value given on the command line is one the user means: applied from meta.json instead, it would be
    silently not used. Refused, as train and prep refuse it, before anything is read or written."""
    _, args = trained_run
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"At least 15 people died in Norway\n")))
    assert main([command, *args, override]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err and err.count("error:") == 1
    assert named in err and "contradicts the prepared data in data.dir=" in err
    assert "leave those keys off the command line" in err


def test_data_keys_only_in_the_config_file_are_applied_as_prepared(trained_run, tmp_path, monkeypatch, capsys):
    """`make eval ARGS="data.dir=data/gw"` with a config of other normalisation evaluates the data as it was
    prepared: a config file's data keys are no request, and a command-line key that agrees with the dir is none."""
    tmp, args = trained_run
    config = tmp_path / "other.yaml"
    config.write_text(f"extends: {TINY}\ndata:\n  lowercase: false\n  vocab_size: 999\n")
    mine = ["--config", str(config), *args[2:], "data.mask_digits=true", "eval.beam_size=1"]
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"At least 15 people died in Norway\n")))
    assert main(["summarize", *mine]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
    assert main(["eval", *mine, "eval.limit=3", f"eval.out_dir={tmp_path / 'eval'}"]) == 0
    assert (tmp_path / "eval" / "predictions.txt").read_text().count("\n") == 3
