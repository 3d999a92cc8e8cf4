from pathlib import Path

import pytest
import yaml

from summarizer.config.load import from_dict, load_config, load_stages, save_config, to_dict
from summarizer.errors import ConfigError


def test_defaults_then_yaml_then_overrides(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump({"model": {"d_model": 128, "n_heads": 4}, "train": {"lr": 0.002}}))
    cfg = load_config(path, ["train.lr=3e-4", "data.splits={train: [train, valid]}", "train.betas=[0.9, 0.99]"])
    assert cfg.model.d_model == 128  # from YAML
    assert cfg.train.lr == pytest.approx(3e-4)  # override wins; `3e-4` is a YAML 1.1 string, accepted
    assert cfg.data.splits == {"train": ["train", "valid"]}  # a whole mapping replaces
    assert cfg.train.betas == [0.9, 0.99]
    assert cfg.model.encoder_layers == 3  # untouched default
    counts = load_config(None, ["train.max_steps=1e4", "train.warmup_steps=2.5e3"])  # whole numbers YAML 1.1 reads
    assert (counts.train.max_steps, counts.train.warmup_steps) == (10_000, 2_500)     # as text: ints all the same
    edited = load_config(None, ["data.splits.test=[test_dev]"])  # one entry edits the mapping
    assert edited.data.splits["test"] == ["test_dev"] and edited.data.splits["train"] == ["train", "valid"]


@pytest.mark.parametrize("override, message", [
    ("model.d_modle=1", "Did you mean 'model.d_model'"),
    ("modle.d_model=1", "Did you mean 'model'"),
    ("train.lr=fast", "train.lr must be float"),
    ("train.max_steps=1.5", "train.max_steps must be int"),
    ("train.max_steps=1.5e0", "train.max_steps must be int"),
    ("train.max_steps=1.0e+4", r"train.max_steps must be int, got 10000.0 \(float\); write it as 10000"),
    ("system.deterministic=3", "system.deterministic must be bool"),
    ("train.precision=bf61", "Did you mean 'bf16'"),
    ("model.activation=rleu", "Did you mean 'relu'"),
    ("model.n_heads=3", "divisible"),
    ("model=3", "is a section"),
    ("train.rouge_every=0", "rouge_every"),
    ("system.cpu_kernel_cache=-1", "system.cpu_kernel_cache must be >= 0"),
    ("noequals", "key.sub=value"),
    ("train.lr=nan", "train.lr must be a finite number"),
    ("eval.length_penalty=.inf", "eval.length_penalty must be a finite number"),
    ("eval.lead_baselines=[-3]", "eval.lead_baselines must be a list of positive"),
    ("train.rouge_samples=0", "train.rouge_samples > 0"),
    ("model.dropout=1.0", "model.dropout must be < 1"),
    ("train.min_lr_ratio=1.5", "train.min_lr_ratio must be <= 1"),
    ("train.dropout=0.2", "Did you mean 'model.dropout'"),  # the same name in another section first
    ("lr=1e-3", "Did you mean 'train.lr'"),
    ("eval.device=cpu", "Did you mean 'system.device'"),
    ("data.spm_character_coverage=5", "data.spm_character_coverage must be <= 1"),
    ("run.name=on", r"run.name must be str, got True \(bool\); YAML reads .* quote the value to keep it as written "
                    r"\(run.name='...' in an override"),
    ("run.name=2024-01-05", r"got datetime.date\(2024, 1, 5\) \(date\); YAML reads an unquoted number, date"),
    ("run.name=0x10", r"got 16 \(int\); YAML reads an unquoted number"),
])
def test_bad_values_name_the_key_and_fix(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_round_trip_through_dict_and_file(tmp_path):
    cfg = load_config(None, ["run.name=x", "model.copy=false"])
    assert to_dict(from_dict(to_dict(cfg))) == to_dict(cfg)
    save_config(cfg, tmp_path / "c.yaml")
    assert to_dict(load_config(tmp_path / "c.yaml")) == to_dict(cfg)
    assert str(cfg.run_dir) == "checkpoints/x"


def test_base_yaml_is_exactly_the_code_defaults():
    """The dataclass defaults are the reference recipe; configs/base.yaml documents it and must not drift."""
    assert to_dict(load_config("configs/base.yaml")) == to_dict(load_config(None))


def test_other_configs_override_only_what_differs_from_the_recipe(tmp_path):
    from pathlib import Path
    for path in sorted(Path("configs").glob("*.yaml")):
        if path.name == "base.yaml":
            continue
        own = yaml.safe_load(path.read_text())
        parent = own.pop("extends", None)  # a config that extends another overrides only what differs from it
        stages = own.pop("stages", [])  # a stage overrides only what differs from the config around it
        without_stages = tmp_path / path.name
        without_stages.write_text(yaml.safe_dump({**own, **({"extends": str(path.parent.resolve() / parent)}
                                                             if parent else {})}))
        below = to_dict(load_config(path.parent / parent if parent else None))
        layers = [(f"{path}", own, to_dict(load_config(without_stages)), below)]
        layers += [(f"{path}, stage {stage['name']}", {k: v for k, v in stage.items() if k != "name"},
                    to_dict(cfg), to_dict(load_config(without_stages)))
                   for stage, (_, cfg) in zip(stages, load_stages(path) if stages else [], strict=True)]
        for where, sections, loaded, under in layers:
            for section, values in sections.items():
                for key in values:
                    assert loaded[section][key] != under[section][key], \
                        f"{where}: {section}.{key} repeats the value {under[section][key]!r} it would have; drop it"


def test_every_shipped_config_loads_and_base_documents_every_key():
    from pathlib import Path
    configs = sorted(Path("configs").glob("*.yaml"))
    assert configs, "configs/ is empty"
    for path in configs:
        load_config(path)
    base = Path("configs/base.yaml").read_text()
    for section, values in to_dict(load_config(None)).items():
        for key in values:
            line = next((ln for ln in base.splitlines() if ln.strip().startswith(f"{key}:")), None)
            assert line is not None, f"configs/base.yaml lacks {section}.{key}"
            assert "#" in line, f"configs/base.yaml: {section}.{key} has no comment"


def test_each_keys_rules_live_beside_its_field_and_every_reader_uses_them():
    """Bounds, choices, the resume rule and the report's bookkeeping rule are metadata of the field; validate,
    resume and report read them there (no list of keys elsewhere)."""
    from summarizer.config.resume import may_change
    from summarizer.config.schema import rules
    from summarizer.harness.report import ignored
    assert rules("train", "lr")["above"] == 0 and rules("train", "schedule")["choices"][0] == "inverse_sqrt"
    assert rules("train", "lr")["resume"] and may_change("train.lr") and may_change("data.num_workers")
    assert not may_change("model.d_model") and not may_change("train.label_smoothing")
    assert may_change("eval.beam_size") and may_change("run.name")  # sections that only say how to evaluate, names
    assert ignored("run.dir") and ignored("data.dir") and ignored("eval.checkpoint") and ignored("bench.repeats")
    assert not ignored("train.lr") and not ignored("data.vocab_size") and not ignored("train.gone_key")


def test_a_config_extends_another_and_overrides_it(tmp_path):
    (tmp_path / "a.yaml").write_text("run: {name: a}\ntrain: {seed: 7, max_steps: 5}\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.yaml").write_text("extends: ../a.yaml\ntrain: {max_steps: 9}\n")
    cfg = load_config(tmp_path / "sub" / "b.yaml", ["run.name=c"])
    assert (cfg.run.name, cfg.train.seed, cfg.train.max_steps) == ("c", 7, 9)  # file, its parent, then overrides
    (tmp_path / "a.yaml").write_text("extends: sub/b.yaml\n")
    with pytest.raises(ConfigError, match="extends itself"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "a.yaml").write_text("extends: [x.yaml]\n")
    with pytest.raises(ConfigError, match="names one config file"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "a.yaml").write_text("extends: missing.yaml\n")
    with pytest.raises(ConfigError, match="missing.yaml does not exist"):
        load_config(tmp_path / "a.yaml")


def test_keys_moved_to_the_system_section_keep_their_old_names_with_a_notice(capsys, tmp_path):
    from summarizer.config import load
    load._noticed.clear()
    (tmp_path / "old.yaml").write_text("train:\n  device: cpu\n  lr: 0.002\n")
    cfg = load_config(tmp_path / "old.yaml", ["train.cpu_kernel_cache=0", "train.sdpa_backend=math"])
    assert (cfg.system.device, cfg.system.cpu_kernel_cache, cfg.system.sdpa_backend) == ("cpu", 0, "math")
    assert cfg.train.lr == 0.002
    err = capsys.readouterr().err
    assert "note: train.device is now system.device (the old name still works)" in err
    assert err.count("train.device is now") == 1  # once per key, however often it is given


def test_a_checkpoint_config_written_before_the_move_still_loads(capsys):
    from summarizer.config.load import from_dict
    from summarizer.config.schema import Config
    old = to_dict(Config())
    del old["system"]
    old["train"].update(device="cpu", deterministic=True)
    cfg = from_dict(old)
    assert cfg.system.device == "cpu" and cfg.system.deterministic
    assert "note:" not in capsys.readouterr().err  # a checkpoint is read as it was, silently


def test_eval_and_summarize_read_no_train_key():
    """Each component gets its own section: decoding and scoring never look at the training recipe."""
    import ast
    root = Path(__file__).resolve().parents[1] / "summarizer"
    paths = [root / "summarize.py", root / "evaluation/evaluate.py", *sorted((root / "decode").glob("*.py"))]
    found = [f"{p.name}:{n.lineno}" for p in paths for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.Attribute) and n.attr == "train"]
    assert found == []


@pytest.mark.parametrize("text, message", [("train: {on: 2}\n", "key True under 'train.' is not a name.*quote it"),
                                           ("train:\n  ? [a]\n  : 1\n", "key at line 2 is a list")])
def test_a_yaml_key_that_is_no_name_is_a_config_error(tmp_path, text, message):
    """YAML 1.1 reads on/off/yes/no, null and numbers as values, and allows lists as keys: one line, no traceback."""
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path, [])
