import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from summarizer.config.load import load_stages
from summarizer.errors import ConfigError
from summarizer.harness import seeds
from summarizer.train import stages as stage_runner

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model.d_model=32", "model.ffn_dim=64", "model.encoder_layers=1", "model.decoder_layers=1",
         "train.max_steps=4", "train.eval_every=2", "train.ckpt_every=2", "train.log_every=2",
         "train.warmup_steps=2", "train.sample_summaries=0", "data.batch_tokens=400",
         "eval.beam_size=1", "eval.max_len=8", "eval.limit=8", "eval.bootstrap_samples=10",
         "eval.lead_baselines=[8]"]


@pytest.fixture(scope="module")
def two_seeds(tmp_path_factory):
    from data_prep.__main__ import main as prep
    from summarizer.__main__ import main
    tmp = tmp_path_factory.mktemp("seeds")
    args = ["--config", str(ROOT / "configs/tiny.yaml"), f"data.dir={tmp / 'data'}", f"run.dir={tmp / 'run'}",
            f"run.tensorboard_dir={tmp / 'tb'}", *SMALL]
    assert prep(args[:4]) == 0
    assert main(["seeds", *args, "--n", "2"]) == 0
    return tmp, args


def cfg_of(args, *extra):
    return load_stages(args[1], [*args[2:], *extra])


def seed_config(stages, seed):
    [(_, cfg)] = seeds.seed_stages(stages, seed)
    return cfg


def test_each_seed_is_its_own_run_and_the_summary_is_their_mean_and_std(two_seeds, capsys):
    tmp, _ = two_seeds
    values = []
    for seed in (1, 2):
        run_dir = tmp / f"run-seed{seed}"
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert config["train"]["seed"] == seed and config["run"]["name"] == f"tiny-seed{seed}"
        report = json.loads((run_dir / "rouge.json").read_text())
        assert report["settings"]["checkpoint"]["path"].endswith("best.pt")
        values.append([report[k]["f"] for k in ("rouge1", "rouge2", "rougeL")])
    summary = json.loads((tmp / "seeds_tiny.json").read_text())
    assert summary["seeds"] == [1, 2] and summary["eval"]["pairs"] == 8
    for j, kind in enumerate(("rouge1", "rouge2", "rougeL")):
        column = np.array(values)[:, j]
        assert summary["mean"][kind] == pytest.approx(column.mean())
        assert summary["std"][kind] == pytest.approx(column.std(ddof=1))


def test_a_seed_stopped_by_a_signal_is_neither_scored_nor_summarised(two_seeds, monkeypatch, capsys):
    tmp, args = two_seeds
    before = (tmp / "seeds_tiny.json").read_text()
    monkeypatch.setattr(seeds, "train_stages", lambda stages: {"signal": 2, "steps": 3})
    monkeypatch.setattr(seeds, "evaluate", lambda cfg: pytest.fail("scored a stopped run"))
    from summarizer.__main__ import main
    assert main(["seeds", *args, "--n", "2"]) == 130
    assert "stopped by a signal" in capsys.readouterr().err and (tmp / "seeds_tiny.json").read_text() == before


def test_a_rerun_redoes_nothing_finished(two_seeds, monkeypatch):
    tmp, args = two_seeds
    before = json.loads((tmp / "seeds_tiny.json").read_text())

    def refuse(cfg):
        raise AssertionError(f"{cfg.run.name} was redone")
    monkeypatch.setattr(stage_runner, "train", refuse)
    monkeypatch.setattr(seeds, "evaluate", refuse)
    summary, path = seeds.run_seeds(cfg_of(args), 2)
    assert path == tmp / "seeds_tiny.json" and summary == before


def test_only_missing_or_stale_evaluations_are_redone(two_seeds, monkeypatch):
    tmp, args = two_seeds
    calls = []

    def counted(cfg):
        calls.append(cfg.run.name)
        return real(cfg)
    real = seeds.evaluate
    monkeypatch.setattr(stage_runner, "train", lambda cfg: pytest.fail("training finished; must not resume"))
    monkeypatch.setattr(seeds, "evaluate", counted)
    (tmp / "run-seed2" / "rouge.json").unlink()
    seeds.run_seeds(cfg_of(args), 2)
    assert calls == ["tiny-seed2"]
    seeds.run_seeds(cfg_of(args, "eval.limit=6"), 2)  # other eval settings: both evaluated again
    assert calls == ["tiny-seed2", "tiny-seed1", "tiny-seed2"]
    assert json.loads((tmp / "seeds_tiny.json").read_text())["eval"]["pairs"] == 6


def test_an_evaluation_is_reused_only_for_the_settings_it_scored_with(two_seeds):
    """Each of these changes what is decoded or how it is scored: the rouge.json of other settings is stale."""
    _, args = two_seeds
    seeds.run_seeds(cfg_of(args), 2)  # evaluated with these settings, whatever an earlier test left
    assert seeds.current_evaluation(seed_config(cfg_of(args), 1)) is not None
    from data_prep.__main__ import main as prep
    other = two_seeds[0] / "data_swapped"  # its test split is the fixture's valid: as many pairs scored, others
    if not other.is_dir():
        assert prep([*args[:2], f"data.dir={other}", "data.splits={train: [train], valid: [test], test: [valid]}"]) == 0
    for change in ("eval.truncate_bytes=75", "eval.known_words=false", "eval.no_repeat_words=false",
                   "eval.quantize=none", "eval.precision=bf16", f"eval.pairs={args[2].split('=', 1)[1]}/test.jsonl",
                   f"data.dir={other}"):
        assert seeds.current_evaluation(seed_config(cfg_of(args, change), 1)) is None, change


def test_a_pairs_file_is_named_in_the_summary_and_its_evaluation_is_reused(two_seeds, monkeypatch):
    """With eval.pairs, rouge.json names the pairs file as its split: the summary says what was scored, and a rerun
    finds each seed's evaluation of that file (eval.limit applied to its pairs) up to date."""
    tmp, args = two_seeds
    pairs = f"{args[2].split('=', 1)[1]}/test.jsonl"  # 40 pairs, 8 of them scored (eval.limit)
    monkeypatch.setattr(stage_runner, "train", lambda cfg: pytest.fail("training finished; must not resume"))
    summary, _ = seeds.run_seeds(cfg_of(args, f"eval.pairs={pairs}"), 2)
    assert summary["eval"]["split"] == "test.jsonl" and summary["eval"]["pairs_file"] == pairs
    assert summary["eval"]["pairs"] == 8
    assert seeds.format_summary(summary).startswith("tiny, seeds 1, 2 (test.jsonl, 8 pairs, ")
    monkeypatch.setattr(seeds, "evaluate", lambda cfg: pytest.fail(f"{cfg.run.name} was evaluated again"))
    assert seeds.run_seeds(cfg_of(args, f"eval.pairs={pairs}"), 2)[0] == summary
    assert seeds.current_evaluation(seed_config(cfg_of(args, f"eval.pairs={pairs}", "eval.limit=6"), 1)) is None


def test_an_unfinished_run_is_resumed(two_seeds):
    _, args = two_seeds
    assert stage_runner.training_finished(seed_config(cfg_of(args), 1)) == 4
    assert stage_runner.training_finished(seed_config(cfg_of(args, "train.max_steps=9"), 1)) is None


def test_bad_requests_are_refused_clearly(two_seeds, capsys):
    from summarizer.__main__ import main
    _, args = two_seeds
    assert main(["seeds", *args, "--n", "0"]) == 2
    assert "--n must be at least 1" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="drop eval.checkpoint"):
        seed_config(cfg_of(args, "eval.checkpoint=x.pt"), 1)


def test_each_seed_of_a_recipe_chains_its_own_stages(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"extends": str(ROOT / "configs/tiny.yaml"), "run": {"name": "r"}, "stages": [
        {"name": "pre", "train": {"max_steps": 6}}, {"name": "fine", "train": {"max_steps": 4}}]}))
    (_, pre), (_, fine) = seeds.seed_stages(load_stages(path), 3)
    assert (pre.run_dir, fine.run_dir) == (Path("checkpoints/r-seed3/pre"), Path("checkpoints/r-seed3/fine"))
    assert pre.train.seed == fine.train.seed == 3
    assert fine.train.init_from == "checkpoints/r-seed3/pre/ckpt_00000006.pt"
    (_, pre), _ = seeds.seed_stages(load_stages(path, [f"run.dir={tmp_path}/x"]), 2)
    assert pre.run_dir == tmp_path / "x-seed2" / "pre"


def test_one_seed_has_no_std():
    runs = [{"seed": 1, "rouge1": 30.0, "rouge2": 10.0, "rougeL": 28.0}]
    summary = seeds.summarize_seeds("x", runs)
    assert summary["mean"]["rouge1"] == 30.0 and summary["std"]["rouge1"] is None


def test_a_users_file_where_the_summary_goes_is_refused_before_any_training(tmp_path, monkeypatch):
    from summarizer.errors import ConfigError
    cfg = cfg_of(["--config", str(ROOT / "configs/tiny.yaml"), f"run.dir={tmp_path / 'run'}"])
    mine = tmp_path / "seeds_tiny.json"
    mine.write_text('{"my": "notes"}')
    monkeypatch.setattr(stage_runner, "train",
                        lambda cfg: pytest.fail("trained before checking where the summary goes"))
    with pytest.raises(ConfigError, match="was not written by `summarizer seeds`"):
        seeds.run_seeds(cfg, 2)
    assert mine.read_text() == '{"my": "notes"}'
