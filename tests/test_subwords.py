import numpy as np

from summarizer.config.load import load_config
from summarizer.data.batches import EpochBatch, PairDataset
from summarizer.data.prepared import open_tokenizer, read_pairs
from summarizer.data.subwords import SegmentationSampler

SOURCE = "the government of france said monday it would cut fuel taxes as part of a plan"
TARGET = "france to cut fuel taxes"


def test_sampling_is_seeded_by_seed_epoch_and_pair(tiny_prepared):
    sampler = SegmentationSampler(open_tokenizer(tiny_prepared), alpha=0.1, nbest=8, seed=7)
    first = sampler.pair(SOURCE, TARGET, epoch=3, index=11)
    assert SegmentationSampler(open_tokenizer(tiny_prepared), 0.1, 8, seed=7).pair(SOURCE, TARGET, 3, 11) == first
    draws = {tuple(map(tuple, sampler.pair(SOURCE, TARGET, epoch, 11))) for epoch in range(20)}
    assert len(draws) > 1  # segmentations do vary across epochs


def test_samples_spell_the_text_and_share_each_words_segmentation(tiny_prepared):
    tokenizer = open_tokenizer(tiny_prepared)
    sampler = SegmentationSampler(tokenizer, alpha=0.1, nbest=8, seed=0)
    for epoch in range(10):
        src, tgt = sampler.pair(SOURCE, TARGET, epoch, 0)
        assert tokenizer.decode(src) == SOURCE and tokenizer.decode(tgt) == TARGET
        pieces = lambda ids: tokenizer.sp.decode_ids(ids)  # noqa: E731
        words_src, words_tgt = _words(tokenizer, src), _words(tokenizer, tgt)
        for word, ids in words_tgt.items():  # the copy head finds every target word's pieces in the source
            assert word not in words_src or words_src[word] == ids, (word, pieces(ids))


def _words(tokenizer, ids) -> dict:
    out, current = {}, []
    for i in [*ids, None]:
        if (i is None or tokenizer.sp.id_to_piece(i).startswith("\u2581")) and current:
            out[tokenizer.decode(current)] = tuple(current)
            current = []
        if i is not None:
            current.append(i)
    return out


def test_dataset_resegments_each_epoch_and_a_large_alpha_gives_the_prepared_ids(tiny_prepared):
    cfg = load_config(None, ["data.max_source_len=96"]).data
    plain = PairDataset.from_dir(tiny_prepared, "train", cfg)
    sharp = SegmentationSampler(open_tokenizer(tiny_prepared), alpha=1000.0, nbest=4, seed=0)
    resegmented = PairDataset.from_dir(tiny_prepared, "train", cfg, sampler=sharp)
    batch = EpochBatch([0, 5, 9], epoch=2)
    for (s, t), (ps, pt) in zip(resegmented.__getitems__(batch), plain.__getitems__(batch), strict=True):
        assert np.array_equal(s, ps) and np.array_equal(t, pt)  # alpha -> inf: always the best segmentation
    assert len(read_pairs(tiny_prepared, "train")) == len(resegmented)


def test_resegmented_sources_keep_their_source_tag_piece_first(tmp_path):
    """With data.source_tag, a prepared source starts with its tag's piece; a resegmented one must too."""
    from data_prep import prepare
    from tests.conftest import ASSETS, data_config
    cfg = data_config(tmp_path, "data.vocab_size=150", "data.source_tag=tiny")
    cfg.source = {split: [{"path": str(ASSETS / f"tiny/{split}.jsonl"), "tag": "tiny"}]
                  for split in ("train", "valid", "test")}
    prepare(cfg)
    cfg.max_source_len = 96
    tag = open_tokenizer(tmp_path).tag_id("tiny")
    plain = PairDataset.from_dir(tmp_path, "train", cfg)
    sharp = SegmentationSampler(open_tokenizer(tmp_path), alpha=1000.0, nbest=4, seed=0)
    resegmented = PairDataset.from_dir(tmp_path, "train", cfg, sampler=sharp)
    batch = EpochBatch([0, 5, 9], epoch=2)
    for (s, t), (ps, pt) in zip(resegmented.__getitems__(batch), plain.__getitems__(batch), strict=True):
        assert s[0] == tag and np.array_equal(s, ps) and np.array_equal(t, pt)
