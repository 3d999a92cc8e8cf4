import numpy as np
import torch

from summarizer.data import PairDataset, TokenBatchSampler, collate, padding_fraction, token_budget_batches
from summarizer.tokenizer import BOS, EOS, PAD


def make_dataset(n=200, seed=0, max_source_len=40, max_target_len=12):
    rng = np.random.default_rng(seed)
    src_lens, tgt_lens = rng.integers(3, 40, n), rng.integers(2, 12, n)
    src = rng.integers(4, 100, src_lens.sum()).astype(np.uint16)
    tgt = rng.integers(4, 100, tgt_lens.sum()).astype(np.uint16)
    offsets = lambda lens: np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)  # noqa: E731
    return PairDataset(src, offsets(src_lens), tgt, offsets(tgt_lens), max_source_len, max_target_len)


def test_collate_shifts_targets_and_pads():
    pairs = [(np.array([5, 6, 7], np.uint16), np.array([8, 9], np.uint16)),
             (np.array([5], np.uint16), np.array([4], np.uint16))]
    batch = collate(pairs)
    assert batch["src_ids"].tolist() == [[5, 6, 7], [5, PAD, PAD]]
    assert batch["tgt_in"].tolist() == [[BOS, 8, 9], [BOS, 4, PAD]]
    assert batch["tgt_out"].tolist() == [[8, 9, EOS], [4, EOS, PAD]]
    assert batch["n_src"] == 4 and batch["n_tgt"] == 5 and batch["src_ids"].dtype == torch.long


def test_truncation_to_max_lengths():
    ds = make_dataset(max_source_len=5, max_target_len=3)
    assert ds.src_lens.max() <= 5 and ds.tgt_lens.max() <= 4
    src, tgt = ds[0]
    assert len(src) <= 5 and len(tgt) <= 3


def test_batches_respect_budget_and_cover_every_pair_once():
    ds = make_dataset()
    sampler = TokenBatchSampler(ds.src_lens, ds.tgt_lens, batch_tokens=300, seed=1)
    batches = list(sampler)
    for b in batches:
        assert len(b) * (ds.src_lens[b].max() + ds.tgt_lens[b].max()) <= 300
    assert sorted(i for b in batches for i in b) == list(range(len(ds)))


def test_plan_is_seeded_and_changes_per_epoch():
    ds = make_dataset()
    a = TokenBatchSampler(ds.src_lens, ds.tgt_lens, 300, seed=1)
    b = TokenBatchSampler(ds.src_lens, ds.tgt_lens, 300, seed=1)
    assert list(a) == list(b)
    b.set_epoch(1)
    assert list(a) != list(b)


def test_resume_mid_epoch_replays_the_rest():
    ds = make_dataset()
    sampler = TokenBatchSampler(ds.src_lens, ds.tgt_lens, 300, seed=3)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.set_epoch(2, start=5)
    assert list(sampler) == full[5:] and len(sampler) == len(full) - 5


def test_shards_are_disjoint_and_equal_sized():
    ds = make_dataset(n=301)
    shards = [list(TokenBatchSampler(ds.src_lens, ds.tgt_lens, 300, seed=0, rank=r, world_size=3)) for r in range(3)]
    assert len({len(s) for s in shards}) == 1
    seen = [i for s in shards for b in s for i in b]
    assert len(seen) == len(set(seen))
    uneven = [list(TokenBatchSampler(ds.src_lens, ds.tgt_lens, 300, shuffle=False, rank=r, world_size=3,
                                     even=False)) for r in range(3)]
    assert sorted(i for s in uneven for b in s for i in b) == list(range(301))


def test_bucketing_reduces_padding():
    ds = make_dataset(n=2000)
    bucketed = list(TokenBatchSampler(ds.src_lens, ds.tgt_lens, 600, seed=0))
    random_order = token_budget_batches(np.random.default_rng(0).permutation(len(ds)), ds.src_lens, ds.tgt_lens, 600)
    padding = padding_fraction(bucketed, ds.src_lens, ds.tgt_lens)
    assert padding < 0.5 * padding_fraction(random_order, ds.src_lens, ds.tgt_lens)


def test_getitems_matches_getitem():
    ds = make_dataset()
    for (a, b), i in zip(ds.__getitems__([3, 7]), [3, 7], strict=True):
        assert np.array_equal(a, ds[i][0]) and np.array_equal(b, ds[i][1])


def test_pad_multiple_rounds_shapes_and_keeps_the_budget():
    ds = make_dataset()
    sampler = TokenBatchSampler(ds.src_lens, ds.tgt_lens, 400, seed=0, pad_multiple=8)
    for b in sampler:
        batch = collate([ds[i] for i in b], pad_multiple=8)
        s, t = batch["src_ids"].shape[1], batch["tgt_in"].shape[1]
        assert s % 8 == 0 and t % 8 == 0 and len(b) * (s + t) <= 400
        assert batch["n_tgt"] == int(ds.tgt_lens[b].sum())  # real tokens only
