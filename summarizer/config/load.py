"""Loading the config: defaults, then YAML files (with `extends:`), then `key.sub=value` overrides; validated."""
from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any

import yaml

from summarizer.config.checks import validate
from summarizer.config.schema import Config, nearest
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
    """Check `value` against the annotated type; ints may widen to floats, nothing else converts."""
    origin = typing.get_origin(typ) or typ
    if typ is Any:
        return value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is float and isinstance(value, str):
        # PyYAML follows YAML 1.1, where `3e-4` (no dot) is a string, not a float.
        try:
            return float(value)
        except ValueError:
            pass
    if origin in (list, dict) and isinstance(value, origin):
        return value
    if isinstance(value, origin) and not (origin is int and isinstance(value, bool)):
        return value
    hint = f"; quote it to keep it text: {key}='{value}'" if origin is str and isinstance(value, (int, float)) else ""
    raise ConfigError(
        f"{key} must be {getattr(origin, '__name__', origin)}, got {value!r} ({type(value).__name__}){hint}")


def _merge(obj: Any, updates: dict, prefix: str = "") -> None:
    hints = typing.get_type_hints(type(obj))
    for name, value in updates.items():
        key = f"{prefix}{name}"
        if name not in hints:
            raise ConfigError(f"unknown config key '{key}'.{nearest(name, hints, prefix)}")
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
        raise ConfigError(f"override '{text}' must look like key.sub=value")
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


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error, not last-wins."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
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


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Defaults, then the YAML file, then each override in order; validated."""
    cfg = Config()
    for layer in config_chain(Path(path)) if path else []:
        _merge(cfg, _moved(layer))
    for text in overrides:
        _merge(cfg, _moved(parse_override(text, cfg)))
    validate(cfg)
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(data: dict) -> Config:
    """Rebuild a Config from a checkpoint's dict; unknown keys fail loudly (format drift)."""
    cfg = Config()
    _merge(cfg, _moved(data, notice=False))
    return cfg


def save_config(cfg: Config, path: str | Path) -> None:
    atomic_write(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))

