"""The tiny-dataset overfit check: a model that cannot memorise a few pairs has a bug, not a tuning problem."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from summarizer import runtime
from summarizer.config.schema import Config
from summarizer.data.batches import PairDataset, TokenBatchSampler, make_loader
from summarizer.data.prepared import read_meta
from summarizer.decode.inference import load_model
from summarizer.decode.search import decode_all
from summarizer.model import checkpoint
from summarizer.outputs import claim_dir
from summarizer.train.loop import train
from summarizer.train.session import RUN_FILES
from summarizer.train.validation import evaluate_loss

DIAGNOSIS = """What a failure points to (the checks of a model that should memorise):
  - loss does not fall at all: layers not connected, gradients not flowing (detached tensor, frozen
    parameters, lr 0), or the optimizer not stepping;
  - loss falls but stays high: masks wrong (the decoder sees the future or padding), targets shifted
    wrongly against inputs, or regularisation left on (dropout, label smoothing);
  - loss is low but greedy output differs: decoding does not match training (BOS/EOS handling,
    cache or position offsets)."""


def start_from_scratch(run_dir: Path) -> None:
    """A check never resumes: remove what earlier checks wrote to their run dir, and nothing else. Only a
    dir made for overfit checks is cleared: a training run's dir, or anybody else's, is refused."""
    claim_dir(run_dir, "overfit", "run.dir")
    for pattern in (*RUN_FILES, "ckpt_*.pt", "*.tmp"):
        for path in run_dir.glob(pattern):
            path.unlink()


def overfit_check(cfg: Config) -> int:
    """Train from scratch on the first `data.train_limit` pairs; 0 if memorised, 1 otherwise."""
    if cfg.data.train_limit <= 0:
        cfg.data.train_limit = 64
    start_from_scratch(cfg.run_dir)
    summary = train(cfg)
    if summary["signal"] is not None:  # a half-trained model proves nothing either way: no verdict
        print(f"overfit check stopped by a signal at step {summary['steps']}: no verdict", file=sys.stderr)
        return 128 + summary["signal"]
    rt = runtime.setup(cfg.system, cfg.placement, cfg.train.precision)
    model, _ = load_model(checkpoint.latest_path(cfg.run_dir), rt, read_meta(cfg.data.dir))
    pairs = PairDataset.from_dir(cfg.data.dir, "train", cfg.data, limit=cfg.data.train_limit)
    sampler = TokenBatchSampler(pairs.src_lens, pairs.tgt_lens, cfg.data.batch_tokens, shuffle=False)
    loss = evaluate_loss(model, make_loader(pairs, sampler, cfg.data, rt.device, 0), rt)["loss"]
    # Plain greedy: the targets must come back exactly, so no length or repetition rules apply.
    greedy = dataclasses.replace(cfg.eval, beam_size=1, max_len=pairs.max_target_len, min_len=0, no_repeat_ngram=0,
                                 known_words=False, no_repeat_words=False, truncate_bytes=0)
    hyps = decode_all(model, [s for s, _ in (pairs[i] for i in range(len(pairs)))], greedy, rt)
    share = sum(h == pairs[i][1].tolist() for i, h in enumerate(hyps)) / len(pairs)
    passed = loss < cfg.overfit.max_loss and share >= cfg.overfit.min_exact_match
    print(f"overfit check on {len(pairs)} pairs after {summary['steps']} steps: train NLL {loss:.4f} "
          f"(must be < {cfg.overfit.max_loss}), greedy exact match {share:.1%} "
          f"(must be >= {cfg.overfit.min_exact_match:.0%}): {'PASSED' if passed else 'FAILED'}")
    if not passed:
        print(DIAGNOSIS)
    return 0 if passed else 1
