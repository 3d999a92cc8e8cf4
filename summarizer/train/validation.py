"""What training measures on held-out pairs: loss, greedy ROUGE and the quality rates, sample summaries,
and which checkpoint is the best so far (train.select_by)."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

from summarizer import runtime
from summarizer.config.schema import Config
from summarizer.data.batches import PairDataset
from summarizer.data.prepared import read_pairs, training_words, valid_split
from summarizer.data.tokenizer import Tokenizer
from summarizer.decode.lexicon import lexicon
from summarizer.decode.search import decode_all
from summarizer.evaluation.scoring import ROUGE_TYPES, quality, rouge_report, words
from summarizer.model import checkpoint
from summarizer.runtime import Runtime, move_batch
from summarizer.runtime.placement import place_model
from summarizer.train.guard import StopFlag
from summarizer.train.losses import smoothed_nll
from summarizer.train.session import Session
from summarizer.train.watch.module_stats import activation_rms

CHECK_EVERY = 32  # validation batches between the points where a stop signal may abandon the loss pass


@torch.inference_mode()
def evaluate_loss(model: nn.Module, loader, rt: Runtime, activations: bool = False, check=None) -> dict:
    """Token-level NLL and perplexity of a split, without dropout or graph building; with `activations`, the
    RMS of each block's output too (summarizer/train/watch/module_stats.py; under DDP, of this rank's share).
    `check` (StopFlag.check) runs every CHECK_EVERY batches, as often on every rank: under DDP a collective, and
    the ranks' shares of the split differ in batches, so each checks as often as the longest share needs."""
    nlls, tokens, checked = [], 0, 0
    checks = max(runtime.all_gather_object(len(loader), rt)) // CHECK_EVERY if check is not None else 0
    with runtime.eval_mode(model), activation_rms(model, activations) as rms:
        for i, batch in enumerate(loader, start=1):
            batch = move_batch(batch, rt.device)
            with rt.compute():
                out = model(batch["src_ids"], batch["tgt_in"])
            nlls.append(smoothed_nll(out, batch["tgt_out"], batch["src_ids"], 0.0)[1].double().to(rt.device))
            tokens += batch["n_tgt"]
            if i % CHECK_EVERY == 0 and checked < checks:
                check()
                checked += 1
    for _ in range(checked, checks):  # a share shorter than the longest: its checks still to match the others'
        check()
    nll_sum = torch.stack(nlls).sum() if nlls else torch.zeros((), dtype=torch.float64, device=rt.device)
    totals = runtime.all_reduce_sum(torch.stack([nll_sum, torch.tensor(float(tokens), device=rt.device,
                                                                       dtype=torch.float64)]), rt)
    loss = float(totals[0] / totals[1].clamp_min(1))
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": int(totals[1]), **rms}


# What validation ROUGE depends on besides the weights (keys a resumed run may change), and the precision it
# decodes in (the run's, resolved): a best value holds against another only where both were measured under the same
ROUGE_SETTINGS = ("train.rouge_samples", "eval.max_len", "eval.min_len", "eval.no_repeat_ngram",
                  "eval.known_words", "eval.no_repeat_words", "eval.truncate_bytes")


def rouge_settings(s: Session) -> dict:
    return {**{key: getattr(getattr(s.cfg, key.split(".")[0]), key.split(".")[1]) for key in ROUGE_SETTINGS},
            "precision": s.rt.precision}


def validate(s: Session, extra: dict, rouge: bool, stop: StopFlag | None = None) -> bool:
    """Validation loss, ROUGE on a fixed valid subset when due, samples, and best-checkpoint
    bookkeeping by `train.select_by`; True when patience runs out. A stop signal may abandon the measuring
    (StopRequested; `stop`, the run's StopFlag: under DDP at the checks between its parts, on every rank together),
    never the bookkeeping after it."""
    settings = rouge_settings(s)
    check = stop.check if stop is not None else lambda: None
    with stop.interruptible() if stop is not None else contextlib.nullcontext():
        # Every rank decodes the same subset deterministically, so all agree on the best without talking; each reads
        # best.pt before evaluate_loss's all-reduce, which no rank passes before all reach it, so before it is replaced
        rescored, best_again = rescore_best(s, settings, check) if rouge else (None, {})
        check()
        started = time.perf_counter()
        metrics = evaluate_loss(s.eval_model, s.valid_loader, s.rt, s.cfg.train.module_stats,
                                stop.check if stop is not None else None)
        metrics["tokens_per_s"] = metrics["tokens"] / (time.perf_counter() - started)
        check()
        if rouge:  # logged with what it was measured under, and best.pt's ROUGE under that where it was re-scored
            metrics.update(valid_rouge(s, s.eval_model, check), rouge_settings=settings, **best_again)
            check()
        samples = sample_summaries(s.eval_model, s.valid_ds, s.tokenizer, s.rt, s.cfg) \
            if s.rt.is_main and s.cfg.train.sample_summaries else None
    if rescored is not None:
        s.progress["best"] = rescored
    s.monitor.log(s.progress["step"], "valid", {**metrics, **extra})
    if samples is not None:
        s.monitor.text("samples", samples, s.progress["step"])
    metric = "rouge1" if s.cfg.train.select_by == "rouge" else "loss"
    if metric not in metrics:
        return False  # the best is judged only where ROUGE was measured
    if improves(metric, metrics[metric], s.progress["best"]):
        s.progress.update(best={"metric": metric, "value": metrics[metric],
                                **({"settings": settings} if metric == "rouge1" else {})}, bad_evals=0)
        if s.rt.is_main:
            checkpoint.save(s.best_snapshot(), s.cfg.run_dir / checkpoint.BEST)
    else:
        s.progress["bad_evals"] += 1
    return bool(s.cfg.train.patience) and s.progress["bad_evals"] >= s.cfg.train.patience


def improves(metric: str, value: float, best: dict | None) -> bool:
    """Is `value` of `metric` better than the best so far? Loss falls, ROUGE rises."""
    if best is None:
        return True
    return value < best["value"] if metric == "loss" else value > best["value"]


def rescore_best(s: Session, settings: dict, check: Callable[[], None] | None = None) -> tuple[dict | None, dict]:
    """The best so far as these `settings` score it, where its ROUGE was measured under others (a run resumed with
    some of ROUGE_SETTINGS changed): best.pt's weights decoded again, said on stderr; and for the validation's
    record, best.pt's step and ROUGE so measured (best_step, best_rouge1, ...). (None, {}) where nothing changed
    (or the best predates the record of its settings, or is a loss)."""
    best = s.progress["best"]
    if not best or best["metric"] != "rouge1" or best.get("settings", settings) == settings:
        return None, {}
    path, again = s.cfg.run_dir / checkpoint.BEST, {}
    if path.is_file():
        state = checkpoint.load(path)
        scores = valid_rouge(s, place_model(checkpoint.restore_model(state), s.rt).eval(), check)
        value = scores["rouge1"]
        again = {"best_step": state["progress"]["step"], **{f"best_{kind}": scores[kind] for kind in ROUGE_TYPES}}
    else:  # removed by hand: nothing to compare with
        value = float("-inf")
    changed = ", ".join(f"{key} {best['settings'].get(key)!r} -> {now!r}" for key, now in settings.items()
                        if best["settings"].get(key) != now)
    if s.rt.is_main:
        print(f"best.pt (ROUGE-1 {best['value']:.4f}) was scored with other settings ({changed}): "
              f"{value:.4f} with these, which later validations are compared with", file=sys.stderr, flush=True)
    return {**best, "value": value, "settings": settings}, again


def valid_rouge(s: Session, model: nn.Module, check: Callable[[], None] | None = None) -> dict:
    """Greedy ROUGE-1/2/L F and the quality rates (non-words, repeats, length) of `model` on the first
    `train.rouge_samples` valid pairs: fast, and comparable across steps. `check`: the stop point between batches
    (decode_all)."""
    if s.rouge_pairs is None:
        s.rouge_pairs = read_pairs(s.cfg.data.dir, valid_split(s.meta), s.cfg.train.rouge_samples)
    pairs = s.rouge_pairs
    hyps = decode_all(model, [s.valid_ds[i][0] for i in range(len(pairs))],
                      dataclasses.replace(s.cfg.eval, beam_size=1), s.rt, lexicon=lexicon(s.cfg.data.dir), check=check)
    predictions = [s.tokenizer.decode(h) for h in hyps]
    references = [p.get("references") or [p["target"]] for p in pairs]
    report = rouge_report(predictions, references, samples=0)
    rates = quality(predictions, [[words(p["source"])] for p in pairs], references, training_words(s.cfg.data.dir))
    return {**{kind: report[kind]["f"] for kind in ROUGE_TYPES}, **rates}


def sample_summaries(model, dataset: PairDataset, tokenizer: Tokenizer, rt: Runtime, cfg: Config) -> str:
    """Greedy summaries of the first `train.sample_summaries` valid pairs, as Markdown for TensorBoard."""
    pairs = [dataset[i] for i in range(min(cfg.train.sample_summaries, len(dataset)))]
    hyps = decode_all(model, [s for s, _ in pairs], dataclasses.replace(cfg.eval, beam_size=1), rt,
                      lexicon=lexicon(cfg.data.dir))
    return "\n\n".join(f"source: {tokenizer.decode(s.tolist())}  \nreference: {tokenizer.decode(t.tolist())}  \n"
                       f"greedy: {tokenizer.decode(h)}" for (s, t), h in zip(pairs, hyps, strict=True))
