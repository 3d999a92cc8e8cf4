"""The one typed config schema: nested dataclasses, one per section, each key's rules beside its field.

The dataclass defaults are the reference recipe, documented key by key in configs/base.yaml (a test
keeps the two equal). They live in code so that an installed package needs no YAML to run.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
# Sections whose every key may change when a run resumes (where it runs, how to evaluate, place or benchmark
# it, and names); in the other sections only keys marked resume=True may (summarizer/config/resume.py).
RESUMABLE_SECTIONS = ("run", "system", "eval", "placement", "bench", "overfit")


def key(default: Any, *, choices: tuple = (), above: float | None = None, low: float | None = None,
        below: float | None = None, high: float | None = None, resume: bool = False, bookkeeping: bool = False):
    """A config field with its rules beside it, read by `checks.validate`, `resume` and the harness' `report`:
    allowed `choices`; bounds (`above` < value, `low` <= value, value < `below`, value <= `high`); whether it
    may change when a run resumes; whether it is `bookkeeping` (a name or path, not part of the experiment)."""
    meta = {"choices": choices, "above": above, "low": low, "below": below, "high": high, "resume": resume,
            "bookkeeping": bookkeeping}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def rules(section: str, name: str) -> dict:
    """The rules `key` put beside one field (empty for a field without any)."""
    for f in dataclasses.fields(SECTIONS[section]):
        if f.name == name:
            return dict(f.metadata)
    raise KeyError(f"{section}.{name}")


@dataclass
class RunConfig:
    name: str = key("base", bookkeeping=True)
    dir: str = key("", bookkeeping=True)  # default: checkpoints/<name>
    tensorboard_dir: str = key("runs", bookkeeping=True)  # events go to <tensorboard_dir>/<name>


@dataclass
class SystemConfig:
    """Where and how any command runs (train, eval, summarize, bench): the section runtime.setup reads."""
    device: str = key("auto", resume=True)  # auto | cpu | cuda | cuda:N
    deterministic: bool = key(False, resume=True)  # torch.use_deterministic_algorithms
    flush_denormal: bool = key(True, resume=True)  # CPU: denormal floats as zero (FTZ/DAZ): no slow path
    # auto (explicit on CPU; on CUDA flash, efficient, math: not cuDNN's) | default (torch's choice) | math | flash
    # | efficient | explicit
    sdpa_backend: str = key("auto", choices=("auto", "default", "math", "flash", "efficient", "explicit"), resume=True)
    cudnn_benchmark: bool = key(True, resume=True)
    cpu_kernel_cache: int = key(8192, low=0, resume=True)


@dataclass
class DataConfig:
    source: Any = key("hf:Harvard/gigaword", resume=True)  # "hf:NAME[:SUBSET]", a directory, or {split: [files]}
    # the directory that data.source's relative paths are read from ("" = the working directory): a recipe that
    # reads several sources names them under one root (configs/two_stage.yaml), which a user sets once
    root: str = key("", resume=True, bookkeeping=True)
    dir: str = key("data/gigaword", resume=True, bookkeeping=True)
    source_field: str = key("source", resume=True)
    target_field: str = key("target", resume=True)
    references_field: str = key("references", resume=True)
    # product split -> source split names (file stems or hub split names); missing names are skipped
    splits: dict = key({"train": ["train", "valid"], "valid": [], "test": ["test_dev", "test"]}, resume=True)
    # >0 and no valid split mapped: hold this many train pairs out as the valid split (with data.source_tag set,
    # pairs of that tag only: validation scores the style that inference asks for)
    valid_holdout: int = key(500, low=0, resume=True)
    rebuild: bool = key(False, resume=True, bookkeeping=True)  # prep: replace a prepared dir, changed or not
    train_limit: int = key(0, low=0)  # >0: train on only the first N prepared train pairs (overfit checks)
    # source tag -> how many times an epoch its train pairs are drawn, on average (1 = once; 0.5 = half of them)
    source_weights: dict = key({})
    lowercase: bool = True  # applied at prep and at `summarize`
    mask_digits: bool = True  # every digit -> '#', as Gigaword's preprocessing did
    # words split the Penn Treebank way (`it 's`, `-lrb-`) at prep and at inference, as Gigaword's text is, so
    # raw input and every other source look like it; "none": whitespace only
    word_tokenizer: str = key("ptb", choices=("ptb", "none"))
    # a tag name: each pair's source tag (data.source entries' `tag`) is one piece before its source; text with
    # no tag (untagged splits, eval.pairs, `summarize` input) gets this one; "" = no tag pieces
    source_tag: str = ""
    max_source_words: int = key(120, above=0, resume=True)  # cleaning: longer pairs are dropped and counted
    max_target_words: int = key(40, above=0, resume=True)
    vocab_size: int = key(8000, above=0)
    spm_model_type: str = key("unigram", choices=("unigram", "bpe"), resume=True)
    spm_character_coverage: float = key(1.0, above=0.0, high=1.0, resume=True)
    spm_input_sentence_size: int = key(2_000_000, above=0, resume=True)
    num_proc: int = key(2, above=0, resume=True)  # processes for prep's cleaning and tokenizing (not its vocabulary)
    max_source_len: int = key(96, above=0)  # tokens; longer sources are truncated when batched
    max_target_len: int = key(40, above=0)
    subword_alpha: float = key(0.0, low=0)  # >0: sampled segmentations (subword regularisation), smoothing
    subword_nbest: int = key(8, above=0)  # ...drawn among each word's n best segmentations
    # denoising examples (data prepared with `unpaired` sources): share of a sentence's words masked, in spans
    noise_words: float = key(0.3, above=0, below=1)
    noise_span: float = key(3.0, above=0)  # mean masked span length in words (Poisson)
    batch_tokens: int = key(3000, above=0)  # token budget per micro-batch (padded source + target)
    bucket_size: int = key(1000, above=0)  # batches per length-sorted pool; larger = less padding, less randomness
    pad_multiple: int = key(4, above=0)  # pad batch lengths to a multiple of this: fewer shapes for kernel caches
    pad_rows: bool = True  # empty rows fill each batch to batch_tokens at its lengths: a shape per pair of lengths
    num_workers: int = key(2, low=0, resume=True)
    pin_memory: bool = key(True, resume=True)  # only has an effect on CUDA
    persistent_workers: bool = key(True, resume=True)
    prefetch_factor: int = key(4, above=0, resume=True)


@dataclass
class ModelConfig:
    d_model: int = key(256, above=0)
    n_heads: int = key(4, above=0)
    encoder_layers: int = key(3, above=0)
    decoder_layers: int = key(3, above=0)
    ffn_dim: int = key(1024, above=0)
    dropout: float = key(0.1, low=0, below=1)
    attention_dropout: float = key(0.0, low=0, below=1)
    fast_dropout: bool = True  # CPU masks from numpy's SFC64 instead of bernoulli_ (summarizer/model/dropout.py)
    activation: str = key("relu", choices=("gelu", "relu"))  # feed-forward non-linearity
    bias: bool = False  # additive biases in linear and LayerNorm layers (the copy gate keeps its own)
    max_positions: int = key(512, above=0)
    copy: bool = True  # pointer-generator copy attention over source tokens


@dataclass
class TrainConfig:
    seed: int = 1234
    # a checkpoint (best.pt or ckpt_*.pt of a run on the same prepared data) whose weights a new run starts from,
    # with a fresh optimizer and schedule (fine-tuning after a pre-training stage); a resumed run ignores it
    init_from: str = key("", resume=True)
    precision: str = key("auto", choices=PRECISIONS, resume=True)
    max_steps: int = key(10_000, above=0, resume=True)
    max_minutes: float = key(0.0, low=0, resume=True)  # 0 = no time limit
    accum_steps: int = key(1, above=0)
    lr: float = key(1e-3, above=0, resume=True)
    warmup_steps: int = key(400, low=0, resume=True)
    schedule: str = key("inverse_sqrt", choices=("inverse_sqrt", "cosine", "linear", "constant"),
                        resume=True)  # after warm-up
    min_lr_ratio: float = key(0.0, low=0, high=1, resume=True)  # floor for cosine/linear, as a fraction of lr
    weight_decay: float = key(0.01, low=0)
    betas: list = field(default_factory=lambda: [0.9, 0.98])
    label_smoothing: float = key(0.1, low=0, below=1)
    ema_decay: float = key(0.999, low=0, below=1)  # weights' moving average, validated, kept in best.pt; 0 = off
    clip_norm: float = key(1.0, low=0, resume=True)  # 0 = no clipping (the norm is still logged)
    max_bad_steps: int = key(5, above=0, resume=True)  # abort after this many non-finite steps in a row
    # Loss spikes (summarizer/train/watch/spikes.py): a step loss above mean + spike_factor * std of the last
    # spike_window steps rolls back to the newest checkpoint and skips that step's batches; 0 = off
    spike_factor: float = key(0.0, low=0, resume=True)
    spike_window: int = key(100, above=1, resume=True)
    spike_max_rollbacks: int = key(3, above=0, resume=True)  # this many within spike_window steps: stop
    skip_batches: list = key([], resume=True)  # [[epoch, position], ...] of the data order never trained on
    set_to_none: bool = key(True, resume=True)
    fused_optimizer: bool = key(True, resume=True)  # AdamW(fused=True): one kernel for all parameters (CPU and CUDA)
    fused_loss: bool = key(True, resume=True)  # one-pass vocabulary loss with an in-place backward (losses.VocabStats)
    compile: bool = key(False, resume=True)  # torch.compile the layers: runtime.compile_model
    # torch.compile's mode: reduce-overhead also replays CUDA graphs, one per batch shape (data.pad_rows keeps them
    # few); on a CPU it compiles as default does
    compile_mode: str = key("default", choices=("default", "reduce-overhead", "max-autotune",
                                                "max-autotune-no-cudagraphs"), resume=True)
    # capture each batch shape's whole step (forward to AdamW) as a CUDA graph and replay it: one launch a step
    # instead of one per kernel (one GPU, one process; summarizer/train/graphs.py); elsewhere the step runs eagerly
    cuda_graphs: bool = key(True, resume=True)
    log_every: int = key(50, above=0, resume=True)  # host syncs (.item()) happen only here
    module_stats: bool = key(True, resume=True)  # per-module gradient/update/weight norms, activation RMS
    eval_every: int = key(500, above=0, resume=True)
    rouge_every: int = key(500, low=0, resume=True)  # 0 = off
    rouge_samples: int = key(500, low=0, resume=True)
    select_by: str = key("rouge", choices=("loss", "rouge"))
    patience: int = key(0, low=0, resume=True)  # evaluations without improvement before stopping; 0 = off
    ckpt_every: int = key(500, above=0, resume=True)
    keep_last: int = key(2, above=0, resume=True)
    peak_flops: float = key(0.0, low=0, resume=True)  # FLOP/s per device that MFU is measured against; 0 = look up
    profile_steps: int = key(0, low=0, resume=True)  # >0: torch.profiler trace of this many steps
    profile_after: int = key(1, above=0, resume=True)  # steps of the process before them (and one warm-up step)
    sample_summaries: int = key(3, low=0, resume=True)  # text samples logged to TensorBoard at each eval


@dataclass
class EvalConfig:
    split: str = key("test", choices=("train", "valid", "test"))
    checkpoint: str = key("", bookkeeping=True)  # default: the run's best
    out_dir: str = key("", bookkeeping=True)  # default: the run dir
    beam_size: int = key(4, above=0)
    # padded source tokens x beam_size per decoding batch (the decoder's rows); 0 = auto: 16,384 on a CPU, 2,097,152
    # on a GPU, where a step's time is kernel launches and a batch of thousands of rows costs what one of hundreds
    # does (a batch the GPU has no memory for is decoded in halves)
    batch_tokens: int = key(0, low=0)
    threads: int = key(0, low=0)  # batches decoded at once, one core each; 0 = one per core on CPU, 1 on GPU
    # decoding: auto = fp32 (TF32) on a GPU; on a CPU fp32 with int8 layers, or, with quantize=none, train.precision's
    # rule: bf16 where the CPU has AVX-512 BF16 or AMX, else fp32 (decode/quantize.py decoding_precision)
    precision: str = key("auto", choices=PRECISIONS)
    quantize: str = key("auto", choices=("auto", "none", "int8"))  # auto: int8 where decoding runs on CPU in fp32
    # static: a fixed-size KV cache and every row kept to the batch's end, one shape for every step, which a GPU
    # replays as a CUDA graph (summarizer/decode/static.py); auto = static for greedy on a GPU, else dynamic (measured)
    shapes: str = key("auto", choices=("auto", "static", "dynamic"))
    max_len: int = key(30, above=0)  # target tokens
    min_len: int = key(8, low=0)  # tokens; headlines near the references' length: docs/results.md
    length_penalty: float = 2.0  # measured on test_dev and DUC-2003: docs/results.md
    no_repeat_ngram: int = key(3, low=0)  # 0 = off
    known_words: bool = True  # every word: a training or source word (masked numbers, <unk>: source only)
    no_repeat_words: bool = True  # no word twice in a summary
    lead_baselines: list = field(default_factory=lambda: [8, 10, 12])
    bootstrap_samples: int = key(1000, above=0)
    limit: int = key(0, low=0)  # decode only the first N pairs; 0 = all
    pairs: str = ""  # a pairs file (.jsonl[.gz]: source, target, optional references) to score instead of `split`
    readable: bool = True  # summarize prints headlines for people (case, punctuation, no <unk>); false: as scored
    truncate_bytes: int = key(0, low=0)  # >0: cut summaries to this many UTF-8 bytes and report ROUGE recall (DUC: 75)


@dataclass
class OverfitConfig:
    max_loss: float = key(0.05, above=0)  # `make overfit` fails unless the final train NLL per token is below this
    min_exact_match: float = key(0.9, low=0, high=1)  # ...and greedy decoding reproduces at least this share of targets


@dataclass
class PlacementConfig:
    encoder_device: str = ""
    decoder_device: str = ""
    pipeline_chunks: int = key(1, above=0)


@dataclass
class BenchConfig:
    repeats: int = key(5, above=0)
    warmup: int = key(2, low=0)
    steps: int = key(10, above=0)  # optimizer steps per measured repeat
    find_batch_tokens: bool = True
    max_batch_tokens: int = key(262_144, above=0)
    rows: list = field(default_factory=list)  # practices to run; [] = all (a wrong name is told them all)
    decode_sentences: int = key(500, above=0)  # test sources the decoding rows decode (KV-cache row: first 64)
    checkpoint: str = ""  # weights the decoding rows decode with; "" = the run's best.pt (a fresh model if none)


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
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


SECTIONS: dict[str, type] = typing.get_type_hints(Config)  # section name -> its dataclass


def nearest(value: str, options) -> str:
    """" Did you mean '...'?" for a value outside its `options` (a key's choices): the closest one."""
    match = difflib.get_close_matches(value, list(options), n=1, cutoff=0.0)
    return f" Did you mean '{match[0]}'?" if match else ""


def nearest_key(name: str, options, prefix: str = "") -> str:
    """" Did you mean '...'?" for an unknown key `prefix`+`name`: the same name in another section (`dropout` under
    train: model.dropout), else a close name in this section, else a close dotted key anywhere; "" if none is close."""
    name = str(name)
    elsewhere = [f"{section}.{name}" for section, cls in SECTIONS.items()
                 if name in typing.get_type_hints(cls) and f"{section}." != prefix]
    if elsewhere:
        return f" Did you mean '{elsewhere[0]}'?"
    match = difflib.get_close_matches(name, [str(o) for o in options], n=1, cutoff=0.6)
    if match:
        return f" Did you mean '{prefix}{match[0]}'?"
    dotted = [f"{section}.{field}" for section, cls in SECTIONS.items() for field in typing.get_type_hints(cls)]
    match = difflib.get_close_matches(f"{prefix}{name}", dotted, n=1, cutoff=0.6)
    return f" Did you mean '{match[0]}'?" if match else ""
