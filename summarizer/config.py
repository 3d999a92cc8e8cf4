"""The one typed config: nested dataclasses, YAML then `key.sub=value` overrides, validation.

The dataclass defaults are the reference recipe, documented key by key in configs/base.yaml (a test
keeps the two equal). They live in code so that an installed package needs no YAML to run.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from summarizer.errors import ConfigError


@dataclass
class RunConfig:
    name: str = "base"
    dir: str = ""  # default: checkpoints/<name>
    tensorboard_dir: str = "runs"  # events go to <tensorboard_dir>/<name>


@dataclass
class DataConfig:
    source: Any = ""  # "hf:NAME[:SUBSET]", a directory, or {split: [files]}
    dir: str = "data/gigaword_sample"
    source_field: str = "source"
    target_field: str = "target"
    references_field: str = "references"
    # product split -> source split names (file stems or hub split names); missing names are skipped
    splits: dict = field(default_factory=lambda: {
        "train": ["train", "valid"], "valid": [], "test": ["test_dev", "test"]})
    valid_holdout: int = 500  # >0 and no valid split mapped: hold this many train pairs out as the valid split
    train_limit: int = 0  # >0: train on only the first N prepared train pairs (overfit checks)
    lowercase: bool = True  # applied at prep and at `summarize`
    mask_digits: bool = True  # every digit -> '#', as Gigaword's preprocessing did
    max_source_words: int = 120  # cleaning: longer pairs are dropped and counted
    max_target_words: int = 40
    vocab_size: int = 8000
    spm_model_type: str = "unigram"
    spm_character_coverage: float = 1.0
    spm_input_sentence_size: int = 2_000_000
    num_proc: int = 2  # processes for offline tokenization
    max_source_len: int = 96  # tokens; longer sources are truncated when batched
    max_target_len: int = 40
    subword_alpha: float = 0.0  # >0: train on sampled segmentations (subword regularisation), smoothing alpha
    subword_nbest: int = 8  # ...drawn among each word's n best segmentations
    batch_tokens: int = 3000  # token budget per micro-batch (padded source + target)
    bucket_size: int = 1000  # batches per length-sorted pool; larger = less padding, less randomness
    pad_multiple: int = 4  # pad batch lengths up to a multiple of this: fewer distinct shapes for kernel caches
    num_workers: int = 2
    pin_memory: bool = True  # only has an effect on CUDA
    persistent_workers: bool = True
    prefetch_factor: int = 4


@dataclass
class ModelConfig:
    d_model: int = 256
    n_heads: int = 4
    encoder_layers: int = 3
    decoder_layers: int = 3
    ffn_dim: int = 1024
    dropout: float = 0.1
    attention_dropout: float = 0.0
    fast_dropout: bool = True  # CPU masks from numpy's SFC64 instead of bernoulli_ (summarizer/dropout.py)
    activation: str = "relu"  # feed-forward non-linearity: gelu | relu
    bias: bool = False  # additive biases in linear and LayerNorm layers (the copy gate keeps its own)
    max_positions: int = 512
    copy: bool = True  # pointer-generator copy attention over source tokens


@dataclass
class TrainConfig:
    seed: int = 1234
    deterministic: bool = False  # torch.use_deterministic_algorithms
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    flush_denormal: bool = True  # CPU: treat denormal floats as zero (FTZ/DAZ), avoiding x86's slow path
    precision: str = "auto"  # auto | fp32 | bf16 | fp16
    # auto (explicit on CPU, torch's choice on CUDA) | default | math | flash | efficient | explicit
    sdpa_backend: str = "auto"
    max_steps: int = 10_000
    max_minutes: float = 0.0  # 0 = no time limit
    accum_steps: int = 1
    lr: float = 1e-3
    warmup_steps: int = 400
    schedule: str = "inverse_sqrt"  # inverse_sqrt | cosine | linear | constant
    min_lr_ratio: float = 0.0  # floor for cosine/linear, as a fraction of lr
    weight_decay: float = 0.01
    betas: list = field(default_factory=lambda: [0.9, 0.98])
    label_smoothing: float = 0.1
    ema_decay: float = 0.999  # moving average of the weights, validated and kept in best.pt (0 = off)
    clip_norm: float = 1.0  # 0 = no clipping (the norm is still logged)
    max_bad_steps: int = 5  # abort after this many non-finite steps in a row
    set_to_none: bool = True
    fused_optimizer: bool = True  # AdamW(fused=True): one kernel for all parameters (CPU and CUDA)
    fused_loss: bool = True  # one-pass vocabulary loss with an in-place backward (losses.VocabStats)
    cudnn_benchmark: bool = True
    cpu_kernel_cache: int = 8192
    compile: bool = False
    log_every: int = 50  # host syncs (.item()) happen only here
    eval_every: int = 500
    rouge_every: int = 500  # 0 = off
    rouge_samples: int = 500
    select_by: str = "rouge"  # loss | rouge
    patience: int = 0  # evaluations without improvement before stopping; 0 = off
    ckpt_every: int = 500
    keep_last: int = 2
    profile_steps: int = 0  # >0: torch.profiler trace of this many steps
    sample_summaries: int = 3  # text samples logged to TensorBoard at each eval


@dataclass
class EvalConfig:
    split: str = "test"
    checkpoint: str = ""  # default: the run's best
    out_dir: str = ""  # default: the run dir
    beam_size: int = 4
    batch_tokens: int = 4096  # source tokens per decoding batch (sentences sorted by length, padded)
    threads: int = 0  # batches decoded at once, one core each; 0 = one per core on CPU (torch threads), 1 on GPU
    precision: str = "auto"  # decoding precision: auto (bf16 where fast, else fp32 on CPU) | fp32 | bf16 | fp16
    quantize: str = "auto"  # auto (int8 where decoding runs on the CPU in fp32) | none | int8 (dynamic int8 linears)
    max_len: int = 30  # target tokens
    min_len: int = 8  # tokens; headlines near the references' length: README, Results
    length_penalty: float = 2.0  # measured on test_dev and DUC-2003: README, Results
    no_repeat_ngram: int = 3  # 0 = off
    known_words: bool = True  # every word: a training or source word (masked numbers, <unk>: source only)
    no_repeat_words: bool = True  # no word twice in a summary
    lead_baselines: list = field(default_factory=lambda: [8, 10, 12])
    bootstrap_samples: int = 1000
    limit: int = 0  # decode only the first N pairs; 0 = all
    pairs: str = ""  # a pairs file (.jsonl[.gz]: source, target, optional references) to score instead of `split`
    truncate_bytes: int = 0  # >0: cut summaries to this many UTF-8 bytes and report ROUGE recall (DUC: 75)


@dataclass
class OverfitConfig:
    max_loss: float = 0.05  # `make overfit` fails unless the final train NLL per token is below this
    min_exact_match: float = 0.9  # ...and greedy decoding reproduces at least this share of targets


@dataclass
class PlacementConfig:
    encoder_device: str = ""
    decoder_device: str = ""
    pipeline_chunks: int = 1


@dataclass
class BenchConfig:
    repeats: int = 5
    warmup: int = 2
    steps: int = 10  # optimizer steps per measured repeat
    find_batch_tokens: bool = True
    max_batch_tokens: int = 262_144
    rows: list = field(default_factory=list)  # practices to run; [] = all (names: `python -m summarizer bench`)
    decode_sentences: int = 500  # test sources decoded by the decoding rows (the KV-cache row takes the first 64)
    checkpoint: str = ""  # weights the decoding rows decode with; "" = the run's best.pt (a fresh model if none)


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    overfit: OverfitConfig = field(default_factory=OverfitConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir or f"checkpoints/{self.run.name}")

    @property
    def tensorboard_dir(self) -> Path:
        return Path(self.run.tensorboard_dir) / self.run.name


_CHOICES = {
    ("model", "activation"): ("gelu", "relu"),
    ("train", "precision"): ("auto", "fp32", "bf16", "fp16"),
    ("train", "sdpa_backend"): ("auto", "default", "math", "flash", "efficient", "explicit"),
    ("train", "schedule"): ("inverse_sqrt", "cosine", "linear", "constant"),
    ("train", "select_by"): ("loss", "rouge"),
    ("data", "spm_model_type"): ("unigram", "bpe"),
    ("eval", "split"): ("train", "valid", "test"),
    ("eval", "precision"): ("auto", "fp32", "bf16", "fp16"),
    ("eval", "quantize"): ("auto", "none", "int8"),
}


def _nearest(name: str, options, prefix: str = "") -> str:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.0)
    return f" Did you mean '{prefix}{match[0]}'?" if match else ""


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
    raise ConfigError(
        f"{key} must be {getattr(origin, '__name__', origin)}, got {value!r} ({type(value).__name__})")


def _merge(obj: Any, updates: dict, prefix: str = "") -> None:
    hints = typing.get_type_hints(type(obj))
    for name, value in updates.items():
        key = f"{prefix}{name}"
        if name not in hints:
            raise ConfigError(f"unknown config key '{key}'.{_nearest(name, hints, prefix)}")
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


def validate(cfg: Config) -> None:
    for (section, name), options in _CHOICES.items():
        value = getattr(getattr(cfg, section), name)
        if value not in options:
            raise ConfigError(f"{section}.{name} must be one of {options}, got {value!r}."
                              f"{_nearest(str(value), options)}")
    m, t, d, e = cfg.model, cfg.train, cfg.data, cfg.eval
    positive = {"model.d_model": m.d_model, "model.n_heads": m.n_heads, "model.ffn_dim": m.ffn_dim,
                "model.encoder_layers": m.encoder_layers, "model.decoder_layers": m.decoder_layers,
                "model.max_positions": m.max_positions, "train.lr": t.lr, "train.accum_steps": t.accum_steps,
                "train.max_steps": t.max_steps, "train.log_every": t.log_every, "train.eval_every": t.eval_every,
                "train.ckpt_every": t.ckpt_every, "train.keep_last": t.keep_last,
                "train.max_bad_steps": t.max_bad_steps,
                "data.batch_tokens": d.batch_tokens, "data.vocab_size": d.vocab_size,
                "data.pad_multiple": d.pad_multiple, "data.max_source_len": d.max_source_len,
                "data.max_target_len": d.max_target_len, "data.max_source_words": d.max_source_words,
                "data.max_target_words": d.max_target_words, "data.num_proc": d.num_proc,
                "data.prefetch_factor": d.prefetch_factor, "data.subword_nbest": d.subword_nbest,
                "eval.beam_size": e.beam_size,
                "eval.batch_tokens": e.batch_tokens, "eval.max_len": e.max_len,
                "eval.bootstrap_samples": e.bootstrap_samples,
                "placement.pipeline_chunks": cfg.placement.pipeline_chunks, "bench.repeats": cfg.bench.repeats,
                "bench.steps": cfg.bench.steps, "bench.decode_sentences": cfg.bench.decode_sentences}
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
    not_negative = {"train.max_minutes": t.max_minutes, "train.warmup_steps": t.warmup_steps,
                    "train.weight_decay": t.weight_decay, "train.clip_norm": t.clip_norm,
                    "train.rouge_every": t.rouge_every, "train.rouge_samples": t.rouge_samples,
                    "train.patience": t.patience, "train.ema_decay": t.ema_decay,
                    "data.subword_alpha": d.subword_alpha, "train.profile_steps": t.profile_steps,
                    "train.sample_summaries": t.sample_summaries, "data.valid_holdout": d.valid_holdout,
                    "data.train_limit": d.train_limit, "eval.min_len": e.min_len, "eval.limit": e.limit,
                    "eval.threads": e.threads,
                    "eval.no_repeat_ngram": e.no_repeat_ngram, "eval.truncate_bytes": e.truncate_bytes,
                    "bench.warmup": cfg.bench.warmup}
    for key, value in not_negative.items():
        if value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")
    if e.min_len > e.max_len:
        raise ConfigError(f"eval.min_len ({e.min_len}) exceeds eval.max_len ({e.max_len}): no summary can satisfy "
                          f"both; lower eval.min_len or raise eval.max_len")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
    if len(t.betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in t.betas):
        raise ConfigError(f"train.betas must be two numbers in [0, 1), got {t.betas}")
    if m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model ({m.d_model}) must be divisible by model.n_heads ({m.n_heads})")
    for key, value in {"model.dropout": m.dropout, "model.attention_dropout": m.attention_dropout,
                       "train.label_smoothing": t.label_smoothing, "train.ema_decay": t.ema_decay}.items():
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{key} must be in [0, 1), got {value}")
    if d.vocab_size < 8:
        raise ConfigError(f"data.vocab_size must be at least 8 (4 special ids + pieces), got {d.vocab_size}")
    if d.max_source_len + 2 > m.max_positions or d.max_target_len + 2 > m.max_positions:
        raise ConfigError("data.max_source_len/max_target_len (+2 for bos/eos) must fit model.max_positions")
    if d.batch_tokens < d.max_source_len + d.max_target_len:
        raise ConfigError(f"data.batch_tokens ({d.batch_tokens}) must hold one full-length pair "
                          f"({d.max_source_len + d.max_target_len} tokens)")
    if t.select_by == "rouge" and t.rouge_every <= 0:
        raise ConfigError("train.select_by=rouge needs train.rouge_every > 0")
    for key, value in {"data.num_workers": d.num_workers, "train.cpu_kernel_cache": t.cpu_kernel_cache}.items():
        if value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")
    if not isinstance(d.splits, dict) or "train" not in d.splits:
        raise ConfigError("data.splits must map 'train' (and optionally 'valid', 'test') to source split names")


def read_yaml(path: Path) -> dict:
    """A config file's mapping of sections; one clear error for each way the file can be wrong."""
    if path.is_dir():
        raise ConfigError(f"--config {path} is a directory; give a YAML file, e.g. configs/base.yaml")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (see configs/ for examples)")
    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8"))
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


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Defaults, then the YAML file, then each override in order; validated."""
    cfg = Config()
    if path:
        _merge(cfg, read_yaml(Path(path)))
    for text in overrides:
        _merge(cfg, parse_override(text, cfg))
    validate(cfg)
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(data: dict) -> Config:
    """Rebuild a Config from a checkpoint's dict; unknown keys fail loudly (format drift)."""
    cfg = Config()
    _merge(cfg, data)
    return cfg


def save_config(cfg: Config, path: str | Path) -> None:
    from summarizer.outputs import atomic_write
    atomic_write(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))

