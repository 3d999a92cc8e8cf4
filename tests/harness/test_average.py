import json
import shutil

import pytest
import torch

from summarizer.config.load import load_config
from summarizer.errors import CheckpointError
from summarizer.harness.average import average_checkpoints, checkpoints_by_step
from summarizer.model import checkpoint


@pytest.fixture
def trained(trained_run):
    """The session's tiny run (step checkpoints 20, 30 and 40 kept), evaluated on 8 pairs, greedy."""
    tmp, args = trained_run
    assert [p.name for p in checkpoints_by_step(tmp / "run")] == [f"ckpt_{s:08d}.pt" for s in (20, 30, 40)]
    return tmp, [*args, "eval.beam_size=1", "eval.limit=8"]


def test_average_of_two_equals_the_hand_mean(trained, capsys):
    from summarizer.__main__ import main
    tmp, args = trained
    assert main(["average", *args]) == 0  # every step checkpoint the run kept
    assert "averaged steps 20, 30, 40 into" in capsys.readouterr().err
    assert main(["average", *args, "--last", "2"]) == 0
    out = tmp / "run" / "averaged_last2.pt"
    err = capsys.readouterr().err
    # a dir of its own: evaluated into the run dir, it would replace best.pt's rouge.json
    assert f"eval.checkpoint={out} eval.out_dir=evals/tiny-averaged_last2 " in err
    averaged = checkpoint.load(out)
    a, b = (checkpoint.load(checkpoint.step_path(tmp / "run", s)) for s in (30, 40))
    assert averaged["step"] == 40 and [x["step"] for x in averaged["averaged_from"]] == [30, 40]
    assert averaged["config"] == b["config"] and averaged["data_meta"] == b["data_meta"]
    assert "optimizer" not in averaged
    assert set(averaged["model"]) == set(a["model"])
    for name, tensor in averaged["model"].items():
        hand = ((a["model"][name].double() + b["model"][name].double()) / 2).to(b["model"][name].dtype)
        assert tensor.dtype == b["model"][name].dtype and torch.equal(tensor, hand), name
    assert any(not torch.equal(averaged["model"][k], b["model"][k]) for k in b["model"])  # steps 30 and 40 differ


def test_eval_accepts_the_averaged_checkpoint(trained):
    from summarizer.__main__ import main
    tmp, args = trained
    out = tmp / "run" / "averaged_last3.pt"
    assert main(["average", *args, "--last", "3"]) == 0
    assert main(["eval", *args, f"eval.checkpoint={out}", f"eval.out_dir={tmp / 'eval'}"]) == 0
    report = json.loads((tmp / "eval" / "rouge.json").read_text())
    assert report["settings"]["checkpoint"] == {"path": str(out), "step": 40}
    assert len((tmp / "eval" / "predictions.txt").read_text().splitlines()) == 8


def test_one_checkpoint_averages_to_itself(trained):
    tmp, args = trained
    out, steps = average_checkpoints(load_config(args[1], args[2:]), 1)
    assert steps == [40] and out.name == "averaged_last1.pt"
    mine, newest = checkpoint.load(out)["model"], checkpoint.load(checkpoint.step_path(tmp / "run", 40))["model"]
    assert all(torch.equal(mine[k], newest[k]) for k in newest)


def test_too_few_or_bad_n_is_refused_with_the_count(trained, tmp_path, capsys):
    from summarizer.__main__ import main
    _, args = trained
    assert main(["average", *args, "--last", "5"]) == 2
    err = capsys.readouterr().err
    assert "holds 3 step checkpoint(s)" in err and "train.keep_last=5" in err and "Traceback" not in err
    assert main(["average", *args, "--last", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err
    assert main(["average", *args[:2], "run.dir=/nonexistent/run", "--last", "2"]) == 2
    assert "does not exist" in capsys.readouterr().err
    (a_file := tmp_path / "a.txt").write_text("notes\n")
    assert main(["average", *args[:2], f"run.dir={a_file}", "--last", "2"]) == 2
    assert f"run dir {a_file} is a file: set run.name" in capsys.readouterr().err


@pytest.mark.parametrize("section,key,value,needle", [
    ("config", "model", {"d_model": 48}, "another model config"),
    ("data_meta", "spm_sha256", "0" * 64, "tokenizer sha256")])
def test_mixed_models_or_tokenizers_are_refused_naming_the_files(trained, tmp_path, section, key, value, needle):
    tmp, args = trained
    for step in (30, 40):
        shutil.copy(checkpoint.step_path(tmp / "run", step), checkpoint.step_path(tmp_path, step))
    odd = checkpoint.step_path(tmp_path, 40)
    state = checkpoint.load(odd)
    state[section][key] = {**state[section][key], **value} if isinstance(value, dict) else value
    checkpoint.save({k: v for k, v in state.items() if k != "format_version"}, odd)
    cfg = load_config(args[1], [*args[2:], f"run.dir={tmp_path}"])
    with pytest.raises(CheckpointError, match=needle) as info:
        average_checkpoints(cfg, 2)
    assert odd.name in str(info.value) and checkpoint.step_path(tmp_path, 30).name in str(info.value)
    assert not (tmp_path / "averaged_last2.pt").exists()
