"""Tests for summarizer/train/stages.py and `config.load.load_stages`: a recipe of stages in one command, each
stage its own run from the weights of the one before, a killed recipe resumed in the stage it was in."""
import json
import os
import signal
from pathlib import Path

import pytest
import torch
import yaml

from summarizer.config.load import load_config, load_stages
from summarizer.errors import ConfigError
from summarizer.model import checkpoint
from summarizer.train.stages import is_finished, resolve_start, training_finished
from tests.processes import ROOT, train_process, wait_for

SMALL = ["model.d_model=32", "model.n_heads=4", "model.encoder_layers=1", "model.decoder_layers=1",
         "model.ffn_dim=64", "data.batch_tokens=400", "data.num_workers=0", "train.log_every=5",
         "train.warmup_steps=10", "train.sample_summaries=0", "train.module_stats=false", "train.eval_every=100",
         "train.rouge_every=0", "train.select_by=loss"]


def recipe(tmp_path, stages=None) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "extends": str(ROOT / "configs/tiny.yaml"), "run": {"name": "recipe"},
        "stages": stages if stages is not None else [
            {"name": "first", "train": {"max_steps": 6}},
            {"name": "second", "train": {"max_steps": 4, "lr": 5e-4}, "data": {"subword_alpha": 0.1}}]}))
    return path


def test_each_stage_is_a_run_of_its_own_from_the_weights_before_it(tmp_path):
    (a, first), (b, second) = load_stages(recipe(tmp_path), ["train.seed=7"])
    assert (a, b) == ("first", "second")
    assert (first.run_dir, second.run_dir) == (Path("checkpoints/recipe/first"), Path("checkpoints/recipe/second"))
    assert second.tensorboard_dir == Path("runs/recipe/second")
    assert (first.train.max_steps, second.train.max_steps) == (6, 4)
    assert second.train.lr == 5e-4 != first.train.lr
    assert (first.data.subword_alpha, second.data.subword_alpha) == (0, .1)
    assert first.train.seed == second.train.seed == 7  # an override applies to every stage
    assert first.train.init_from == "" and second.train.init_from == "checkpoints/recipe/first/ckpt_00000006.pt"
    (_, first), (_, second) = load_stages(recipe(tmp_path), [f"run.dir={tmp_path}/r", "train.max_steps=3"])
    assert first.run_dir == tmp_path / "r" / "first"
    assert second.train.init_from == f"{tmp_path}/r/first/ckpt_00000003.pt"
    # eval and summarize use the last stage
    assert load_config(recipe(tmp_path)).run.name == "recipe/second"


def test_a_stage_may_name_where_it_starts(tmp_path):
    stages = [{"name": "first"}, {"name": "second", "train": {"init_from": "elsewhere/best.pt"}}]
    assert load_stages(recipe(tmp_path, stages))[1][1].train.init_from == "elsewhere/best.pt"


def test_a_config_without_stages_is_one_run():
    [(name, cfg)] = load_stages(ROOT / "configs/base.yaml")
    assert name == "" and cfg.run_dir == Path("checkpoints/base") and cfg.train.init_from == ""


@pytest.mark.parametrize("stages, message", [
    ([], "is a list of stages"),
    ("first", "is a list of stages"),
    ([{"train": {"max_steps": 5}}], "plain `name`"),
    ([{"name": "a b"}], "plain `name`"),
    ([{"name": "a"}, {"name": "a"}], "two stages are named 'a'"),
    ([{"name": "a"}, {"name": "b", "data": {"dir": "elsewhere"}}], "stages share one prepared data dir"),
    ([{"name": "a", "trian": {}}], "unknown config key 'trian'"),
    ([{"name": "a", "train": {"max_steps": 0}}], "train.max_steps must be positive"),
])
def test_bad_stages_are_refused(tmp_path, stages, message):
    with pytest.raises(ConfigError, match=message):
        load_stages(recipe(tmp_path, stages))


def test_shipped_recipe_chains_its_stages():
    (_, pre), (_, fine) = load_stages(ROOT / "configs/two_stage.yaml")
    assert pre.data.dir == fine.data.dir
    assert pre.data.source_weights["news"] == 1 and fine.data.source_weights == {"news": 0}
    assert fine.train.init_from == str(pre.run_dir / f"ckpt_{pre.train.max_steps:08d}.pt")
    assert pre.train.max_steps + fine.train.max_steps == 10_000


def test_finished_means_stopped_for_good():
    t = load_config(None, ["train.max_steps=4", "train.max_minutes=1", "train.patience=2"]).train
    base = {"step": 3, "elapsed_s": 10.0, "bad_evals": 0}
    assert not is_finished(base, t)  # stopped by a signal or a kill
    assert is_finished({**base, "elapsed_s": 60.0}, t)
    assert is_finished({**base, "bad_evals": 2}, t)
    assert is_finished({**base, "step": 4}, t)


def test_a_finished_run_stands_only_for_a_config_that_could_resume_it(tiny_data, tmp_path):
    """`train` (and `seeds`) on a finished run of another model or recipe must not answer with that run's weights:
    it is refused as a resume would be; a change a resume may make (eval, max_steps kept) finds it finished."""
    from summarizer.train.loop import train
    args = [f"data.dir={tiny_data}", f"run.dir={tmp_path / 'run'}", f"run.tensorboard_dir={tmp_path / 'tb'}", *SMALL,
            "train.max_steps=4"]
    train(load_config(ROOT / "configs/tiny.yaml", args))
    assert training_finished(load_config(ROOT / "configs/tiny.yaml", [*args, "eval.beam_size=2"])) == 4
    for change in ("model.d_model=64", "train.label_smoothing=0.2"):
        with pytest.raises(ConfigError, match=f"{change.split('=')[0]}: .* in the checkpoint"):
            training_finished(load_config(ROOT / "configs/tiny.yaml", [*args, change]))
    gone = [*args, f"data.dir={tmp_path / 'removed'}"]  # its data removed once trained: the config alone decides
    assert training_finished(load_config(ROOT / "configs/tiny.yaml", gone)) == 4
    with pytest.raises(ConfigError, match="model.d_model: .* in the checkpoint"):
        training_finished(load_config(ROOT / "configs/tiny.yaml", [*gone, "model.d_model=64"]))


def test_a_stage_after_one_that_ended_early_starts_from_its_last_checkpoint(tmp_path):
    (_, first), (_, second) = load_stages(recipe(tmp_path), [f"run.dir={tmp_path}/r"])
    resolve_start(first, second)  # nothing trained yet: the path stays, and training it says it is missing
    assert second.train.init_from == str(first.run_dir / "ckpt_00000006.pt")
    checkpoint.save_step({"step": 3, "progress": {}, "model": {}}, first.run_dir, 2)  # stopped early at step 3
    resolve_start(first, second)
    assert second.train.init_from == str(first.run_dir / "ckpt_00000003.pt")
    second.train.init_from = "elsewhere/best.pt"  # a start the stage names itself is left alone
    resolve_start(first, second)
    assert second.train.init_from == "elsewhere/best.pt"


def test_a_signal_after_a_stages_last_validation_leaves_the_recipe_stopped_not_finished(tmp_path, monkeypatch,
                                                                                         capsys):
    """A stop signal that comes once a stage has done all its steps ends that stage's run for good, but the
    stages after it were never trained: the exit status is a stop's (128 + the signal), so a scheduler that
    requeues stopped jobs runs the rest; the last stage's run ended so exits 0."""
    from summarizer.__main__ import main
    from summarizer.train import stages as stages_mod
    trained = []

    def signalled(cfg):
        trained.append(cfg.run_dir.name)
        return {"signal": signal.SIGTERM, "finished": True, "steps": cfg.train.max_steps, "minutes": 0.1,
                "best": None, "run_dir": cfg.run_dir, "owes_validation": False}
    monkeypatch.setattr(stages_mod, "train", signalled)
    args = ["train", "--config", str(recipe(tmp_path)), f"run.dir={tmp_path / 'run'}"]
    assert main(args) == 128 + signal.SIGTERM and trained == ["first"]
    assert "run the same command again to train the 1 stage(s) left" in capsys.readouterr().err
    monkeypatch.setattr(stages_mod, "training_finished", lambda cfg: 6 if cfg.run_dir.name == "first" else None)
    assert main(args) == 0 and trained == ["first", "second"]


def latest_step(run_dir) -> int:
    return json.loads((Path(run_dir) / checkpoint.LATEST).read_text())["step"]


def _stop_when(path: Path, proc) -> tuple[int, str]:
    wait_for(path, proc)
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return rc, proc.stdout.read().decode()


@pytest.mark.slow
def test_a_recipe_killed_in_each_stage_resumes_in_that_stage(tiny_data, tmp_path):
    stages = [{"name": "first", "train": {"max_steps": 60}}, {"name": "second", "train": {"max_steps": 60}}]
    path, run = recipe(tmp_path, stages), tmp_path / "run"
    args = [f"data.dir={tiny_data}", f"run.dir={run}", f"run.tensorboard_dir={tmp_path}/tb", *SMALL]

    def launch():
        return train_process(args, new_session=True, config=path)

    rc, out = _stop_when(run / "first" / "metrics.jsonl", launch())  # killed in the first stage
    assert rc == 128 + signal.SIGTERM and "stage 1/2 (first" in out, out[-2000:]
    assert latest_step(run / "first") < 60 and not (run / "second").exists()
    rc, out = _stop_when(run / "second" / "metrics.jsonl", launch())  # resumed there, then killed in the second
    assert rc == 128 + signal.SIGTERM, out[-2000:]
    assert latest_step(run / "first") == 60 and latest_step(run / "second") < 60
    second = yaml.safe_load((run / "second" / "config.yaml").read_text())
    assert second["train"]["init_from"] == str(run / "first" / "ckpt_00000060.pt")
    start = torch.load(run / "first" / "ckpt_00000060.pt", map_location="cpu", weights_only=False)["model"]
    proc = launch()
    rc, out = proc.wait(timeout=600), proc.stdout.read().decode()
    assert rc == 0, out[-2000:]
    assert "stage 1/2 (first" in out and "finished at step 60" in out and "stage 2/2 (second" in out
    assert latest_step(run / "second") == 60
    trained = torch.load(run / "second" / "ckpt_00000060.pt", map_location="cpu", weights_only=False)["model"]
    assert any(not torch.equal(start[k], trained[k]) for k in start)  # the second stage trained on from there
    cfg = load_stages(path, args)[1][1]
    assert training_finished(cfg) == 60
    proc = launch()
    rc, out = proc.wait(timeout=300), proc.stdout.read().decode()
    assert rc == 0 and "every stage of the recipe is finished" in out, out[-2000:]
