"""The bench's decoding rows: today's decoder against commit 9415323's (summarizer/bench/decoding_v1.py),
int8 and 16-bit against float32, the word rules' cost, and summarize end to end; variants alternate in one
process, on a trained checkpoint and real test sources, with the ROUGE of what each decoded."""
from __future__ import annotations

import copy
import dataclasses
import functools
import io
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from summarizer import runtime
from summarizer.bench import decoding_v1
from summarizer.bench.training import stats
from summarizer.config.schema import Config
from summarizer.data.batches import PairDataset, pad_sources
from summarizer.data.prepared import load_split, open_tokenizer, read_meta, read_pairs, valid_split
from summarizer.decode.inference import load_model, read_eval_pairs
from summarizer.decode.lexicon import lexicon
from summarizer.decode.quantize import decoding_form, decoding_precision, resolve_quantize
from summarizer.decode.search import decode_all
from summarizer.errors import ConfigError
from summarizer.evaluation.scoring import rouge_report
from summarizer.model import checkpoint
from summarizer.outputs import atomic_write
from summarizer.runtime.profiling import per_step
from summarizer.train.session import build


def weights(cfg: Config) -> Path:
    """The checkpoint the decoding rows decode with: bench.checkpoint (refused if it is not a file: a fresh model
    would be timed and scored in its place), else the run's best.pt."""
    if not cfg.bench.checkpoint:
        return cfg.run_dir / checkpoint.BEST
    path = Path(cfg.bench.checkpoint)
    if not path.is_file():
        raise ConfigError(f"bench.checkpoint={path} is not a file: give a checkpoint (.pt), or leave it empty to "
                          f"decode with the run's best.pt")
    return path


def check_weights(cfg: Config) -> None:
    """Refuse, before any row runs, weights trained with another tokenizer than `data.dir`'s (as eval does):
    their decoding would be timed and scored on ids that mean other words to them."""
    path = weights(cfg)
    if path.is_file():
        checkpoint.check_tokenizer(checkpoint.load(path)["data_meta"], read_meta(cfg.data.dir), f"checkpoint {path}")


def _model(cfg: Config, rt: runtime.Runtime, quantize: str = "none"):
    """The weights to decode with (`weights`), loaded as eval loads them (refused beside another tokenizer's
    data), or a fresh model if there are none (speed only)."""
    path = weights(cfg)
    if path.is_file():
        return load_model(path, rt, read_meta(cfg.data.dir), quantize, cfg)[0]
    torch.manual_seed(cfg.train.seed)
    model = build(cfg, rt, read_meta(cfg.data.dir))[0].cpu()
    return decoding_form(runtime.unwrap(model), rt, quantize).to(rt.device).eval()


def _sources(cfg: Config) -> tuple[list[list[int]], list[list[str]]]:
    """The first bench.decode_sentences test (else valid) sources as ids, and their references."""
    split = "test" if "test" in read_meta(cfg.data.dir)["splits"] else "valid"
    arrays, pairs = load_split(cfg.data.dir, split), read_pairs(cfg.data.dir, split)
    n = min(cfg.bench.decode_sentences, len(pairs))
    ids = [arrays.src[arrays.src_offsets[i]:arrays.src_offsets[i + 1]][:cfg.data.max_source_len].tolist()
           for i in range(n)]
    return ids, [p.get("references") or [p["target"]] for p in pairs[:n]]


def v1_decode(model, sources: list[list[int]], settings, rt: runtime.Runtime) -> list[list[int]]:
    """The decoding loop of commit 9415323: 64 sentences a batch, sorted by length, its greedy or beam search."""
    order = np.argsort([len(s) for s in sources], kind="stable")
    hyps: list = [None] * len(sources)
    common = dict(max_len=settings.max_len, min_len=settings.min_len, no_repeat_ngram=settings.no_repeat_ngram)
    with torch.inference_mode():
        for start in range(0, len(order), 64):
            idx = order[start:start + 64]
            src = runtime.move(pad_sources([sources[i] for i in idx]), rt.device)
            with rt.compute():
                out = decoding_v1.beam_search(model, src, settings.beam_size, length_penalty=settings.length_penalty,
                                              **common) if settings.beam_size > 1 else decoding_v1.greedy(model, src,
                                                                                                          **common)
            for i, hyp in zip(idx, out, strict=True):
                hyps[i] = hyp
    return hyps


def alternate(variants: dict[str, Callable[[], list]], cfg: Config, count: int) -> tuple[dict, dict]:
    """Time each variant `bench.warmup + bench.repeats` times, taking turns (on, off, off, on, ...);
    (per variant: stats of items per second, and the outputs of its last run)."""
    rates, outputs = {k: [] for k in variants}, {}
    names = list(variants)
    for repeat in range(cfg.bench.warmup + cfg.bench.repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            started = time.perf_counter()
            outputs[name] = variants[name]()
            if repeat >= cfg.bench.warmup:
                rates[name].append(count / (time.perf_counter() - started))
    summary = {k: stats(v) for k, v in rates.items()}
    return summary, outputs


def decode_row(cfg: Config, beam: int, against: str) -> dict:
    """sentences/s of today's decoder ("on") against `against` ("off"): "v1" (today's default
    eval.quantize against commit 9415323's float32, word rules off on both, so outputs can be compared),
    "int8" (against float32), "bf16" (decoding precision), "rules" (the word rules on, against off, at
    the default eval.quantize) or "shapes" (static shapes, a CUDA graph per step on a GPU, against dynamic, in
    float32 with the word rules on); with each side's ROUGE-1 on the decoded sentences and whether outputs agree."""
    rt = runtime.setup(cfg.system, cfg.placement, "fp32")
    sources, references = _sources(cfg)
    tokenizer, lex = open_tokenizer(cfg.data.dir), lexicon(cfg.data.dir)
    plain = dataclasses.replace(cfg.eval, beam_size=beam, known_words=False, no_repeat_words=False,
                                truncate_bytes=0)
    rt_default = runtime.setup(cfg.system, cfg.placement, decoding_precision(cfg))  # as `eval` decodes by default
    model, default = _model(cfg, rt), _model(cfg, rt_default, resolve_quantize(cfg.eval.quantize, rt_default))
    ruled = dataclasses.replace(plain, known_words=True, no_repeat_words=True)
    on_settings = ruled if against == "rules" else plain
    variants = {"on": lambda: decode_all(default, sources, on_settings, rt_default, lexicon=lex)}
    if against == "v1":
        variants["off"] = lambda: v1_decode(model, sources, plain, rt)
    elif against == "int8":
        quantized = _model(cfg, rt, "int8")
        variants = {"on": lambda: decode_all(quantized, sources, plain, rt, lexicon=lex),
                    "off": lambda: decode_all(model, sources, plain, rt, lexicon=lex)}
    elif against == "shapes":
        variants = {side: functools.partial(decode_all, model, sources, dataclasses.replace(ruled, shapes=shapes),
                                            rt, lexicon=lex) for side, shapes in (("on", "static"), ("off", "dynamic"))}
    elif against in ("bf16", "fp16"):
        rt16 = runtime.setup(cfg.system, cfg.placement, against)
        model16 = decoding_form(copy.deepcopy(model), rt16, "none")
        variants = {"on": lambda: decode_all(model16, sources, plain, rt16, lexicon=lex),
                    "off": lambda: decode_all(model, sources, plain, rt, lexicon=lex)}
    else:
        variants["off"] = lambda: decode_all(default, sources, plain, rt_default, lexicon=lex)
    result, outputs = alternate(variants, cfg, len(sources))
    for side, hyps in outputs.items():
        result[side]["rouge1"] = rouge_report([tokenizer.decode(h) for h in hyps], references, 0)["rouge1"]["f"]
    result["same_outputs"] = outputs["on"] == outputs["off"]
    return result


def decode_rate(cfg: Config, use_cache: bool) -> dict:
    """Beam-4 sentences/s on the first `bench.decode_sentences` valid (or train) sources, in decoding's precision
    and the dynamic search on both sides (the static one has no cache-free form: on a GPU it would be the row)."""
    rt = runtime.setup(cfg.system, cfg.placement, decoding_precision(cfg))
    torch.manual_seed(cfg.train.seed)
    meta = read_meta(cfg.data.dir)
    model = build(cfg, rt, meta)[0]
    ds = PairDataset.from_dir(cfg.data.dir, valid_split(meta, speed_only=True), cfg.data)
    n = min(cfg.bench.decode_sentences, len(ds), 64)  # recomputing every prefix is slow
    sources = [ds[i][0] for i in range(n)]
    settings = dataclasses.replace(cfg.eval, beam_size=4, shapes="dynamic")
    rates, lex = [], lexicon(cfg.data.dir)
    for repeat in range(cfg.bench.warmup + cfg.bench.repeats):
        started = time.perf_counter()
        decode_all(model, sources, settings, rt, lexicon=lex, use_cache=use_cache)
        if repeat >= cfg.bench.warmup:
            rates.append(n / (time.perf_counter() - started))
    return stats(rates)


def summarize_row(cfg: Config, cuda: bool = False) -> dict:
    """lines/s of `summarize` on raw text (normalise, tokenize, decode, detokenize, write) with the default
    decoding settings ("on") against the same with eval.quantize=none on a CPU ("off": float32 linear layers),
    with a CPU's batches on a GPU (where the default has no int8 layers to take away: eval.batch_tokens=16384
    against its 2,097,152)."""
    from summarizer import summarize
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, checkpoint=str(weights(cfg))))
    unquantized = dataclasses.replace(cfg, eval=dataclasses.replace(
        cfg.eval, **({"batch_tokens": 16384} if cuda else {"quantize": "none"})))
    n = cfg.bench.decode_sentences
    split = "test" if "test" in read_meta(cfg.data.dir)["splits"] else "valid"
    text = "".join(p["source"] + "\n" for p in read_pairs(cfg.data.dir, split, n)).encode()

    def run(config: Config) -> list:
        out = io.StringIO()
        summarize.summarize_stream(config, io.BytesIO(text), out, quiet=True)
        return out.getvalue().splitlines()

    result, _ = alternate({"on": lambda: run(cfg), "off": lambda: run(unquantized)}, cfg, n)
    return result


def profile_row(cfg: Config, top: int = 12) -> dict:
    """Where a default-eval decode of the bench sources spends its time, by torch.profiler on one thread:
    the wall time, the share inside torch operators (their self times summed) and the rest (Python: the
    search's bookkeeping, the word rules), the operators that take most, each with its calls, and the values
    read back to the host per search step (a step: a `topk`, or greedy's `max`), at eval.beam_size. On a GPU also
    the time the device was busy, the operators that kept it busy most, and the kernel launches (graph replays
    counted once) per step; the whole table goes to decode_profile.txt."""
    from torch.profiler import ProfilerActivity, profile
    rt = runtime.setup(cfg.system, cfg.placement, decoding_precision(cfg))
    sources, _ = _sources(cfg)
    lex = lexicon(cfg.data.dir)
    model = _model(cfg, rt, resolve_quantize(cfg.eval.quantize, rt))
    beam = cfg.eval.beam_size
    settings = dataclasses.replace(cfg.eval, threads=1)
    decode_all(model, sources[:64], settings, rt, lexicon=lex)  # warm-up: first-call kernel selection
    cuda = "cuda" in (rt.device.type, rt.decoder_device.type)
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        started = time.perf_counter()
        decode_all(model, sources, settings, rt, lexicon=lex)
        wall = time.perf_counter() - started
    averages = prof.key_averages()
    events = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)
    steps = {e.key: e.count for e in events}.get("aten::topk" if beam > 1 else "aten::max", 0)
    summary = per_step(averages, steps, wall)
    ops_s = summary["ops_ms"] * summary["steps"] / 1e3  # per_step counts at least one step
    row = {"beam": beam, "sentences": len(sources), "wall_s": wall, "steps": steps, "ops_s": ops_s,
           "ops_share": ops_s / wall,
           "host_reads_per_step": summary["host_reads"], "top_ops": [
               {"op": e.key, "calls": e.count, "self_s": e.self_cpu_time_total / 1e6,
                "share": e.self_cpu_time_total / 1e6 / wall} for e in events[:top]]}
    sort = "self_cpu_time_total"
    if cuda:
        sort = "self_device_time_total"
        device = sorted(averages, key=lambda e: e.self_device_time_total, reverse=True)
        row["device_s"], row["device_share"] = summary["device_ms"] * summary["steps"] / 1e3, summary["device_share"]
        row["top_device_ops"] = [{"op": e.key, "calls": e.count, "self_s": e.self_device_time_total / 1e6}
                                 for e in device[:top]]
        row["launches_per_step"] = summary["launches"]
        row["device_syncs_per_step"] = device_syncs(lambda: decode_all(model, sources, settings, rt, lexicon=lex),
                                                    rt.decoder_device) / max(steps, 1)
    atomic_write(cfg.run_dir / "decode_profile.txt", averages.table(sort_by=sort, row_limit=-1))  # every operator
    return row


def device_syncs(work: Callable[[], object], device: torch.device) -> int:
    """How many times `work` made the host wait for the GPU: CUDA's sync debug mode warns at every operation that
    synchronizes (a value read back, a blocking copy either way, nonzero), which the operator counts of a profile
    only partly show (.tolist() and blocking copies are plain copies there)."""
    with torch.cuda.device(device), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            work()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def file_row(cfg: Config) -> dict:
    """Decoding as other toolkits time it: a file of raw text (`eval.pairs`, else the prepared test split) with
    the default eval, greedy and beam 4 taking turns, and start-up (the checkpoint, its int8 or bf16 form, the
    word rules' lexicon, reading and tokenizing the file) timed apart from decoding."""
    lexicon.cache_clear()  # built from scratch, as a fresh process would
    started = time.perf_counter()
    rt = runtime.setup(cfg.system, cfg.placement, decoding_precision(cfg))
    meta = read_meta(cfg.data.dir)
    tokenizer = open_tokenizer(cfg.data.dir, meta)
    name, _, ids = read_eval_pairs(cfg, meta, tokenizer)
    model, _ = load_model(weights(cfg), rt, meta, cfg.eval.quantize, cfg)
    lex = lexicon(cfg.data.dir)
    startup = time.perf_counter() - started
    settings = {f"beam {beam}": dataclasses.replace(cfg.eval, beam_size=beam) for beam in (1, 4)}
    searches = {k: functools.partial(decode_all, model, ids, s, rt, lexicon=lex) for k, s in settings.items()}
    rates, _ = alternate(searches, cfg, len(ids))
    return {"file": name, "sentences": len(ids), "startup_s": startup, "rates": rates}
