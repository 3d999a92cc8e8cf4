"""The config's rules checked: each key against the rules `key` put beside it (choices, bounds, finite), then the
rules that tie keys together. `load_config` runs `validate` on every config it builds."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from summarizer.config.schema import SECTIONS, Config, nearest, rules
from summarizer.errors import ConfigError


def _check_rules(section: str, name: str, value: Any) -> None:
    key, meta = f"{section}.{name}", rules(section, name)
    if meta.get("choices") and value not in meta["choices"]:
        hint = nearest(str(value), meta["choices"])
        raise ConfigError(f"{key} must be one of {meta['choices']}, got {value!r}.{hint}")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value}")
    for bound, fails, words in (("above", lambda b: value <= b, "> {}"), ("low", lambda b: value < b, ">= {}"),
                                ("below", lambda b: value >= b, "< {}"), ("high", lambda b: value > b, "<= {}")):
        if meta.get(bound) is not None and fails(meta[bound]):
            text = "positive" if (bound, meta[bound]) == ("above", 0) else words.format(meta[bound])
            raise ConfigError(f"{key} must be {text}, got {value}")


def validate(cfg: Config) -> None:
    """Each key against its own rules (`key`), then the rules that tie keys together."""
    for section in SECTIONS:
        for f in dataclasses.fields(SECTIONS[section]):
            _check_rules(section, f.name, getattr(getattr(cfg, section), f.name))
    m, t, d, e = cfg.model, cfg.train, cfg.data, cfg.eval
    if e.min_len > e.max_len:
        raise ConfigError(f"eval.min_len ({e.min_len}) exceeds eval.max_len ({e.max_len}): no summary can satisfy "
                          f"both; lower eval.min_len or raise eval.max_len")
    if len(t.betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in t.betas):
        raise ConfigError(f"train.betas must be two numbers in [0, 1), got {t.betas}")
    if not isinstance(t.skip_batches, list) or not all(
            isinstance(b, list) and len(b) == 2 and all(isinstance(n, int) and not isinstance(n, bool) for n in b)
            and b[0] >= 0 and b[1] >= 1 for b in t.skip_batches):
        raise ConfigError(f"train.skip_batches must be a list of [epoch, position] pairs (epoch >= 0, position >= 1, "
                          f"as a rollback records them in manifest.json), got {t.skip_batches!r}")
    if m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model ({m.d_model}) must be divisible by model.n_heads ({m.n_heads})")
    if d.vocab_size < 8:
        raise ConfigError(f"data.vocab_size must be at least 8 (4 special ids + pieces), got {d.vocab_size}")
    if d.batch_tokens < d.max_source_len + d.max_target_len:
        raise ConfigError(f"data.batch_tokens ({d.batch_tokens}) must hold one full-length pair "
                          f"({d.max_source_len + d.max_target_len} tokens)")
    if t.select_by == "rouge" and t.rouge_every <= 0:
        raise ConfigError("train.select_by=rouge needs train.rouge_every > 0")
    if t.rouge_every > 0 and t.rouge_samples <= 0:
        raise ConfigError("train.rouge_every > 0 needs train.rouge_samples > 0 (valid pairs to score), or set "
                          "train.rouge_every=0 (and train.select_by=loss) to turn validation ROUGE off")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in e.lead_baselines):
        raise ConfigError(f"eval.lead_baselines must be a list of positive word counts, got {e.lead_baselines}")
    if not isinstance(d.splits, dict) or "train" not in d.splits:
        raise ConfigError("data.splits must map 'train' (and optionally 'valid', 'test') to source split names")
    for split, names in d.splits.items():
        listed = [names] if isinstance(names, str) and names else names
        if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
            raise ConfigError(f"data.splits.{split} must be a list of source split names, got {names!r} (a YAML "
                              f"key left empty is null: write {split}: [] for none)")
    longest = max(_round_up(d.max_source_len, d.pad_multiple), _round_up(d.max_target_len + 1, d.pad_multiple),
                  e.max_len + 2)
    if longest > m.max_positions:
        raise ConfigError(f"model.max_positions ({m.max_positions}) is shorter than the longest sequence these "
                          f"settings make ({longest}: data.max_source_len/max_target_len padded to "
                          f"data.pad_multiple={d.pad_multiple}, or eval.max_len + 2); lower those or raise it")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // max(multiple, 1)) * max(multiple, 1)
