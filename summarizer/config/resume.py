"""What may change when a run resumes: the new config against the checkpoint's, refusals named, changes recorded."""
from __future__ import annotations

from summarizer.config.load import from_dict, to_dict
from summarizer.config.schema import RESUMABLE_SECTIONS, Config, rules
from summarizer.errors import ConfigError


def may_change(dotted: str) -> bool:
    """Whether a key may differ from the checkpoint's config when a run resumes (config.key's `resume` rule, or
    a section that only says how to evaluate, place or benchmark). Everything else shapes the model, the data's
    normalisation and tokenizer, the optimisation recipe or the batch plan the run is part-way through."""
    section, name = dotted.split(".", 1)
    return section in RESUMABLE_SECTIONS or rules(section, name).get("resume", False)


def differences(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """(dotted key, old value, new value) for every key whose value differs."""
    return [(f"{section}.{key}", value, new[section][key]) for section, values in old.items()
            for key, value in values.items() if new[section][key] != value]


def check_resume(checkpoint_config: dict, cfg: Config, run_dir, step: int,
                 fixed: frozenset = frozenset()) -> list[dict]:
    """Compare the config a run resumes with against the one its checkpoint was trained with.

    Refused keys (and those of `fixed`, which this run may not change) raise one ConfigError naming each key with
    its old and new value and the fix; the keys that may change come back as records {step, key, old, new}, to be
    logged and kept.
    """
    old, new = to_dict(from_dict(checkpoint_config)), to_dict(cfg)
    changed = differences(old, new)
    refused = [(key, a, b) for key, a, b in changed if not may_change(key) or key in fixed]
    if refused:
        listed = "; ".join(f"{key}: {a!r} in the checkpoint, {b!r} now" for key, a, b in refused)
        raise ConfigError(f"run {run_dir} was trained with other settings that cannot change when it resumes "
                          f"({listed}). To train with the new settings, start a new run (run.name=NEW_NAME); to "
                          f"resume this one, put the values back. What may change on resume: the "
                          f"{', '.join(RESUMABLE_SECTIONS)} sections and the keys marked resume=True in "
                          f"summarizer/config/schema.py (the schedule, limits, intervals, logging, precision, "
                          f"kernels, workers, prep-only data keys; docs/practices.md, 'Checkpoints and resuming').")
    return [{"step": step, "key": key, "old": a, "new": b} for key, a, b in changed if not key.startswith("run.")]
