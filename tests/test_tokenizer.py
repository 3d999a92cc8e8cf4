"""Tests for summarizer/data/tokenizer.py: normalisation, pinned special ids, lossless round trips."""
import hashlib
import json

import pytest

from summarizer.data.prepared import open_tokenizer, read_meta
from summarizer.data.tokenizer import BOS, EOS, PAD, UNK, UNK_WORD, Tokenizer, normalize, normalize_as
from summarizer.errors import DataError


@pytest.mark.parametrize("raw, lowercase, mask_digits, expected", [
    ("floods hit UNK province", False, False, "floods hit <unk> province"),
    ("floods hit <UNK> province", True, False, "floods hit <unk> province"),
    ("UNK UNK <unk>", True, True, "<unk> <unk> <unk>"),
    ("UNKNOWN risks and unk words stay", False, False, "UNKNOWN risks and unk words stay"),
    ("Rates Rose 0.25 Points in 2024", True, True, "rates rose #.## points in ####"),
    ("Rates Rose 0.25", False, False, "Rates Rose 0.25"),
    ("  a \t b\n c  ", False, False, "a b c"),
    ("", True, True, ""),
    ("shares\0in acme\0\0 fell", False, False, "shares in acme fell"),  # control characters are whitespace
    ("\0\x01\x1b\x7f\x85\x9f\u2028\u2029\r\x0b\x0c\x1c", True, True, ""),
    ("a\x1bb UNK\0c \x00UNK\x00", False, False, "a b <unk> c <unk>"),  # UNK whole between them too
])
def test_normalize(raw, lowercase, mask_digits, expected):
    assert normalize(raw, lowercase, mask_digits) == expected
    assert normalize(expected, lowercase, mask_digits) == expected  # idempotent


@pytest.mark.parametrize("raw, expected", [
    # raw text becomes what Gigaword's sources look like: Treebank words, brackets and quotes, masked digits
    ("Kazakhstan's President said (in Astana) he \"can't\" cut US$2,500.", "kazakhstan 's president said -lrb- in "
     "astana -rrb- he `` ca n't '' cut us $ #,### ."),
    ("Stocks fell 3% on Monday; S&amp;P lost 12.5 points...", "stocks fell # % on monday ; s & p lost ##.# points ..."),
    ("The UNK mayor, <unk> said: no.", "the <unk> mayor , <unk> said : no ."),
    # Gigaword's own text comes back as it was: PTB quotes, `'s`, `n't`, masked numbers, `<unk>`
    ("`` we do n't know '' , the <unk> 's chief said of the ##,### -lrb- ## % -rrb- rise .",
     "`` we do n't know '' , the <unk> 's chief said of the ##,### -lrb- ## % -rrb- rise ."),
    ("a\x1bb c", "a b c"),
])
def test_ptb_words(raw, expected):
    assert normalize(raw, True, True, "ptb") == expected
    assert normalize(expected, True, True, "ptb") == expected  # idempotent: tokenized input is left as it is
    assert normalize_as(raw, {"lowercase": True, "mask_digits": True, "words": "ptb"}) == expected


def test_ptb_keeps_a_hash_in_its_word():
    assert normalize("#1 pick costs $5; ### homes", False, False, "ptb") == "#1 pick costs $ 5 ; ### homes"
    assert normalize("#1 pick costs $5; ##,### homes", False, True, "ptb") == "## pick costs $ # ; ##,### homes"


def test_data_prepared_without_a_word_tokenizer_is_read_as_before():
    # meta.json written before data.word_tokenizer existed has no `words`: whitespace only
    assert normalize_as("He can't", {"lowercase": True, "mask_digits": True}) == "he can't"


def test_uppercase_unk_is_mapped_before_lowercasing():
    # After lowercasing, Gigaword's test-set UNK would be indistinguishable from a word "unk".
    assert normalize("the UNK said", lowercase=True, mask_digits=False) == "the <unk> said"


@pytest.fixture(scope="module")
def tokenizer(tiny_prepared) -> Tokenizer:
    return open_tokenizer(tiny_prepared)


def test_special_ids_are_pinned(tokenizer):
    assert (PAD, UNK, BOS, EOS) == (0, 1, 2, 3)
    sp = tokenizer.sp
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (PAD, UNK, BOS, EOS)
    assert [sp.id_to_piece(i) for i in range(4)] == ["<pad>", "<sp_unk>", "<s>", "</s>"]


def test_gigaword_unk_is_one_piece_distinct_from_spm_unk(tokenizer):
    unk_word_id = tokenizer.sp.piece_to_id(UNK_WORD)
    assert unk_word_id not in (PAD, UNK, BOS, EOS)
    ids = tokenizer.encode("a <unk> b")
    assert ids.count(unk_word_id) == 1 and UNK not in ids
    assert tokenizer.decode(ids) == "a <unk> b"


@pytest.mark.parametrize("text", ["a <unk> b", "<unk>", "##.##", "up ## percent to #.## billion",
                                  "city beat united #-# on monday", "john <unk> , the president of <unk> group"])
def test_round_trip_on_normalized_text(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_decode_writes_unknown_pieces_as_given_and_is_sp_decode_otherwise(tokenizer, tiny_prepared):
    for split in read_meta(tiny_prepared)["splits"]:
        with open(tiny_prepared / f"{split}.jsonl") as f:
            for line in f:
                ids = tokenizer.encode(json.loads(line)["target"])
                assert tokenizer.decode(ids, {}) == tokenizer.decode(ids)
    text = "zoë and ångström win"
    ids, pieces = tokenizer.encode(text), tokenizer.pieces(text)
    assert len(ids) == len(pieces) and UNK in ids
    fill = {t: pieces[t] for t, i in enumerate(ids) if i == UNK}
    assert tokenizer.decode(ids, fill) == text
    assert "⁇" in tokenizer.decode(ids, {})  # nothing copied: SentencePiece's own mark, for readable to drop


def test_round_trip_on_every_prepared_pair(tokenizer, tiny_prepared):
    for split in read_meta(tiny_prepared)["splits"]:
        with open(tiny_prepared / f"{split}.jsonl") as f:
            texts = [t for line in f for t in json.loads(line).values()]
        assert tokenizer.decode_batch(tokenizer.encode_batch(texts)) == texts


def test_digit_masks_never_merge_with_letters(tokenizer):
    pieces = [tokenizer.sp.id_to_piece(i) for i in range(tokenizer.vocab_size)]
    assert any("#" in p for p in pieces)
    assert not [p for p in pieces if "#" in p and any(c.isalpha() for c in p)]


def test_decode_stops_at_eos_and_skips_pad_and_bos(tokenizer):
    ids = tokenizer.encode("egypt to raise fuel taxes")
    assert tokenizer.decode([BOS] + ids + [EOS] + tokenizer.encode("ignored after eos")) == "egypt to raise fuel taxes"
    assert tokenizer.decode([BOS, PAD] + ids + [PAD, PAD]) == "egypt to raise fuel taxes"
    assert tokenizer.decode([EOS] + ids) == ""


def test_batch_methods_match_single(tokenizer):
    texts = ["norway to ban oil exports", "", "atlas motors shares fall on profit warning"]
    batch = tokenizer.encode_batch(texts)
    assert batch == [tokenizer.encode(t) for t in texts]
    assert tokenizer.decode_batch(batch) == texts


def test_vocab_size_and_sha256_match_meta(tokenizer, tiny_prepared):
    meta = read_meta(tiny_prepared)
    assert tokenizer.vocab_size == meta["vocab_size"]
    model_bytes = (tiny_prepared / "spm.model").read_bytes()
    assert tokenizer.sha256 == meta["spm_sha256"] == hashlib.sha256(model_bytes).hexdigest()


def test_missing_model_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="make prep"):
        Tokenizer(tmp_path / "spm.model")


def test_replaced_model_is_refused(tiny_prepared, tmp_path):
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(tiny_prepared, copy)
    meta = json.loads((copy / "meta.json").read_text())
    meta["spm_sha256"] = "0" * 64
    (copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="sha256"):
        open_tokenizer(copy)


def test_restore_digits_puts_back_what_masking_hid():
    from summarizer.data.tokenizer import restore_digits
    source = "Shares fell 3.5 percent to 120 yen in 2024 , 12 analysts said ."
    assert restore_digits("shares fall #.# percent to ### yen", source) == "shares fall 3.5 percent to 120 yen"
    assert restore_digits("## analysts see ### yen", source) == "12 analysts see 120 yen"
    assert restore_digits("##### yen", source) == "##### yen"  # nothing in the source masks to it
    assert restore_digits("shares fall #.# percent", "shares fell #.# percent") == "shares fall #.# percent"
    # a raw source's numbers beside punctuation, as its words were split for the model (PTB): $, %, the full stop
    assert restore_digits("oil rises to $ ##.## , up # % from ####", "Oil rose to $75.50 a barrel, up 5% from 1999.") \
        == "oil rises to $ 75.50 , up 5 % from 1999"


def test_restore_digits_never_guesses_between_several_numbers_of_one_form():
    """A source with two numbers of a masked word's form: without the copy head's pick the word stays masked
    (the first number would be a wrong one half the time); a pick names one of them; a lone form is restored."""
    from summarizer.data.tokenizer import restore_digits
    source = "Profit rose 15 percent in 2019 as sales fell 12 percent"
    assert restore_digits("sales fall ## percent", source) == "sales fall ## percent"
    assert restore_digits("sales fall ## percent in ####", source, [None, None]) == "sales fall ## percent in 2019"
    assert restore_digits("sales fall ## percent in ####", source, ["12", None]) == "sales fall 12 percent in 2019"
    assert restore_digits("## up , ## down", source, [None, "12"]) == "## up , 12 down"  # the k-th masked word
    assert restore_digits("sales fall ## percent", source, ["99"]) == "sales fall ## percent"  # not the source's
    # a number beside punctuation counts as one of the form too, though the words between spaces hold only `15`
    assert restore_digits("sales fall ## percent", "Profit rose 15 percent, sales fell 12, analysts said") \
        == "sales fall ## percent"
    from summarizer.data.tokenizer import masked_numbers
    assert masked_numbers(source, lower=True) == {"##": ["15", "12"], "####": ["2019"]}
