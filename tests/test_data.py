import numpy as np
import pytest
import torch

from summarizer.data.batches import (
    PairDataset,
    TokenBatchSampler,
    collate,
    pad_sources,
    padding_fraction,
    token_budget_batches,
)
from summarizer.data.tokenizer import BOS, EOS, PAD


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


def test_pad_sources_takes_lists_and_arrays_of_any_integer_type():
    batch = pad_sources([[5, 6], np.array([7, 8, 9], np.uint16), [], np.array([60000], np.int32)])
    assert batch.dtype == torch.long
    assert batch.tolist() == [[5, 6, PAD], [7, 8, 9], [PAD, PAD, PAD], [60000, PAD, PAD]]
    assert pad_sources([[]]).tolist() == [[PAD]]  # one position at least: attention needs a key


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


@pytest.mark.parametrize("pad_multiple", [1, 8])
def test_batches_are_cut_greedily_at_the_token_budget(pad_multiple):
    """Each batch takes pairs in order while its padded size, rows x (longest source + longest target), fits."""
    rng = np.random.default_rng(pad_multiple)
    src, tgt, order = rng.integers(1, 90, 3000), rng.integers(2, 30, 3000), rng.permutation(3000)
    batches = token_budget_batches(order, src, tgt, 700, pad_multiple)
    assert [i for b in batches for i in b] == order.tolist()
    padded = lambda lens: -(-lens // pad_multiple) * pad_multiple  # noqa: E731
    for batch, following in zip(batches, [*[b[0] for b in batches[1:]], None], strict=True):
        fits = len(batch) * (padded(src[batch]).max() + padded(tgt[batch]).max()) <= 700
        assert fits or len(batch) == 1  # a pair over the budget alone is a batch of its own
        if following is not None:  # the next pair would not have fitted
            more = [*batch, following]
            assert len(more) * (padded(src[more]).max() + padded(tgt[more]).max()) > 700


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


def test_pad_rows_gives_each_pair_of_lengths_one_shape_and_adds_no_tokens():
    """data.pad_rows: empty rows fill a batch to the budget at its padded lengths, so an epoch has one shape per pair
    of lengths (fewer than its batches' shapes as cut); an empty row is a lone EOS source and a target of PAD."""
    ds = make_dataset(n=2000)
    sampler = TokenBatchSampler(ds.src_lens, ds.tgt_lens, 400, seed=0, pad_multiple=8)
    shapes, cut = {}, set()
    for b in sampler:
        batch = collate([ds[i] for i in b], pad_multiple=8, fill_tokens=400)
        rows, s = batch["src_ids"].shape
        t = batch["tgt_in"].shape[1]
        assert shapes.setdefault((s, t), rows) == rows == 400 // (s + t) >= len(b)
        cut.add((len(b), s, t))
        assert batch["n_src"] == int(ds.src_lens[b].sum()) and batch["n_tgt"] == int(ds.tgt_lens[b].sum())
        empty = slice(len(b), None)
        assert (batch["src_ids"][empty, 0] == EOS).all() and (batch["src_ids"][empty, 1:] == PAD).all()
        assert (batch["tgt_in"][empty, 0] == BOS).all() and (batch["tgt_in"][empty, 1:] == PAD).all()
        assert (batch["tgt_out"][empty] == PAD).all()
    assert len(shapes) < len(cut)
    long_pair = [(np.arange(4, 60, dtype=np.uint16), np.arange(4, 30, dtype=np.uint16))]
    assert collate(long_pair, pad_multiple=8, fill_tokens=40)["src_ids"].shape == (1, 56)  # over budget: as it is


def test_source_weights_draw_each_pair_its_weight_an_epoch_on_average_and_replay_exactly():
    ds = make_dataset(n=400)
    weights = np.where(np.arange(400) < 100, 2.0, np.where(np.arange(400) < 200, 0.5, 1.0))  # up, down, as is
    sampler = TokenBatchSampler(ds.src_lens, ds.tgt_lens, 300, seed=4, weights=weights)
    counts = np.zeros(400)
    for epoch in range(20):
        sampler.set_epoch(epoch)
        counts += np.bincount([i for b in sampler for i in b], minlength=400)
    assert (counts[:100] == 40).all() and (counts[200:] == 20).all()  # whole parts: exactly, every epoch
    assert abs(counts[100:200].mean() - 10) < 1.0 and 0 < counts[100:200].min() < counts[100:200].max() < 20
    again = TokenBatchSampler(ds.src_lens, ds.tgt_lens, 300, seed=4, weights=weights)
    again.set_epoch(7)
    sampler.set_epoch(7)
    full = list(sampler)
    again.set_epoch(7, start=3)
    assert list(again) == full[3:]  # a pure function of (seed, epoch): resume replays it
    plain = TokenBatchSampler(ds.src_lens, ds.tgt_lens, 300, seed=4)
    assert list(plain) == list(TokenBatchSampler(ds.src_lens, ds.tgt_lens, 300, seed=4, weights=None))


def test_source_weights_must_name_prepared_tags_with_usable_values(monkeypatch):
    import pytest

    from summarizer.config.schema import DataConfig
    from summarizer.data import prepared
    from summarizer.errors import ConfigError
    pairs = [{"source": "a", "target": "b", **t} for t in ({"tag": "wire"}, {}, {"tag": "news"})]
    monkeypatch.setattr(prepared, "iter_pairs", lambda data_dir, split: iter(pairs))
    meta = {"splits": {"train": {"pairs_by_tag": {"wire": 1, "news": 1, "(untagged)": 1}}}}
    cfg = DataConfig()
    assert prepared.source_weights(cfg, meta, 3) is None
    cfg.source_weights = {"wire": 3, "news": 0.5}
    assert prepared.source_weights(cfg, meta, 3).tolist() == [3.0, 1.0, 0.5]
    assert prepared.source_weights(cfg, meta, 2).tolist() == [3.0, 1.0]  # data.train_limit
    for weights, message in (({"sport": 2}, r"names sport, not a source tag .*\(tags: news, wire\)"),
                             ({"wire": -1}, "finite numbers >= 0"), ({"wire": "x"}, "finite numbers >= 0"),
                             ({"wire": float("nan")}, "finite numbers >= 0")):
        cfg.source_weights = weights
        with pytest.raises(ConfigError, match=message):
            prepared.source_weights(cfg, meta, 3)
    cfg.source_weights = {"wire": 0, "news": 0}
    with pytest.raises(ConfigError, match="every train pair 0"):
        prepared.source_weights(cfg, meta, 1)  # the first pair alone: wire, weighted 0


def test_the_train_splits_text_is_read_a_pair_at_a_time(tmp_path):
    """The known words and the source weights read train.jsonl in one pass, never whole: the full Gigaword's
    is 3.8M pairs, gigabytes as a list of records."""
    import json
    import tracemalloc

    from summarizer.config.schema import DataConfig
    from summarizer.data import prepared
    n, words = 40_000, [f"w{i}" for i in range(50)]
    with open(tmp_path / "train.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"source": " ".join(words[(i + k) % 50] for k in range(30)),
                                "target": " ".join(words[(i + k) % 50] for k in range(8)), "tag": "wire" * (i % 2)})
                    + "\n")
    (tmp_path / "meta.json").write_text(json.dumps({"format_version": prepared.FORMAT_VERSION, "splits": {
        "train": {"pairs_by_tag": {"wire": n // 2, "(untagged)": n // 2}}}}))
    cfg = DataConfig(dir=str(tmp_path), source_weights={"wire": 2})
    tracemalloc.start()
    try:
        known = prepared.training_words.__wrapped__(tmp_path)
        weights = prepared.source_weights(cfg, json.loads((tmp_path / "meta.json").read_text()), n)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert known == set(words) and weights.tolist() == [1.0, 2.0] * (n // 2)
    assert peak < 3e6, f"{peak / 1e6:.1f} MB to read a {n}-pair split of {len(words)} words"  # as a list: 26 MB
