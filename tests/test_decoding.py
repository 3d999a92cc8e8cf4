import copy
import dataclasses
import threading

import pytest
import torch
from torch.profiler import profile

from summarizer.bench import decoding_v1
from summarizer.config.schema import EvalConfig, ModelConfig, PlacementConfig, SystemConfig
from summarizer.data.prepared import open_tokenizer, read_pairs, training_words
from summarizer.data.tokenizer import EOS, PAD, UNK
from summarizer.decode.lexicon import Lexicon
from summarizer.decode.quantize import decoding_form
from summarizer.decode.rules import _block_repeats
from summarizer.decode.search import beam_search, greedy
from summarizer.model.transformer import Seq2Seq
from summarizer.runtime import Runtime
from tests.decoding_models import PLAIN, padded, ragged_sources, settings, sharp_model, word_rules_model


@pytest.fixture(scope="module")
def model():
    return sharp_model()


@pytest.fixture(scope="module")
def sources():
    return ragged_sources(5)


def test_beam_size_one_equals_greedy(model, sources):
    for n in (0, 2):
        assert beam_search(model, sources, settings(beam_size=1, no_repeat_ngram=n)) == \
            greedy(model, sources, settings(no_repeat_ngram=n))


def test_cached_decoding_equals_recomputation(model, sources):
    assert greedy(model, sources, PLAIN) == greedy(model, sources, PLAIN, use_cache=False)
    s = settings(beam_size=3)
    assert beam_search(model, sources, s) == beam_search(model, sources, s, use_cache=False)


@pytest.mark.parametrize("beam, n, min_len", [(1, 0, 1), (1, 2, 3), (4, 0, 1), (4, 3, 2), (6, 2, 1)])
def test_same_outputs_as_the_release_1_decoder(model, sources, beam, n, min_len):
    """Sharing memory across beams, dropping finished sentences and batched bookkeeping change no output."""
    s = settings(beam_size=beam, no_repeat_ngram=n, min_len=min_len)
    new = beam_search(model, sources, s) if beam > 1 else greedy(model, sources, s)
    old = decoding_v1.beam_search(model, sources, beam, max_len=12, min_len=min_len, no_repeat_ngram=n) if beam > 1 \
        else decoding_v1.greedy(model, sources, max_len=12, min_len=min_len, no_repeat_ngram=n)
    assert new == old


def test_output_does_not_depend_on_the_rest_of_the_batch(model, sources):
    s = settings(beam_size=4)
    together = beam_search(model, sources, s)
    for i in range(len(sources)):
        row = sources[i:i + 1]
        row = row[:, :int((row != 0).sum())]  # unpadded, alone
        assert beam_search(model, row, s) == [together[i]]
        assert greedy(model, row, PLAIN) == [greedy(model, sources, PLAIN)[i]]


def test_beam_scores_at_least_as_well_as_greedy(model, sources):
    def score(hyp, i):
        tgt = torch.tensor([[2] + hyp])
        out = torch.tensor(hyp + [3])
        lp = model.decode(tgt, model.encode(sources[i:i + 1]), sources[i:i + 1])[0]
        return lp.gather(-1, out[:, None]).sum().item()
    g, b = greedy(model, sources, PLAIN), beam_search(model, sources, settings(beam_size=6, length_penalty=0.0))
    for i in range(len(sources)):
        assert score(b[i], i) >= score(g[i], i) - 1e-4


def test_lengths_are_bounded(model, sources):
    for search, beam in ((beam_search, 3), (greedy, 1)):
        for hyp in search(model, sources, settings(beam_size=beam, max_len=5, min_len=3)):
            assert 3 <= len(hyp) <= 5


def test_ngram_blocking_blocks():
    prefixes = torch.tensor([[5, 6, 7, 5, 6], [1, 2, 3, 4, 5]])
    scores = torch.zeros(2, 10)
    blocked = _block_repeats(scores, prefixes, 3)
    assert blocked[0, 7] == float("-inf") and torch.isfinite(blocked[0]).sum() == 9  # "5 6 7" again
    assert torch.isfinite(blocked[1]).all()
    m = Seq2Seq(ModelConfig(d_model=16, n_heads=2, encoder_layers=1, decoder_layers=1, ffn_dim=32, dropout=0.0,
                            copy=False), 12).eval()
    torch.manual_seed(3)
    for hyp in beam_search(m, torch.randint(4, 12, (3, 5)), settings(beam_size=4, max_len=15, no_repeat_ngram=2)):
        bigrams = list(zip(hyp, hyp[1:], strict=False))
        assert len(bigrams) == len(set(bigrams))


# --- word rules: a real tokenizer's pieces, a random model that would happily invent words ----------------

@pytest.fixture(scope="module")
def lexicon_and_model(tiny_prepared):
    tokenizer, known, lex, m = word_rules_model(tiny_prepared)
    texts = ["the government of france said monday it would cut fuel taxes .",
             "zorblatt corp shares fell sharply on friday after a profit warning ."]
    return tokenizer, known, lex, m, padded(tokenizer, texts), texts


@pytest.mark.parametrize("beam", [1, 4])
def test_word_rules_emit_only_known_or_source_words_and_never_twice(lexicon_and_model, beam):
    tokenizer, known, lex, m, src, texts = lexicon_and_model
    s = settings(beam_size=beam, max_len=20, known_words=True, no_repeat_words=True)
    free = [tokenizer.decode(h).split() for h in (beam_search if beam > 1 else greedy)(m, src, settings(
        beam_size=beam, max_len=20))]
    ruled = [tokenizer.decode(h).split() for h in (beam_search if beam > 1 else greedy)(m, src, s, lex)]
    assert any(w not in known and w not in texts[i].split() for i, words in enumerate(free) for w in words)
    for i, words in enumerate(ruled):
        assert words and all(w in known or w in texts[i].split() for w in words), words
        keys = [lex.repeat_key(tokenizer.encode(w)) for w in words]
        assert len(keys) == len(set(keys)), words


def test_numbers_and_the_unknown_marker_come_only_from_the_source(tiny_prepared):
    """A masked number ("##") or "<unk>" is a training word, but a summary may write one only when its own
    source has it: made up, it is a hole in the headline ("$ ## millions", "rises <unk> %")."""
    from summarizer.decode.constraints import WordRules
    from summarizer.decode.lexicon import lexicon
    tokenizer, lex = open_tokenizer(tiny_prepared), lexicon(tiny_prepared)
    assert {"##", "<unk>"} <= training_words(tiny_prepared)
    number, (space, unk) = tokenizer.encode("##"), tokenizer.encode("<unk>")
    assert tokenizer.sp.id_to_piece(number[0]) == "\u2581#"  # begins "##", "#.##", "#-#": numbers only
    sources = [tokenizer.encode("albion won ## points <unk>"), tokenizer.encode("albion won the league")]
    rules = WordRules(lex, sources, group=1, known_only=True, no_repeat=True)
    start = rules.mask(torch.zeros(2, lex.vocab_size)) > float("-inf")
    assert start[0, number[0]] and not start[1, number[0]]
    rules.advance([0, 1], [space, space])  # both rows begin a word with the bare word-start piece
    after_space = rules.mask(torch.zeros(2, lex.vocab_size)) > float("-inf")
    assert after_space[0, unk] and not after_space[1, unk]
    assert after_space[1].sum() > 1  # other words still begin this way


def test_a_source_word_with_a_character_outside_the_vocabulary_is_copied_whole_or_not_at_all(tiny_prepared):
    """"bj<UNK>rk" may be written with its UNK (the readable form puts the character back), never as "bjrk"."""
    from summarizer.data.tokenizer import UNK
    from summarizer.decode.constraints import WordRules
    from summarizer.decode.lexicon import lexicon
    tokenizer, lex = open_tokenizer(tiny_prepared), lexicon(tiny_prepared)
    source = tokenizer.encode("bj\u00f6rk won")
    assert UNK in source
    cut = source.index(UNK)
    rules = WordRules(lex, [source], group=1, known_only=True, no_repeat=True)
    for piece in source[:cut]:  # spell the word up to its unknown character
        rules.advance([0], [piece])
    allowed = rules.mask(torch.zeros(1, lex.vocab_size)) > float("-inf")
    assert allowed[0, UNK] and not allowed[0, source[cut + 1]]  # the UNK, not the letter after it
    for piece in source[cut:]:
        rules.advance([0], [piece])
    assert tokenizer.decode(source, {cut: "\u00f6"}) == "bj\u00f6rk won"
    assert UNK not in lex.known_starts.nonzero().flatten().tolist()


@pytest.mark.parametrize("known_only", [True, False])
def test_punctuation_does_not_make_a_used_word_new(tiny_prepared, known_only):
    """Text normalised without word tokenization keeps "feb." whole: after "feb" (or "feb." or "feb,")
    none of them may follow ("gold closes higher feb feb."). With known words only the tree refuses the
    word's first piece already (every word under it is used up), so no row spells itself into a dead end;
    with repeats only, a row may spell "feb" again but neither end it nor add punctuation to it."""
    from summarizer.decode.constraints import WordRules
    tokenizer = open_tokenizer(tiny_prepared)
    lex = Lexicon(tokenizer, {"feb", "feb.", "feb,", "gold"})
    dot, comma = tokenizer.encode("feb.")[-1], tokenizer.encode("feb,")[-1]
    assert lex.punct_inside[dot] and lex.punct_inside[comma]
    assert lex.repeat_key(tokenizer.encode("feb.")) == lex.repeat_key(tokenizer.encode("feb")) == "feb"
    assert lex.repeat_key(tokenizer.encode("--")) == "-"  # punctuation alone is a word's text
    assert lex.repeat_key(tokenizer.encode("#,###")) == "#,###"  # inside a word it stays
    feb = tokenizer.encode("feb")
    for first in ("feb", "feb.", "feb,"):
        rules = WordRules(lex, [tokenizer.encode("gold")], group=1, known_only=known_only, no_repeat=True)
        for piece in tokenizer.encode(first):
            assert (rules.mask(torch.zeros(1, lex.vocab_size)) > float("-inf"))[0, piece], (first, piece)
            rules.advance([0], [piece])
        # ending it here uses up every "feb" word: the next word may not begin like one
        assert not (rules.mask(torch.zeros(1, lex.vocab_size)) > float("-inf"))[0, feb[0]] or not known_only
        for piece in tokenizer.encode("gold"):
            assert (rules.mask(torch.zeros(1, lex.vocab_size)) > float("-inf"))[0, piece], (first, piece)
            rules.advance([0], [piece])
        allowed = (rules.mask(torch.zeros(1, lex.vocab_size)) > float("-inf"))[0]
        if known_only:
            assert not allowed[feb[0]] and allowed.nonzero().flatten().tolist() == [EOS], first
            continue
        for piece in feb:
            rules.advance([0], [piece])
        allowed = (rules.mask(torch.zeros(1, lex.vocab_size)) > float("-inf"))[0]
        assert not allowed[dot] and not allowed[comma] and not (allowed & lex.starts).any() and not allowed[EOS]


def test_a_rows_word_hash_is_the_hash_of_its_repeat_key(tiny_prepared):
    """The hash a row extends piece by piece equals the hash of Lexicon.repeat_key of the word's pieces, for
    every training word and words of punctuation alone."""
    from summarizer.decode.constraints import WordRules
    from summarizer.decode.lexicon import lexicon, text_hash
    tokenizer, lex = open_tokenizer(tiny_prepared), lexicon(tiny_prepared)
    words = sorted(training_words(tiny_prepared)) + ["--", "-lrb-", "u.s.", "feb.", "(afp)", "...", "'s", "#,###"]
    encoded = [ids for ids in tokenizer.encode_batch(words) if ids and lex.starts_word[ids[0]]]
    rules = WordRules(lex, [[5]] * len(encoded), group=1, known_only=False, no_repeat=True)
    for k in range(max(map(len, encoded))):
        rules.advance(list(range(len(encoded))), [ids[k] if k < len(ids) else PAD for ids in encoded])
    for row, ids in enumerate(encoded):
        assert (int(rules.h1[row]), int(rules.h2[row])) == text_hash(lex.repeat_key(ids)), tokenizer.decode(ids)


def _source_words(lex, ids: list[int]) -> list[tuple[list[int], str]]:
    """A source's words by their definition, one piece at a time: (pieces, repeat key) each, in order. A word
    starts at a word-start piece or at the source's first piece; a piece that writes nothing is left out unless it
    starts a word; a word holding a piece that writes nothing after its first is left out."""
    words, word = [], []
    for i in [*ids, None]:
        if (i is None or lex.starts_word[i]) and word:
            if all(lex.text[p] for p in word[1:]):
                words.append((word, lex.repeat_key(word)))
            word = []
        if i is not None and (lex.text[i] or lex.starts_word[i]):
            word.append(i)
    return words


@pytest.mark.parametrize("collide", [False, True])
def test_a_batchs_source_words_are_their_definitions_with_their_keys_kept_and_the_store_bounded(tiny_prepared,
                                                                                                monkeypatch, collide):
    """Lexicon.source_word_arrays, the whole batch in array operations, holds each source's words as
    `_source_words` defines them, with their repeat keys' hashes: first seen or kept, with a source of no
    words and one of only pieces that write nothing; the kept hashes are emptied when they reach WORD_KEYS. With
    every word given one key (`collide`), the distinct words are still told apart."""
    import numpy as np

    from summarizer.decode import lexicon as lexicon_module
    from summarizer.decode.lexicon import combined, text_hash
    if collide:
        monkeypatch.setattr(lexicon_module, "combined",
                            lambda h1, h2: np.zeros_like(h1) if isinstance(h1, np.ndarray) else combined(h1, h2))
    tokenizer = open_tokenizer(tiny_prepared)
    lex = Lexicon(tokenizer, training_words(tiny_prepared))
    sources = tokenizer.encode_batch([p["source"] for p in read_pairs(tiny_prepared, "test")][:30])
    sources[3:3] = [[], [PAD, EOS], [UNK, UNK]]
    monkeypatch.setattr(lexicon_module, "WORD_KEYS", 16)
    for _ in range(2):  # first seen, then (as far as the bound allows) kept
        pieces, lengths, hashes = lex.source_word_arrays(sources)
        assert len(lex._word_hashes) <= 16
        for b, ids in enumerate(sources):
            words = _source_words(lex, ids)
            assert lengths[b, :len(words)].tolist() == [len(w) for w, _ in words] and not lengths[b, len(words):].any()
            assert [pieces[b, w, :n].tolist() for w, n in enumerate(lengths[b, :len(words)])] == [w for w, _ in words]
            assert (pieces[b][lengths[b][:, None] <= range(pieces.shape[2])] == -1).all()
            assert hashes[b, :len(words)].tolist() == [combined(*text_hash(key)) for _, key in words]
            assert (hashes[b, len(words):] == -1).all()
    assert pieces.shape[1] == max(len(_source_words(lex, ids)) for ids in sources)
    padded_ids = np.array([ids + [PAD] * (max(map(len, sources)) - len(ids)) for ids in sources])
    assert all(np.array_equal(a, b) for a, b in zip(lex.source_word_arrays(padded_ids), (pieces, lengths, hashes),
                                                     strict=True))  # a padded batch, as a search passes it


def test_decoding_pauses_the_cycle_collector_and_restores_it(model, sources, monkeypatch):
    import gc

    from summarizer.decode import search
    seen = []
    original = search.decode_batch
    monkeypatch.setattr(search, "decode_batch", lambda *a, **k: (seen.append(gc.isenabled()), original(*a, **k))[1])
    rt = Runtime(torch.device("cpu"), torch.device("cpu"), "fp32")
    src = [row[row != PAD].tolist() for row in sources]
    assert gc.isenabled()
    expected = search.decode_all(model, src, settings(beam_size=2), rt)
    assert seen and not any(seen) and gc.isenabled()
    gc.disable()
    try:  # a caller that paused it already keeps it paused
        assert search.decode_all(model, src, settings(beam_size=2), rt) == expected and not gc.isenabled()
    finally:
        gc.enable()


def test_word_rules_agree_between_greedy_and_beam_one(lexicon_and_model):
    _, _, lex, m, src, _ = lexicon_and_model
    s = settings(max_len=20, known_words=True, no_repeat_words=True)
    assert greedy(m, src, s, lex) == beam_search(m, src, dataclasses.replace(s, beam_size=1), lex)
    assert beam_search(m, src, dataclasses.replace(s, beam_size=3), lex) == \
        beam_search(m, src, dataclasses.replace(s, beam_size=3), lex, use_cache=False)


def test_byte_minimum_fills_the_budget(lexicon_and_model):
    tokenizer, _, lex, m, src, _ = lexicon_and_model
    for hyp in beam_search(m, src, settings(beam_size=3, max_len=30, truncate_bytes=40), lex):
        assert len(tokenizer.decode(hyp).encode()) >= 40


def test_length_batches_fit_the_budget_and_cover_every_sentence():
    from summarizer.decode.search import length_batches
    lengths = [5, 40, 3, 12, 12, 7, 90, 1]
    batches = length_batches(lengths, budget=40)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 40
        assert [lengths[i] for i in b] == sorted(lengths[i] for i in b)
    assert [i for b in batches for i in b] == sorted(range(len(lengths)), key=lambda i: lengths[i])


def test_batches_decoded_in_parallel_give_the_same_outputs_in_input_order(model):
    """eval.threads: several batches at once (one core each) change neither outputs nor their order, and the
    process's intra-op thread count is restored afterwards."""
    from summarizer import runtime
    from summarizer.decode.search import decode_all
    torch.manual_seed(2)
    sources = [torch.randint(4, 40, (int(n),)).tolist() for n in torch.randint(2, 12, (23,))]
    rt = runtime.setup(SystemConfig(device="cpu"), PlacementConfig(), "fp32")
    threads = torch.get_num_threads()
    for beam in (1, 3):
        one = decode_all(model, sources, settings(beam_size=beam, batch_tokens=24, threads=1), rt)
        several = decode_all(model, sources, settings(beam_size=beam, batch_tokens=24, threads=3), rt)
        alone = [greedy(model, torch.tensor([s]), PLAIN)[0] for s in sources] if beam == 1 else one
        assert several == one == alone
        assert torch.get_num_threads() == threads


def test_decoding_batches_are_sized_for_the_device():
    """eval.batch_tokens=0: 16,384 padded source tokens x beam where a CPU decodes, 2,097,152 where a GPU does (a
    step costs its kernel launches there, whatever its rows); a set value is used as it is, on either."""
    from summarizer.decode.search import decode_batch_tokens
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for encoder, decoder, expected in ((cpu, cpu, 16_384), (cuda, cuda, 2_097_152), (cuda, cpu, 2_097_152)):
        rt = Runtime(encoder, decoder, "fp32")
        assert decode_batch_tokens(EvalConfig(), rt) == expected
        assert decode_batch_tokens(EvalConfig(batch_tokens=500), rt) == 500


def test_a_batch_out_of_gpu_memory_is_decoded_in_halves(model, monkeypatch, capsys):
    """A batch the GPU has no memory for (here: any of more than 4 sentences) is split in halves until each fits;
    the summaries are those of batches that fit, said once on stderr. A single sentence that does not fit fails."""
    from summarizer import runtime
    from summarizer.decode import search
    torch.manual_seed(3)
    sources = [torch.randint(4, 40, (int(n),)).tolist() for n in torch.randint(2, 12, (19,))]
    rt = runtime.setup(SystemConfig(device="cpu"), PlacementConfig(), "fp32")
    fitting = search.decode_all(model, sources, settings(beam_size=2, batch_tokens=8, threads=1), rt)
    real, sizes = search.decode_batch, []

    def small_gpu(model, src, *args):
        sizes.append(src.shape[0])
        if src.shape[0] > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, src, *args)
    monkeypatch.setattr(search, "decode_batch", small_gpu)
    big = settings(beam_size=2, batch_tokens=10_000, threads=1)  # every sentence in one batch
    assert search.decode_all(model, sources, big, rt) == fitting
    assert sizes[0] == 19 and max(s for s in sizes if s <= 4) <= 4 and sizes.count(19) == 1
    assert capsys.readouterr().err.count("ran out of GPU memory") == 1
    monkeypatch.setattr(search, "decode_batch", lambda *a: (_ for _ in ()).throw(torch.OutOfMemoryError("oom")))
    with pytest.raises(torch.OutOfMemoryError):
        search.decode_all(model, sources[:1], big, rt)


def test_the_check_between_batches_runs_once_per_batch_and_its_stop_ends_the_decode(model, monkeypatch):
    """decode_all's `check` (training's stop point; under DDP a collective) runs after each batch, once per batch
    whatever the threads or an out-of-memory split, so every rank decoding the same sources makes as many; what it
    raises ends the decode: no batch is started after it, and the intra-op threads are restored."""
    from summarizer import runtime
    from summarizer.decode import search
    torch.manual_seed(4)
    sources = [torch.randint(4, 40, (int(n),)).tolist() for n in torch.randint(2, 12, (19,))]
    rt = runtime.setup(SystemConfig(device="cpu"), PlacementConfig(), "fp32")
    batches = len(search.length_batches([len(s) for s in sources], 24 // 2))
    assert batches > 5
    checks = []
    for threads in (1, 2):
        checks.clear()
        search.decode_all(model, sources, settings(beam_size=2, batch_tokens=24, threads=threads), rt,
                          check=lambda: checks.append(1))
        assert len(checks) == batches
    real, decoded = search.decode_batch, []

    def small_gpu(model, src, *args):
        if src.shape[0] > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, src, *args)
    monkeypatch.setattr(search, "decode_batch", small_gpu)
    checks.clear()
    search.decode_all(model, sources, settings(beam_size=2, batch_tokens=10_000, threads=1), rt,
                      check=lambda: checks.append(1))
    assert len(checks) == 1  # one batch, decoded in parts

    stopped = threading.Event()

    def counted(*args):
        decoded.append(1)
        if len(decoded) > 1:
            stopped.wait(10)  # a second worker holds its batch until the stop: it may be under way, none after it
        return real(*args)

    def stop():
        stopped.set()
        raise KeyboardInterrupt

    monkeypatch.setattr(search, "decode_batch", counted)
    threads = torch.get_num_threads()
    for n in (1, 2):
        decoded.clear()
        stopped.clear()
        with pytest.raises(KeyboardInterrupt):
            search.decode_all(model, sources, settings(beam_size=2, batch_tokens=24, threads=n), rt, check=stop)
        assert torch.get_num_threads() == threads
        # the first; one held in each worker; and the next each takes before the pool's shutdown cancels the rest
        assert len(decoded) <= 2 * n + 1 < batches


def test_minimum_length_never_exceeds_the_source():
    """eval.min_len holds a summary back from ending, but never past its own source's length: a three-piece
    input is not made into an eight-piece headline."""
    from summarizer.decode.rules import Rules
    src = torch.tensor([[5, 6, 7, 0, 0, 0, 0, 0, 0, 0], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])
    rules = Rules(src, 2, settings(min_len=8), None)
    for step, ends in ((2, [False] * 4), (3, [True, True, False, False]), (8, [True] * 4)):
        allowed = rules.apply(torch.zeros(4, 16), step, torch.full((4, step), 5)) > float("-inf")
        assert allowed[:, 3].tolist() == ends, step  # 3: EOS


@pytest.mark.parametrize("static", [False, True], ids=["apply", "apply_at"])
def test_byte_minimum_holds_from_the_first_step_and_never_comes_back(lexicon_and_model, static):
    """With eval.truncate_bytes, EOS waits for the summary to fill the budget, or, for a source shorter than it,
    to be as long as its source: from the first step (a short source's summary does not end with nothing
    written), and once a row may end it may end at every later step. The same in both searches' rules."""
    from summarizer.decode.rules import Rules
    tokenizer, _, lex, _, _, _ = lexicon_and_model
    src = padded(tokenizer, ["the government of france said monday it would cut fuel taxes .", "rain ."])
    budget, s = 40, settings(min_len=8, max_len=30, truncate_bytes=40)
    rules = Rules(src, 1, s, lex, capacity=s.max_len + 1 if static else 0)
    piece = tokenizer.encode("the")[0]
    written = int(lex.piece_bytes[piece])  # bytes a row writes a step, its word-start space counted
    source_bytes = lex.piece_bytes[src].sum(dim=1).tolist()
    source_pieces = (src != PAD).sum(dim=1).tolist()
    tokens = torch.full((2, s.max_len + 1), piece)
    for step in range(s.max_len):
        scores = torch.zeros(2, tokenizer.vocab_size)
        out = rules.apply_at(scores, torch.tensor(step), tokens) if static else \
            rules.apply(scores, step, tokens[:, :step])
        may_end = (out[:, EOS] > float("-inf")).tolist()
        for row in range(2):
            expected = step >= min(s.min_len, source_pieces[row]) and \
                step * written >= min(budget + 1, source_bytes[row])
            assert may_end[row] == expected, (row, step)
        rules.advance(torch.arange(2), torch.full((2,), piece))
    assert source_bytes[1] < budget < source_bytes[0]  # one source of each kind was checked


def _words(lex, hyp: list[int]) -> tuple[list[list[int]], list[int]]:
    """`hyp` as words of pieces: (the finished ones, the one being spelled)."""
    words, current = [], []
    for piece in hyp:
        if lex.starts_word[piece]:
            words, current = words + [current] if current else words, [piece]
        elif lex.text[piece]:
            current = current + [piece]
    return words, current


def _allowed_by_definition(lex, known_pieces: set, source: list, hyp: list[int]) -> set[int]:
    """The word rules (known words only, no repeats) read off their definition, for one hypothesis: what may
    come next after `hyp`, given the known words' piece sequences and the source's (pieces, text) words."""
    words, current = _words(lex, hyp)
    text = lex.repeat_key  # words are compared by their text without punctuation after some text
    finished_texts = {text(w) for w in words}
    used = {k for k in known_pieces if text(k) in finished_texts}  # a finished word uses up its key
    cur = tuple(current)
    source_seqs = [(tuple(p), t) for p, t in source]
    allowed = set()
    if cur:
        allowed |= {k[len(cur)] for k in known_pieces if len(k) > len(cur) and k[:len(cur)] == cur and k not in used}
        allowed |= {p[len(cur)] for p, t in source_seqs if len(p) > len(cur) and p[:len(cur)] == cur
                    and t not in finished_texts}
    complete = cur in known_pieces or any(p == cur for p, _ in source_seqs)
    if not cur or (text(cur) not in finished_texts and complete):
        used_now = used | {k for k in known_pieces if cur and text(k) == text(cur)}
        texts_now = finished_texts | ({text(cur)} if cur else set())
        allowed |= {EOS} | {k[0] for k in known_pieces if k not in used_now}
        allowed |= {p[0] for p, t in source_seqs if t not in texts_now}
    return allowed or {EOS}


def _written(lex, hyp: list[int]) -> list[tuple[list[int], list[int]]]:
    """(a finished word's pieces, the word being spelled) for each finished word it is a proper prefix of."""
    words, current = _words(lex, hyp)
    return [(w, current) for w in words if len(w) > len(current) and w[:len(current)] == current] + \
        [(w, []) for w in words + [current] if w]  # or begin it again


def test_word_rules_allow_exactly_what_their_definition_allows(lexicon_and_model, tiny_prepared):
    """Random beams (random parents, random allowed pieces, sentences leaving) against the rules read off
    their definition at every step."""
    from summarizer.data.prepared import read_pairs
    from summarizer.decode.constraints import WordRules
    tokenizer, known, lex, *_ = lexicon_and_model
    known_pieces = {tuple(ids) for ids in tokenizer.encode_batch(sorted(known))
                    if ids and lex.starts_word[ids[0]] and all(lex.text[i] for i in ids[1:]) and UNK not in ids}
    pairs = read_pairs(tiny_prepared, "train")
    gen = torch.Generator().manual_seed(0)
    for trial in range(8):
        sources = [tokenizer.encode(pairs[(trial * 7 + i) % len(pairs)]["source"]) for i in range(3)]
        group = 1 + trial % 3
        rules = WordRules(lex, sources, group=group, known_only=True, no_repeat=True)
        alive, hyps = list(range(3)), [[] for _ in range(3 * group)]
        for _ in range(16):
            allowed = rules.mask(torch.zeros(len(hyps), lex.vocab_size)) > float("-inf")
            for r, hyp in enumerate(hyps):
                words = _source_words(lex, sources[alive[r // group]])
                assert set(allowed[r].nonzero().flatten().tolist()) == _allowed_by_definition(
                    lex, known_pieces, words, hyp), (trial, r, hyp)
            parents = [r // group * group + int(torch.randint(group, (1,), generator=gen)) for r in range(len(hyps))]
            tokens = []
            for p in parents:
                choices = allowed[p].nonzero().flatten().tolist()
                # mostly re-spell a word the row has written: where the no-repeat rules bite
                replay = [w[len(cur)] for w, cur in _written(lex, hyps[p]) if w[len(cur)] in choices]
                pick = replay if replay and torch.rand(1, generator=gen) < 0.7 else choices
                tokens.append(pick[int(torch.randint(len(pick), (1,), generator=gen))])
            rules.advance(parents, tokens)
            hyps = [hyps[p] + ([t] if t != EOS else []) for p, t in zip(parents, tokens, strict=True)]
            if len(alive) > 1 and _ % 5 == 4:  # the first sentence leaves the batch
                keep = list(range(group, len(hyps)))
                rules.select(keep, list(range(1, len(alive))))
                alive, hyps = alive[1:], hyps[group:]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16_bit_decoding_form_casts_once_and_changes_nothing(model, sources, precision):
    """Autocast keeps no weight casts under inference_mode: the decoding form stores the linear layers in
    16 bit once, and the output projection is cast once per batch. Same log-probabilities, same outputs as
    float32 weights cast by autocast at every step, and no weight is cast during a step."""
    cpu = torch.device("cpu")
    rt = Runtime(device=cpu, decoder_device=cpu, precision=precision)
    cast = decoding_form(copy.deepcopy(model), rt, "none")
    assert {p.dtype for n, p in cast.named_parameters() if "norm" not in n and "embedding" not in n} == {rt.dtype}
    assert cast.embedding.weight.dtype == torch.float32
    prefix = torch.randint(4, 40, (sources.shape[0], 5))
    with torch.inference_mode(), rt.compute():
        state = cast.start_decoding(cast.encode(sources), sources)
        assert state.output_weight.dtype == rt.dtype
        for m in (model, cast):  # the whole prefix, no cache: every weight in use
            logp = m.decode(prefix, m.encode(sources), sources)
            assert logp.dtype == torch.float32
            if m is model:
                reference = logp
        assert torch.equal(logp, reference)
        for beam in (1, 4):
            s = settings(beam_size=beam)
            assert beam_search(cast, sources, s) == beam_search(model, sources, s)
    weights = {tuple(p.shape) for m in cast.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters()}

    def weight_casts(m):
        with torch.inference_mode(), rt.compute():
            state = m.start_decoding(m.encode(sources), sources)
            with profile(record_shapes=True) as prof:
                m.decode(prefix[:, :1], state.memory, sources, state)
        return [e for e in prof.events() if e.name == "aten::_to_copy" and tuple(e.input_shapes[0]) in weights]

    assert weight_casts(model) and not weight_casts(cast)  # autocast casts every weight at every step


# --- int8 decoding (eval.quantize=int8), on fixed weights: what holds on any CPU --------------------------

def int8_form(m: Seq2Seq):
    cpu = torch.device("cpu")
    return decoding_form(m, Runtime(device=cpu, decoder_device=cpu, precision="fp32"), "int8")


def test_int8_next_token_distributions_stay_close_to_float(model, sources):
    """On a fixed-seed model, not one trained in the test run (whose quality, and ROUGE on 40 pairs, moves with the
    machine): at every position KL(float || int8) <= 0.01 nats, and where float's best token leads the next by
    more than 0.5 nats, int8 picks it too. Dynamic int8 rounds weights and activations to 1/127 of their
    tensor's range; here the KL stays under 0.001 and the two best tokens move by under 0.1 nats, so both bounds
    hold with room to spare. What int8 costs in ROUGE is measured by `make bench` and in docs/results.md."""
    torch.manual_seed(2)
    prefix = torch.randint(4, 40, (sources.shape[0], 10))
    quantized = int8_form(model)
    with torch.inference_mode():
        ref = model.decode(prefix, model.encode(sources), sources)  # (batch, tgt_len, vocab) log-probabilities
        got = quantized.decode(prefix, quantized.encode(sources), sources)
    kl = (ref.exp() * (ref - got)).sum(-1)
    assert kl.max() <= 0.01, kl.max()
    best = ref.topk(2, dim=-1).values
    clear = best[..., 0] - best[..., 1] > 0.5
    assert clear.float().mean() > 0.5  # the rule is tested on most positions, not vacuously
    assert torch.equal(ref.argmax(-1)[clear], got.argmax(-1)[clear])


@pytest.mark.parametrize("beam", [1, 4])
def test_int8_decoding_keeps_the_length_and_word_rules(model, sources, lexicon_and_model, beam):
    search = beam_search if beam > 1 else greedy
    for hyp in search(int8_form(model), sources, settings(beam_size=beam, max_len=5, min_len=3)):
        assert 3 <= len(hyp) <= 5
    tokenizer, known, lex, m, src, texts = lexicon_and_model
    s = settings(beam_size=beam, max_len=20, min_len=4, known_words=True, no_repeat_words=True)
    for i, hyp in enumerate(search(int8_form(m), src, s, lex)):
        words = tokenizer.decode(hyp).split()
        assert len(hyp) >= 4 and all(w in known or w in texts[i].split() for w in words), words
        keys = [lex.repeat_key(tokenizer.encode(w)) for w in words]
        assert len(keys) == len(set(keys)), words


def test_a_greedy_row_left_with_no_token_ends_instead_of_emitting_pad():
    """n-gram blocking can take away the only piece the word rules allowed; greedy then ends the row (EOS, its
    unfinished word cut), where an argmax over -inf alone would emit PAD, and PAD would dodge the n-gram."""
    from summarizer.decode.rules import best_tokens
    scores = torch.full((3, 10), float("-inf"))
    scores[0, 7] = -1.0
    scores[2, [4, 5]] = torch.tensor([-3.0, -2.0])
    assert best_tokens(scores).tolist() == [7, EOS, 5]


class OnlyOnePiece:
    """A stand-in model (decoded without a cache) that allows one piece and nothing else, ever."""

    def encode(self, src_ids):
        return torch.zeros(src_ids.shape[0], src_ids.shape[1], 4)

    def decode(self, tgt_in, memory, src_ids):
        scores = torch.full((tgt_in.shape[0], tgt_in.shape[1], 10), float("-inf"))
        scores[:, :, 5] = 0.0
        return scores


def test_greedy_ends_a_row_that_ngram_blocking_leaves_without_a_token():
    """Piece 5 twice, then a third 5 would repeat the bigram "5 5": nothing is left, and the summary ends."""
    s = settings(min_len=0, max_len=6, no_repeat_ngram=2)
    assert greedy(OnlyOnePiece(), torch.tensor([[7, 8, 9]]), s, use_cache=False) == [[5, 5]]


def test_greedy_never_writes_pad_or_a_repeated_ngram(lexicon_and_model):
    _, _, lex, m, src, _ = lexicon_and_model
    for n in (2, 3):
        s = settings(max_len=24, known_words=True, no_repeat_words=True, no_repeat_ngram=n)
        for hyp in greedy(m, src, s, lex):
            grams = list(zip(*(hyp[i:] for i in range(n)), strict=False))
            assert PAD not in hyp and len(grams) == len(set(grams)), hyp


def test_a_finished_hypothesis_is_scored_by_its_length_as_searched_before_its_cut_word():
    """At max_len a hypothesis may end inside a word, which is cut; its length penalty counts what was searched
    (EOS included), so a cut does not raise its score above the hypotheses it was ranked against."""
    from summarizer.data.tokenizer import BOS
    from summarizer.decode.rules import finalise

    class Cuts:  # a Rules stand-in: row 0's last word (2 pieces) may not end, row 1's may
        def cuts(self, rows):
            return torch.tensor([2, 0])[rows]

    prefixes = torch.tensor([[BOS, 5, 6, 7], [BOS, 5, 6, 8]])  # 3 tokens searched, then EOS
    finished = [[]]
    finalise(finished, [0], prefixes, torch.tensor([[-1.0, -2.0]]), torch.tensor([[0, 1]]),
             torch.tensor([[True, True]]), 2, 1.0, Cuts())
    assert finished == [[(-1.0 / 4, [5]), (-2.0 / 4, [5, 6, 8])]]
