"""Denoising examples: span masking on whole words, seeded by (seed, epoch, pair), cut with their target."""
import numpy as np

from summarizer.data.batches import EpochBatch, PairDataset
from summarizer.data.noise import SpanMasker

MASK, TAG = 2, 3
# Piece ids 10.. start a word when even: word k of a sentence is the pieces (10 + 2k, 11 + 2k) or (10 + 2k,).
STARTS = np.array([i >= 10 and i % 2 == 0 for i in range(200)])


def sentence(words: int, split_every: int = 2) -> np.ndarray:
    """`words` words, every `split_every`-th of two pieces (start, continuation), the others of one."""
    ids = []
    for k in range(words):
        ids += [10 + 2 * k, 11 + 2 * k] if k % split_every == 0 else [10 + 2 * k]
    return np.array(ids, dtype=np.uint16)


def words_of(ids) -> list:
    """The sentence as a list of words (tuples of pieces), MASK as its own word."""
    out = []
    for i in map(int, ids):
        if i == MASK or STARTS[i] or not out or out[-1] == (MASK,):
            out.append((i,))
        else:
            out[-1] += (i,)
    return out


def test_spans_mask_whole_words_up_to_the_ratio_each_span_one_mask_piece():
    masker = SpanMasker(STARTS, MASK, ratio=0.3, span=3.0, seed=5)
    original = words_of(sentence(40))
    for index in range(50):
        masked = words_of(masker(sentence(40), epoch=0, index=index))
        kept = [w for w in masked if w != (MASK,)]
        # Every kept word is a whole word of the sentence, in order; 30% of the 40 words (12) are gone.
        positions = [original.index(w) for w in kept]
        assert positions == sorted(positions) and len(kept) == 40 - 12
        # One mask per run of consecutive missing words, and never two masks side by side.
        gaps = sum(1 for a, b in zip([-1, *positions], [*positions, 40], strict=True) if b - a > 1)
        assert masked.count((MASK,)) == gaps
        assert all(not (a == b == (MASK,)) for a, b in zip(masked, masked[1:], strict=False))


def test_span_lengths_follow_the_poisson_mean():
    masker = SpanMasker(STARTS, MASK, ratio=0.5, span=4.0, seed=1)
    rng = np.random.default_rng(0)
    runs = []
    for _ in range(300):
        masked = masker.spans(80, rng)
        edges = np.flatnonzero(np.diff(np.r_[0, masked.astype(int), 0]))
        runs += (edges[1::2] - edges[::2]).tolist()
    # Touching spans merge into one run, so runs are a little longer than the spans drawn (mean 4).
    assert 4.0 <= np.mean(runs) <= 6.0 and min(runs) >= 1


def test_the_draw_is_a_function_of_seed_epoch_and_pair_and_keeps_the_tag_piece():
    masker = SpanMasker(STARTS, MASK, ratio=0.3, span=3.0, seed=5, keep=1)
    ids = np.r_[TAG, sentence(30)].astype(np.uint16)
    first = masker(ids, 2, 17)
    assert first[0] == TAG and np.array_equal(first, masker(ids, 2, 17))  # any worker, any resume
    assert not np.array_equal(first, masker(ids, 3, 17))  # anew each epoch
    assert not np.array_equal(first, masker(ids, 2, 18))
    other = SpanMasker(STARTS, MASK, ratio=0.3, span=3.0, seed=6, keep=1)
    assert not np.array_equal(first, other(ids, 2, 17))
    assert masker(np.array([TAG], np.uint16), 0, 0).tolist() == [TAG]  # nothing to mask


def test_a_sentence_longer_than_the_target_limit_is_cut_on_both_sides_before_its_last_word():
    masker = SpanMasker(STARTS, MASK, ratio=0.3, span=3.0, seed=5, keep=1)
    full = sentence(30)
    limit = 13  # the target as the dataset cuts it: 13 pieces, ending inside word 8 (pieces 26, 27)
    src, tgt = masker.pair(np.r_[TAG, full], full[:limit], 0, 0, limit)
    assert tgt.tolist() == full[:12].tolist()  # words 0-7 whole; the split word 8 is left out
    kept = [w for w in words_of(src[1:]) if w != (MASK,)]
    assert set(kept) <= set(words_of(tgt)) and src[0] == TAG
    short = sentence(4)
    src, tgt = masker.pair(np.r_[TAG, short], short, 0, 0, limit)
    assert tgt.tolist() == short.tolist()  # under the limit: the target as it is


def test_a_dataset_masks_only_the_sources_of_denoising_pairs_and_budgets_their_cut_length():
    pairs = [(np.r_[TAG, sentence(6)], np.array([40, 42])),  # a headline pair
             (np.r_[TAG, sentence(30)], sentence(30)),  # a long unpaired sentence
             (np.r_[TAG, sentence(8)], sentence(8))]  # a short one
    flat = lambda seqs: np.concatenate(seqs).astype(np.uint16)  # noqa: E731
    offsets = lambda seqs: np.r_[0, np.cumsum([len(s) for s in seqs])].astype(np.int64)  # noqa: E731
    src, tgt = [p[0] for p in pairs], [p[1] for p in pairs]
    masker = SpanMasker(STARTS, MASK, ratio=0.3, span=3.0, seed=5, keep=1)
    ds = PairDataset(flat(src), offsets(src), flat(tgt), offsets(tgt), 96, 20,
                     noise=(masker, np.array([False, True, True])))
    assert ds.src_lens.tolist() == [10, 21, 13]  # the long sentence budgeted as cut to its 20 target pieces
    got = ds.__getitems__(EpochBatch([0, 1, 2], epoch=4))
    assert got[0][0].tolist() == src[0].tolist() and got[0][1].tolist() == [40, 42]
    for i in (1, 2):
        assert MASK in got[i][0].tolist() and got[i][0][0] == TAG
        assert np.array_equal(got[i][0], masker.pair(src[i], tgt[i][:20], 4, i, 20)[0])
    assert len(got[1][1]) < 20 and got[2][1].tolist() == tgt[2].tolist()
