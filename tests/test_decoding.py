import pytest
import torch

from summarizer.config import ModelConfig
from summarizer.decoding import _block_repeats, beam_search, greedy
from summarizer.model import Seq2Seq


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_heads=4, encoder_layers=1, decoder_layers=2, ffn_dim=64, dropout=0.0)
    m = Seq2Seq(cfg, 40).eval()
    with torch.no_grad():  # a sharper random model: varied, non-trivial outputs
        m.embedding.weight.mul_(4.0)
    return m


@pytest.fixture(scope="module")
def sources():
    torch.manual_seed(1)
    src = torch.randint(4, 40, (5, 9))
    src[1, 6:] = 0
    src[3, 4:] = 0
    return src


def test_beam_size_one_equals_greedy(model, sources):
    for n in (0, 2):
        assert beam_search(model, sources, beam_size=1, max_len=12, no_repeat_ngram=n) == \
            greedy(model, sources, max_len=12, no_repeat_ngram=n)


def test_cached_decoding_equals_recomputation(model, sources):
    assert greedy(model, sources, max_len=12) == greedy(model, sources, max_len=12, use_cache=False)
    assert beam_search(model, sources, 3, max_len=12) == beam_search(model, sources, 3, max_len=12, use_cache=False)


def test_output_does_not_depend_on_the_rest_of_the_batch(model, sources):
    together = beam_search(model, sources, 4, max_len=12)
    for i in range(len(sources)):
        row = sources[i:i + 1]
        row = row[:, :int((row != 0).sum())]  # unpadded, alone
        assert beam_search(model, row, 4, max_len=12) == [together[i]]
        assert greedy(model, row, max_len=12) == [greedy(model, sources, max_len=12)[i]]


def test_beam_scores_at_least_as_well_as_greedy(model, sources):
    def score(hyp, i):
        tgt = torch.tensor([[2] + hyp])
        out = torch.tensor(hyp + [3])
        lp = model.decode(tgt, model.encode(sources[i:i + 1]), sources[i:i + 1])[0]
        return lp.gather(-1, out[:, None]).sum().item()
    g, b = greedy(model, sources, max_len=12), beam_search(model, sources, 6, max_len=12, length_penalty=0.0)
    for i in range(len(sources)):
        assert score(b[i], i) >= score(g[i], i) - 1e-4


def test_lengths_are_bounded(model, sources):
    for hyp in beam_search(model, sources, 3, max_len=5, min_len=3):
        assert 3 <= len(hyp) <= 5
    for hyp in greedy(model, sources, max_len=5, min_len=3):
        assert 3 <= len(hyp) <= 5


def test_ngram_blocking_blocks():
    prefixes = torch.tensor([[5, 6, 7, 5, 6], [1, 2, 3, 4, 5]])
    scores = torch.zeros(2, 10)
    blocked = _block_repeats(scores, prefixes, 3)
    assert blocked[0, 7] == float("-inf") and torch.isfinite(blocked[0]).sum() == 9  # "5 6 7" again
    assert torch.isfinite(blocked[1]).all()
    for hyp in beam_search(*_repetitive_model(), 4, max_len=15, no_repeat_ngram=2):
        bigrams = list(zip(hyp, hyp[1:], strict=False))
        assert len(bigrams) == len(set(bigrams))


def _repetitive_model():
    torch.manual_seed(3)
    m = Seq2Seq(ModelConfig(d_model=16, n_heads=2, encoder_layers=1, decoder_layers=1, ffn_dim=32, dropout=0.0,
                            copy=False), 12).eval()
    return m, torch.randint(4, 12, (3, 5))


def test_every_decode_goes_through_decode_all():
    """Evaluation, summarize, valid ROUGE, sample summaries, the overfit check and the bench all call
    decode_all; nothing outside decoding.py runs a search loop of its own."""
    import re
    from pathlib import Path
    search_call = re.compile(r"(?<![\w.])(?<!def )(greedy|beam_search|decode_batch)\(")
    for path in Path("summarizer").glob("*.py"):
        if path.name != "decoding.py":
            assert not search_call.search(path.read_text()), path
    for name in ("evaluate.py", "train.py", "overfit.py", "bench.py"):
        assert (Path("summarizer") / name).read_text().count("decode_all(") >= 1, name
