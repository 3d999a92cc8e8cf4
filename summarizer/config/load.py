"""Loading the config: defaults, then YAML files (with `extends:`), then `key.sub=value` overrides; validated."""
from __future__ import annotations

import dataclasses
import datetime
import math
import re
import sys
import typing
from pathlib import Path
from typing import Any

import yaml

from summarizer.config.checks import validate
from summarizer.config.schema import Config, nearest_key
from summarizer.errors import ConfigError
from summarizer.outputs import atomic_write

# Keys that moved to another section: the old name keeps working, with a one-line notice; a checkpoint's config
# written before the move is read as it was, silently.
MOVED = {("train", name): "system" for name in ("device", "deterministic", "flush_denormal", "sdpa_backend",
                                                 "cudnn_benchmark", "cpu_kernel_cache")}
_noticed: set[str] = set()


def _moved(layer: dict, notice: bool = True) -> dict:
    """`layer` (a mapping of sections) with each moved key under its new section."""
    out = dict(layer)
    for (old, name), new in MOVED.items():
        section = out.get(old)
        if not isinstance(section, dict) or name not in section:
            continue
        out[old] = {k: v for k, v in section.items() if k != name}
        target = out.get(new, {})
        out[new] = {**target, name: section[name]} if isinstance(target, dict) else target
        if notice and f"{old}.{name}" not in _noticed:
            _noticed.add(f"{old}.{name}")
            print(f"note: {old}.{name} is now {new}.{name} (the old name still works)", file=sys.stderr)
    return out


def _coerce(value: Any, typ: Any, key: str) -> Any:
    """Check `value` against the annotated type; ints may widen to floats, and YAML 1.1's text for a number (`1e4`)
    is one; nothing else converts."""
    origin = typing.get_origin(typ) or typ
    if typ is Any:
        return value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ in (float, int) and isinstance(value, str):
        # PyYAML follows YAML 1.1, where `3e-4` and `1e4` (no dot) are strings, not numbers.
        try:
            number = float(value)
        except ValueError:
            number = None
        if typ is float and number is not None:
            return number
        if number is not None and math.isfinite(number) and number.is_integer():  # train.max_steps=1e4
            return int(number)
    if origin in (list, dict) and isinstance(value, origin):
        return value
    if isinstance(value, origin) and not (origin is int and isinstance(value, bool)):
        return value
    hint = (f"; YAML reads an unquoted number, date, or yes/no/on/off/true/false as one: quote the value to keep it "
            f"as written ({key}='...' in an override, '...' in a file)"
            if origin is str and isinstance(value, (int, float, datetime.date)) else "")
    if origin is int and isinstance(value, float) and math.isfinite(value) and value.is_integer():
        hint = f"; write it as {int(value)}"
    raise ConfigError(
        f"{key} must be {getattr(origin, '__name__', origin)}, got {value!r} ({type(value).__name__}){hint}")


def _merge(obj: Any, updates: dict, prefix: str = "") -> None:
    hints = typing.get_type_hints(type(obj))
    for name, value in updates.items():
        key = f"{prefix}{name}"
        if not isinstance(name, str):  # YAML 1.1 reads on/off/yes/no/y/n, null and numbers as values
            raise ConfigError(f"config key {name!r} under '{prefix or 'the top level'}' is not a name: YAML read it as "
                              f"{type(name).__name__}; quote it if it is meant as one")
        if name not in hints:
            raise ConfigError(f"unknown config key '{key}'.{nearest_key(name, hints, prefix)}")
        current = getattr(obj, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{key} is a section; give it a mapping, not {value!r}")
            _merge(current, value, prefix=f"{key}.")
        else:
            setattr(obj, name, _coerce(value, hints[name], key))


def _nest(dotted: str, value: Any) -> dict:
    out: dict = {}
    node = out
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def parse_override(text: str, cfg: Config | None = None) -> dict:
    """`a.b=value` -> {"a": {"b": value}}; the value is parsed as YAML (so 1e-3, true, [1,2] work).

    A key that reaches into a mapping field (`data.splits.test=[x]`) edits that one entry of the
    current mapping; naming the field itself (`data.splits={...}`) replaces the whole mapping.
    """
    if "=" not in text:
        config = f" (a config file is given as --config {text})" if text.endswith((".yaml", ".yml")) else ""
        raise ConfigError(f"override '{text}' must look like key.sub=value{config}")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # not YAML: keep the text as given (type checks still apply)
    if value is None:
        value = ""
    parts = key.strip().split(".")
    node = cfg
    for i, part in enumerate(parts[:-1]):
        node = getattr(node, part, None) if node is not None else None
        if isinstance(node, dict):
            return _nest(".".join(parts[:i + 1]), {**node, **_nest(".".join(parts[i + 1:]), value)})
    return _nest(key.strip(), value)


def overridden(overrides: list[str] | tuple, section: str) -> set[str]:
    """The keys of `section` that `overrides` set, a dotted edit of one (`data.splits.test=[x]`) and a whole
    section's mapping (`data={lowercase: false}`) included: what a command line asks for, as opposed to what its
    config file says."""
    keys: set[str] = set()
    for text in overrides:
        value = parse_override(text).get(section)
        if isinstance(value, dict):
            keys.update(value)
    return keys


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error, not last-wins."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool, type(None))):
                raise ConfigError(f"a mapping key at line {key_node.start_mark.line + 1} is a {type(key).__name__}: "
                                  f"config keys are names")
            if key in seen:
                raise ConfigError(f"key '{key}' is given twice in one mapping (line {key_node.start_mark.line + 1}): "
                                  f"keep one; YAML would silently use the last")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path) -> dict:
    """A config file's mapping of sections; one clear error for each way the file can be wrong."""
    if path.is_dir():
        raise ConfigError(f"--config {path} is a directory; give a YAML file, e.g. configs/base.yaml")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (see configs/ for examples)")
    try:
        data = yaml.load(path.read_bytes().decode("utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506 (safe subclass)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start}): save it as UTF-8") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        raise ConfigError(f"config file {path} is empty: give at least one section, or leave --config out to "
                          f"use the defaults (the recipe in configs/base.yaml)")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections")
    return data


def config_chain(path: Path) -> list[dict]:
    """A config file's sections after those of the file its `extends:` names (a path relative to it), and so
    on up: the layers to merge over the defaults, in order."""
    chain, seen = [], []
    while path is not None:
        if path.resolve() in seen:
            raise ConfigError(f"config {seen[0]} extends itself through {path}: remove one `extends:`")
        seen.append(path.resolve())
        data = read_yaml(path)
        parent = data.pop("extends", None)
        if parent is not None and not isinstance(parent, str):
            raise ConfigError(f"config file {path}: `extends:` names one config file, got {parent!r}")
        chain.insert(0, data)
        path = path.parent / parent if parent else None
    return chain


def _build(layers: list[dict], overrides: list[str] | tuple) -> Config:
    cfg = Config()
    for layer in layers:
        _merge(cfg, _moved(layer))
    for text in overrides:
        _merge(cfg, _moved(parse_override(text, cfg)))
    return cfg


def _stage_list(path: Path, stages: Any) -> list[tuple[str, dict]]:
    """A config's `stages:` as (name, sections) pairs, checked."""
    if not isinstance(stages, list) or not stages:
        raise ConfigError(f"config file {path}: `stages:` is a list of stages, each a mapping with a `name` and the "
                          f"sections it changes, got {stages!r}")
    out = []
    for stage in stages:
        name = stage.get("name") if isinstance(stage, dict) else None
        if not isinstance(name, str) or not re.fullmatch(r"[\w.-]+", name):
            raise ConfigError(f"config file {path}: each stage is a mapping with a plain `name` (letters, digits, "
                              f"`_.-`) and the sections it changes, got {stage!r}")
        if name in (n for n, _ in out):
            raise ConfigError(f"config file {path}: two stages are named {name!r}: give each its own name")
        out.append((name, {k: v for k, v in stage.items() if k != "name"}))
    return out


def load_stages(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> list[tuple[str, Config]]:
    """The runs a config trains, in order, as (stage name, Config). A config with `stages:` (a recipe,
    configs/two_stage.yaml) has one per stage: defaults, the file, the stage's sections, then each override; its
    run is `<run.name>/<stage>` (and `<run.dir>/<stage>`), and a stage after the first starts from the weights
    its predecessor ends with (train.init_from, unless the stage sets it). Any other config is one run named
    "". Each validated."""
    layers = config_chain(Path(path)) if path else []
    stages = None
    for layer in layers:
        if "stages" in layer:
            stages = _stage_list(Path(path), layer.pop("stages"))
    if stages is None:
        cfg = _build(layers, overrides)
        validate(cfg)
        return [("", cfg)]
    out: list[tuple[str, Config]] = []
    for name, sections in stages:
        cfg = _build([*layers, sections], overrides)
        cfg.run.name = f"{cfg.run.name}/{name}"
        cfg.run.dir = f"{cfg.run.dir.rstrip('/')}/{name}" if cfg.run.dir else ""
        if out and not cfg.train.init_from:
            before = out[-1][1]
            # its last step checkpoint (checkpoint.step_path names it so): a path a run's config.yaml shows
            cfg.train.init_from = str(before.run_dir / f"ckpt_{before.train.max_steps:08d}.pt")
        validate(cfg)
        out.append((name, cfg))
    if len({cfg.data.dir for _, cfg in out}) > 1:
        raise ConfigError(f"config file {path}: the stages name different data.dir values; stages share one "
                          f"prepared data dir (a stage may reweight its sources: data.source_weights)")
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Defaults, then the YAML file, then each override in order; validated. For a recipe of stages, the last
    stage's (the run that `eval` and `summarize` use)."""
    return load_stages(path, overrides)[-1][1]


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(data: dict) -> Config:
    """Rebuild a Config from a checkpoint's dict; unknown keys fail loudly (format drift)."""
    cfg = Config()
    _merge(cfg, _moved(data, notice=False))
    return cfg


def save_config(cfg: Config, path: str | Path) -> None:
    atomic_write(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))

