"""Batches from prepared data: memory-mapped pairs, a token-budget length-bucketed sampler, collate, loaders."""
from __future__ import annotations

import functools
import random
import signal
import threading
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from summarizer.config.schema import DataConfig
from summarizer.data.noise import SpanMasker
from summarizer.data.prepared import load_split, read_pairs
from summarizer.data.subwords import SegmentationSampler
from summarizer.data.tokenizer import BOS, EOS, PAD
from summarizer.outputs import release_inherited_locks



STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def init_worker(worker_id: int) -> None:
    """DataLoader worker_init_fn: let go of the run dir's lock, seed numpy/random from torch's per-worker seed,
    and ignore SIGINT and SIGTERM. Ctrl-C and schedulers signal the whole process group; a worker that died of it
    would crash the main process before it could checkpoint. The main process decides, then stops them. The
    worker started with both signals blocked (SignalSafeLoader): one that came since is dropped here, unhandled."""
    release_inherited_locks()
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


class SignalSafeLoader(DataLoader):
    """A DataLoader whose worker processes start with SIGINT and SIGTERM blocked, until init_worker ignores them:
    torch's worker dies of a SIGTERM sent to the process group before its worker_init_fn runs, which the main
    process would report as a crashed worker instead of the stop it is. The main process gets its own signal
    when the workers have started."""

    def __iter__(self):
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            return super().__iter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def stop_workers(*loaders: DataLoader) -> None:
    """End the worker processes of `loaders` now. DataLoader has no public shutdown for persistent workers, so
    this calls the iterator's own (`_shutdown_workers`: the workers leave torch's watch list and are asked to
    exit), then SIGKILLs any that did not: workers ignore SIGTERM, which is all that shutdown and
    multiprocessing's exit handler send before waiting for a worker to end, so a stuck one would be waited on
    forever at exit. torch's SIGCHLD handler is held off meanwhile: it raises for any watched worker that has died,
    and a worker of one loader dying (the cause of the error that ends a run) would surface as a new error while
    another loader's workers exit."""
    main = threading.current_thread() is threading.main_thread()  # only the main thread may set handlers
    previous = signal.getsignal(signal.SIGCHLD) if main else None
    if callable(previous):  # a Python handler (torch's): SIG_DFL ignores the signal and leaves children joinable
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        for loader in loaders:
            iterator, loader._iterator = getattr(loader, "_iterator", None), None
            if iterator is None or not hasattr(iterator, "_shutdown_workers"):
                continue
            iterator._shutdown_workers()  # first of all, takes its workers off torch's watch list
            for worker in iterator._workers:
                if worker.is_alive():
                    worker.kill()
                    worker.join(timeout=10)
    finally:
        if callable(previous):
            signal.signal(signal.SIGCHLD, previous)


class PairDataset(Dataset):
    """Source/target id sequences sliced out of flat memory-mapped arrays (no copy until collate).

    Workers forked by the DataLoader share the mapped pages instead of each holding a copy.
    """

    def __init__(self, src: np.ndarray, src_offsets: np.ndarray, tgt: np.ndarray, tgt_offsets: np.ndarray,
                 max_source_len: int, max_target_len: int, resegment: tuple | None = None,
                 noise: tuple | None = None):
        self.src, self.src_offsets, self.tgt, self.tgt_offsets = src, src_offsets, tgt, tgt_offsets
        self.max_source_len, self.max_target_len = max_source_len, max_target_len
        # (SegmentationSampler, pairs' normalised text, each source's tag piece or None): subword regularisation,
        # or None for the ids as prepared
        self.resegment = resegment
        # (SpanMasker, per pair: is it a denoising example?): unpaired sentences' sources masked, or None
        self.noise = noise
        # Lengths as the model sees them: truncated source; target plus one BOS/EOS position.
        self.src_lens = np.minimum(np.diff(src_offsets), max_source_len).astype(np.int64)
        self.tgt_lens = np.minimum(np.diff(tgt_offsets), max_target_len).astype(np.int64) + 1
        if noise is not None:  # a denoising example's source is cut where its target is (SpanMasker.pair)
            masker, flags = noise
            self.src_lens[flags] = np.minimum(self.src_lens[flags], masker.keep + self.tgt_lens[flags] - 1)

    @classmethod
    def from_dir(cls, data_dir: str | Path, split: str, cfg: DataConfig, limit: int = 0,
                 sampler: SegmentationSampler | None = None, masker: SpanMasker | None = None,
                 noised: tuple = ()) -> PairDataset:
        """A prepared split; with a `sampler`, pairs are re-segmented from their text at every epoch; with a
        `masker`, the sources of pairs tagged with one of `noised` are masked anew at every epoch."""
        src, src_offsets, tgt, tgt_offsets = load_split(data_dir, split)
        if limit > 0:  # the first `limit` pairs: offsets are cut, the flat arrays stay mapped as they are
            src_offsets, tgt_offsets = src_offsets[:limit + 1], tgt_offsets[:limit + 1]
        wanted = sampler is not None or masker is not None
        records = read_pairs(data_dir, split, len(src_offsets) - 1) if wanted else []
        texts = [(p["source"], p["target"]) for p in records] if sampler is not None else None
        # With source tags, each source's first prepared piece is its tag's, which resegmented text lacks.
        heads = src[src_offsets[:-1]].astype(np.int64) if sampler is not None and cfg.source_tag else None
        flags = np.array([p.get("tag", "") in noised for p in records], dtype=bool) if masker is not None else None
        return cls(src, src_offsets, tgt, tgt_offsets, cfg.max_source_len, cfg.max_target_len,
                   (sampler, texts, heads) if sampler is not None else None,
                   (masker, flags) if masker is not None and flags.any() else None)

    def __len__(self) -> int:
        return len(self.src_lens)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        s0, t0 = self.src_offsets[i], self.tgt_offsets[i]
        return (self.src[s0:s0 + self.src_lens[i]],
                self.tgt[t0:t0 + self.tgt_lens[i] - 1])

    def __getitems__(self, indices: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        # DataLoader's batched fetch path: one call per batch instead of one per pair.
        epoch = getattr(indices, "epoch", 0)
        if self.resegment is None:
            pairs = [self[i] for i in indices]
        else:
            sampler, texts, heads = self.resegment
            pairs = [(np.asarray(([heads[i]] if heads is not None else []) + s, dtype=np.int64)[:self.max_source_len],
                      np.asarray(t[:self.max_target_len], dtype=np.int64))
                     for i, (s, t) in ((i, sampler.pair(*texts[i], epoch, i)) for i in indices)]
        if self.noise is not None:
            masker, flags = self.noise
            pairs = [masker.pair(s, t, epoch, i, self.max_target_len) if flags[i] else (s, t)
                     for i, (s, t) in zip(indices, pairs, strict=True)]
        return pairs


def round_up(n, multiple: int):
    """Lengths padded up to a multiple (works on ints and numpy arrays)."""
    return -(-n // multiple) * multiple


def collate(pairs: list[tuple[np.ndarray, np.ndarray]], pad_multiple: int = 1, fill_tokens: int = 0) -> dict:
    """Pad to the longest pair (rounded up to `pad_multiple`): src_ids (B, S); tgt_in = BOS + y and
    tgt_out = y + EOS, both (B, T).

    With `fill_tokens` (data.batch_tokens, under data.pad_rows), empty rows follow the pairs up to the rows that
    many tokens hold at these lengths, B = fill_tokens // (S + T), so a batch's shape follows from its padded
    lengths alone: an epoch has as many batch shapes as pairs of lengths, each one new shape for every kernel
    cache (oneDNN's on a CPU, cuBLAS's plans on a GPU: milliseconds each in bf16) and compiled graph. An empty
    row's source is one EOS (cross-attention needs a key) and its target output PAD only: no loss, no gradient.
    Token counts are the pairs' alone."""
    n = len(pairs)
    s_max = round_up(max(len(s) for s, _ in pairs), pad_multiple)
    t_max = round_up(max(len(t) for _, t in pairs) + 1, pad_multiple)
    rows = max(n, fill_tokens // (s_max + t_max))
    src = np.full((rows, s_max), PAD, dtype=np.int64)
    tgt_in = np.full((rows, t_max), PAD, dtype=np.int64)
    tgt_out = np.full((rows, t_max), PAD, dtype=np.int64)
    src[n:, 0], tgt_in[n:, 0] = EOS, BOS
    n_src = n_tgt = 0
    for row, (s, t) in enumerate(pairs):
        src[row, :len(s)] = s
        tgt_in[row, 0] = BOS
        tgt_in[row, 1:len(t) + 1] = t
        tgt_out[row, :len(t)] = t
        tgt_out[row, len(t)] = EOS
        n_src += len(s)
        n_tgt += len(t) + 1
    # Token counts are plain ints computed here, so the loop never syncs a device to learn them.
    return {"src_ids": torch.from_numpy(src), "tgt_in": torch.from_numpy(tgt_in),
            "tgt_out": torch.from_numpy(tgt_out), "n_src": n_src, "n_tgt": n_tgt}


def pad_sources(sequences) -> torch.Tensor:
    """Id sequences (arrays or lists) -> (B, S) int64 tensor padded with PAD: the input decoding takes. Filled in
    numpy, one slice assignment a row: torch's tensor ops a row took 7x as long (12 ms for a GPU's batch of 2,000
    sources, docs/results.md)."""
    out = np.full((len(sequences), max(max((len(x) for x in sequences), default=1), 1)), PAD, dtype=np.int64)
    for row, ids in enumerate(sequences):
        out[row, :len(ids)] = ids
    return torch.from_numpy(out)


def token_budget_batches(order: np.ndarray, src_lens: np.ndarray, tgt_lens: np.ndarray,
                         batch_tokens: int, pad_multiple: int = 1) -> list[list[int]]:
    """Greedily cut `order` into batches whose padded size B * (max_src + max_tgt) fits the budget."""
    if pad_multiple > 1:
        src_lens, tgt_lens = round_up(src_lens, pad_multiple), round_up(tgt_lens, pad_multiple)
    batches, current, s_max, t_max = [], [], 0, 0
    # Python ints and comparisons in the loop, which the training process runs as each epoch begins: numpy
    # scalars and max() took 3.5 s for Gigaword's 3.8M pairs (docs/results.md)
    for i, s, t in zip(order.tolist(), src_lens[order].tolist(), tgt_lens[order].tolist()):
        s_new, t_new = s if s > s_max else s_max, t if t > t_max else t_max
        if current and (len(current) + 1) * (s_new + t_new) > batch_tokens:
            batches.append(current)
            current, s_new, t_new = [], s, t
        current.append(i)
        s_max, t_max = s_new, t_new
    if current:
        batches.append(current)
    return batches


class EpochBatch(list):
    """A batch of pair indices that knows its epoch (subword sampling draws per epoch and pair)."""

    def __init__(self, indices, epoch: int):
        super().__init__(indices)
        self.epoch = epoch


class TokenBatchSampler(Sampler[list[int]]):
    """Length-bucketed token-budget batches: seeded, resumable at any batch, sharded by rank.

    Each epoch: a seeded permutation is cut into pools of about `bucket_size` batches; each pool is
    sorted by length so batches hold pairs of similar length (little padding), then the order of all
    batches is shuffled so lengths do not trend through the epoch. The plan is a pure function of
    (seed, epoch), so resuming at (epoch, position) replays exactly the batches an uninterrupted run
    would see, on every rank.
    """

    def __init__(self, src_lens: np.ndarray, tgt_lens: np.ndarray, batch_tokens: int, bucket_size: int = 100,
                 shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1, even: bool = True,
                 pad_multiple: int = 1, weights: np.ndarray | None = None):
        self.src_lens, self.tgt_lens, self.pad_multiple = src_lens, tgt_lens, pad_multiple
        self.weights = weights  # per pair: drawn this many times an epoch on average (data.source_weights)
        self.batch_tokens, self.bucket_size, self.shuffle, self.seed = batch_tokens, bucket_size, shuffle, seed
        self.rank, self.world_size, self.even = rank, world_size, even
        self.epoch, self.start = 0, 0
        self._plan: tuple[int, list[list[int]]] | None = None

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Iterate epoch `epoch` from this rank's batch number `start` (0 = the beginning)."""
        self.epoch, self.start = epoch, start

    def plan(self, epoch: int) -> list[list[int]]:
        """This rank's batches for `epoch` (cached: the plan is deterministic)."""
        if self._plan is not None and self._plan[0] == epoch:
            return self._plan[1]
        # Sort by target length, then source length. Targets take few distinct lengths, so each run
        # of equal targets still sorts its sources tightly; and a padded target position costs far
        # more than a source one (decoder layers plus the vocabulary projection and loss); docs/results.md,
        # "pools sorted by target then source length".
        by_length = lambda idx: idx[np.lexsort((self.src_lens[idx], self.tgt_lens[idx]))]  # noqa: E731
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch])
            if self.weights is None:
                perm = rng.permutation(len(self.src_lens))
            else:
                pairs = self.weighted_pairs(epoch)
                perm = pairs[rng.permutation(pairs.size)]
            mean_len = max(float((self.src_lens + self.tgt_lens).mean()), 1.0)
            pool = max(1, int(self.bucket_size * self.batch_tokens / mean_len))
            order = np.concatenate([by_length(chunk) for chunk in np.array_split(perm, max(1, len(perm) // pool))])
        else:
            order = by_length(np.arange(len(self.src_lens)))
        batches = token_budget_batches(order, self.src_lens, self.tgt_lens, self.batch_tokens, self.pad_multiple)
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        # Training ranks must run the same number of steps, or DDP's all-reduce would wait forever;
        # evaluation (even=False) keeps every batch, since it only sums at the end.
        usable = len(batches) - len(batches) % self.world_size if self.even else len(batches)
        mine = batches[self.rank:usable:self.world_size]
        self._plan = (epoch, mine)
        return mine

    def weighted_pairs(self, epoch: int) -> np.ndarray:
        """The pairs of `epoch` under `weights`: pair i whole floor(w_i) times, and once more with probability
        w_i - floor(w_i) (seeded by seed and epoch), so a source weighted 2 is seen twice an epoch, 0.5 half."""
        whole = np.floor(self.weights)
        extra = np.random.default_rng([self.seed, epoch, 1]).random(len(self.weights)) < self.weights - whole
        return np.repeat(np.arange(len(self.weights)), whole.astype(np.int64) + extra)

    def __iter__(self):
        for batch in self.plan(self.epoch)[self.start:]:
            yield EpochBatch(batch, self.epoch)

    def __len__(self) -> int:
        return len(self.plan(self.epoch)) - self.start


def batch_collate(cfg: DataConfig):
    """`collate` as data.pad_multiple and data.pad_rows ask: what every training and validation batch goes
    through."""
    fill = cfg.batch_tokens if cfg.pad_rows else 0
    return functools.partial(collate, pad_multiple=cfg.pad_multiple, fill_tokens=fill)


def make_loader(dataset: PairDataset, sampler: TokenBatchSampler, cfg: DataConfig,
                device: torch.device, seed: int) -> DataLoader:
    workers = cfg.num_workers
    extra = {"persistent_workers": cfg.persistent_workers, "prefetch_factor": cfg.prefetch_factor} if workers else {}
    return SignalSafeLoader(
        dataset, batch_sampler=sampler, collate_fn=batch_collate(cfg),
        num_workers=workers,
        # Page-locked host buffers make host->GPU copies faster and allow them to be asynchronous.
        pin_memory=cfg.pin_memory and device.type == "cuda",
        worker_init_fn=init_worker,
        # A private generator: creating an iterator must not draw from the global RNG, or a resumed
        # run (which creates one more iterator) would see different dropout masks.
        generator=torch.Generator().manual_seed(seed), **extra)


def padding_fraction(batches: list[list[int]], src_lens: np.ndarray, tgt_lens: np.ndarray) -> float:
    """Share of padded positions in the given batches (a measure of how well bucketing works)."""
    real = padded = 0
    for b in batches:
        real += int(src_lens[b].sum() + tgt_lens[b].sum())
        padded += len(b) * int(src_lens[b].max() + tgt_lens[b].max())
    return 1.0 - real / max(padded, 1)
