"""Headlines for people: case from the source, PTB tokens and spacing undone, <unk> replaced or dropped."""
import pytest
import torch

from summarizer import runtime
from summarizer.config.schema import PlacementConfig, SystemConfig
from summarizer.data.prepared import open_tokenizer, read_meta
from summarizer.data.tokenizer import UNK
from summarizer.decode.inference import summary_text
from summarizer.decode.readable import readable
from summarizer.decode.search import copied_unknowns
from summarizer.model.transformer import DecoderOutput


@pytest.mark.parametrize("summary, source, expected", [
    ("british airways blames fuel prices", "British Airways has blamed high fuel prices, its chairman said.",
     "British Airways blames fuel prices"),
    ("u.s. stocks do n't move ; fed 's decision awaited",
     "U.S. stocks didn't move as investors awaited the Fed's move.", "U.S. stocks don't move; Fed's decision awaited"),
    ("profits drop -lrb- and pound falls -rrb-", "Profits dropped (and the pound fell).",
     "Profits drop (and pound falls)"),
    ("he says `` no '' to nato", "He said \"no\" to NATO on Monday.", 'He says "no" to NATO'),
    ("profits drop 40 % in quarter", "A 40% drop in profits in the quarter.", "Profits drop 40% in quarter"),
    ("profits drop ## % in quarter", "A 40% drop in profits in the quarter.", "Profits drop 40% in quarter"),
    ("ferry crash kills ## in norway", "at least ## people were killed when a ferry sank in Norway",
     "Ferry crash kills ## in Norway"),  # digits the data itself masked (Gigaword's)
    ("stocks up #.# percent ; dollar at ###.## yen", "Stocks rose #.# percent, and the dollar was at ###.## yen.",
     "Stocks up #.# percent; dollar at ###.## yen"),
    ("oil costs $ ## a barrel", "Oil cost $## a barrel.", "Oil costs $## a barrel"),
    ("# metoo rally draws thousands", "A #MeToo rally drew thousands.", "#MeToo rally draws thousands"),  # no mask
    ("federer ranked # 1 again", "Federer is ranked #1 in the world again.", "Federer ranked #1 again"),
])
def test_case_punctuation_and_digits_come_back_from_the_source(summary, source, expected):
    assert readable(summary, source) == expected


def test_what_is_left_of_unknown_marks_is_dropped_with_its_word():
    source = "Zo\u00eb wins the Nobel."
    assert readable("<unk> wins nobel", source) == "Wins Nobel"
    assert readable("UNK wins nobel", source) == "Wins Nobel"
    assert readable("zo\u2047 wins nobel", source) == "Wins Nobel"
    assert readable("zo\u00eb wins nobel", source) == "Zo\u00eb wins Nobel"


class Pointing(torch.nn.Module):
    """A model whose copy head looks at source position at[t] when it writes target position t."""

    def __init__(self, at):
        super().__init__()
        self.at = at

    def encode(self, src):
        return torch.zeros(*src.shape, 1)

    def decoder_output(self, tgt_in, memory, src_ids, state=None):
        attn = torch.full((1, tgt_in.shape[1], src_ids.shape[1]), 0.01)
        for t, s in enumerate(self.at):
            attn[0, t, s] = 0.9
        return DecoderOutput(torch.zeros(1, tgt_in.shape[1], 8), attn, torch.full((1, tgt_in.shape[1], 1), 0.5))


def test_an_unknown_piece_is_written_as_the_source_characters_the_copy_head_took_it_from(tiny_prepared):
    tokenizer, meta = open_tokenizer(tiny_prepared), read_meta(tiny_prepared)
    source = "Zo\u00eb and \u00c5ngstr\u00f6m win the Nobel prize"
    src = tokenizer.encode_raw(source, meta["normalization"])
    unknown = [s for s, i in enumerate(src) if i == UNK]  # the tiny vocabulary spells neither accent, nor more
    first, second = unknown[:2]
    pieces = tokenizer.pieces(source.lower())
    hyp = list(src)  # a summary that copies the whole source; position t of [BOS] + hyp writes hyp[t]
    rt = runtime.setup(SystemConfig(device="cpu"), PlacementConfig(), "fp32")
    looks = list(range(len(hyp)))
    copied = copied_unknowns(Pointing(looks), [src], [hyp], rt)
    assert copied == [{s: s for s in unknown}]
    assert summary_text(hyp, source, tokenizer, meta, 0, copied[0]) == source
    looks[first], looks[second] = second, first  # the copy head decides which characters come back
    copied = copied_unknowns(Pointing(looks), [src], [hyp], rt)
    swapped = pieces[:first] + [pieces[second]] + pieces[first + 1:second] + [pieces[first]] + pieces[second + 1:]
    expected = "".join(swapped).replace("\u2581", " ").strip()
    assert summary_text(hyp, source, tokenizer, meta, 0, copied[0]).lower() == expected
    # Where the head looks at a known piece, the UNK's copy mass is still all on the source's UNKs: the
    # most-weighted of them is taken. A source without UNK gives nothing to copy: the word is dropped.
    looks[first] = 0
    assert copied_unknowns(Pointing(looks), [src], [hyp], rt)[0][first] in (first, second)
    assert copied_unknowns(Pointing(looks), [tokenizer.encode("the prize")], [hyp], rt) == [{}]
    assert "zo" not in summary_text(hyp, source, tokenizer, meta, 0, {}).lower()
    assert summary_text(hyp, source, tokenizer, meta, 0) == tokenizer.decode(hyp)  # the scored form: unchanged


NUMBERS = "Profit rose 15 percent in 2019 as sales fell 12 percent"  # two numbers masked alike, `##`


def _word_positions(pieces: list[str], word: int) -> list[int]:
    """The positions of the pieces of the `word`-th word (from 0) of `pieces`."""
    starts = [i for i, p in enumerate(pieces) if p.startswith("\u2581")] + [len(pieces)]
    return list(range(starts[word], starts[word + 1]))


def test_a_masked_number_gets_the_digits_the_copy_head_took_not_the_first_of_its_form(tiny_prepared):
    from summarizer.decode.inference import copied_numbers
    tokenizer, meta = open_tokenizer(tiny_prepared), read_meta(tiny_prepared)
    norm = meta["normalization"]
    src, pieces = tokenizer.encode_raw(NUMBERS, norm), tokenizer.pieces_raw(NUMBERS, norm)
    hyp = tokenizer.encode("sales fall ## percent")
    hyp_pieces = [tokenizer.sp.id_to_piece(i) for i in hyp]
    rt = runtime.setup(SystemConfig(device="cpu"), PlacementConfig(), "fp32")
    for number, word in (("12", 9), ("15", 2)):  # "12" is the source's 10th word, "15" its 3rd
        looks = [0] * (len(hyp) + 1)
        for t in _word_positions(hyp_pieces, 2):  # the pieces of `##`, looking at the number's first piece
            looks[t] = _word_positions(pieces, word)[0]
        numbers = copied_numbers(Pointing(looks), [src], [hyp], [NUMBERS], tokenizer, meta, rt)
        assert numbers == [[number]]
        assert summary_text(hyp, NUMBERS, tokenizer, meta, 0, numbers=numbers[0]) == f"sales fall {number} percent"
        assert summary_text(hyp, NUMBERS, tokenizer, meta, 0, {}, numbers[0]) == f"Sales fall {number} percent"


class Uncopying(Pointing):
    """A model without a copy head."""

    def decoder_output(self, tgt_in, memory, src_ids, state=None):
        return DecoderOutput(torch.zeros(1, tgt_in.shape[1], 8), None, None)


class Unused(Pointing):
    def decoder_output(self, *args, **kwargs):
        raise AssertionError("a model pass for a summary that needs no choice")


def test_without_a_copy_head_a_number_of_an_ambiguous_form_stays_masked(tiny_prepared):
    from summarizer.decode.inference import copied_numbers
    tokenizer, meta = open_tokenizer(tiny_prepared), read_meta(tiny_prepared)
    src, hyp = tokenizer.encode_raw(NUMBERS, meta["normalization"]), tokenizer.encode("sales fall ## percent")
    rt = runtime.setup(SystemConfig(device="cpu"), PlacementConfig(), "fp32")
    assert copied_numbers(Uncopying([]), [src], [hyp], [NUMBERS], tokenizer, meta, rt) == [None]
    assert summary_text(hyp, NUMBERS, tokenizer, meta, 0) == "sales fall ## percent"
    assert summary_text(hyp, NUMBERS, tokenizer, meta, 0, {}) == "Sales fall ## percent"
    assert readable("sales fall ## percent", NUMBERS) == "Sales fall ## percent"  # nor does the readable form guess
    # one number of the form, or none masked in the summary: restored (or left) without any model pass
    unique = tokenizer.encode("profit up #### percent")
    assert copied_numbers(Unused([]), [src, src], [unique, tokenizer.encode("sales fall")], [NUMBERS] * 2,
                          tokenizer, meta, rt) == [None, None]
    assert summary_text(unique, NUMBERS, tokenizer, meta, 0) == "profit up 2019 percent"


def test_eval_and_summarize_write_the_number_the_copy_head_took(trained_run, monkeypatch, capsys):
    """Both commands, scored and readable forms: the summary's `##` is the source's second number of that form,
    where the copy head looked, not its first."""
    import io
    import json

    from summarizer import summarize
    from summarizer.__main__ import main
    from summarizer.decode import inference
    from summarizer.evaluation import evaluate
    tmp, args = trained_run
    tokenizer, meta = open_tokenizer(tmp / "data"), read_meta(tmp / "data")
    pieces = tokenizer.pieces_raw(NUMBERS, meta["normalization"])
    hyp = tokenizer.encode("sales fall ## percent")
    hyp_pieces = [tokenizer.sp.id_to_piece(i) for i in hyp]

    def attention(model, source, written, rt):
        attn = torch.full((len(written), len(source)), 0.01)
        attn[_word_positions(hyp_pieces, 2), _word_positions(pieces, 9)[0]] = 0.9  # `##` looks at "12"
        return attn

    monkeypatch.setattr(inference, "copy_attention", attention, raising=False)
    for command in (evaluate, summarize):
        monkeypatch.setattr(command, "decode_all", lambda model, sources, *a, **k: [hyp] * len(sources))
    pairs = tmp / "numbers.jsonl"
    pairs.write_text(json.dumps({"source": NUMBERS, "target": "sales fall 12 percent"}) + "\n")
    assert main(["eval", *args, f"eval.pairs={pairs}", f"eval.out_dir={tmp / 'numbers'}"]) == 0
    assert (tmp / "numbers" / "predictions.txt").read_text() == "sales fall 12 percent\n"
    assert (tmp / "numbers" / "predictions.readable.txt").read_text() == "Sales fall 12 percent\n"
    for readable_form, expected in (("true", "Sales fall 12 percent"), ("false", "sales fall 12 percent")):
        capsys.readouterr()
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(NUMBERS.encode() + b"\n")))
        assert main(["summarize", *args, f"eval.readable={readable_form}"]) == 0
        assert capsys.readouterr().out == expected + "\n"


def test_eval_writes_the_readable_form_beside_the_scored_one_and_summarize_can_print_either(trained_run, capsys,
                                                                                            monkeypatch):
    import io

    from summarizer.__main__ import main
    from summarizer.data.prepared import read_pairs
    tmp, args = trained_run
    out = tmp / "readable_eval"
    assert main(["eval", *args, "eval.beam_size=1", f"eval.out_dir={out}"]) == 0
    scored = (out / "predictions.txt").read_text().splitlines()
    for_people = (out / "predictions.readable.txt").read_text().splitlines()
    assert len(scored) == len(for_people) == 40
    assert all(p[:1] == p[:1].upper() for p in for_people if p)
    # Whatever the model, trained in the run, writes (punctuation, <unk>, quotes): each line for people is the
    # readable form of the same line as scored; an unknown piece (⁇) is the one thing only the copy can spell.
    sources = [p["source"] for p in read_pairs(tmp / "data", "test")]
    assert [p if "\u2047" in s else readable(s, src) for s, p, src in zip(scored, for_people, sources, strict=True)] \
        == for_people
    capsys.readouterr()
    outputs = []
    source = "the mayor opened a new park on monday ."
    for switch in ("true", "false"):
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(f"{source}\n".encode())))
        assert main(["summarize", *args, "eval.beam_size=1", f"eval.readable={switch}"]) == 0
        outputs.append(capsys.readouterr().out.strip())
    assert outputs[1] == outputs[1].lower() and outputs[0] == readable(outputs[1], source)
