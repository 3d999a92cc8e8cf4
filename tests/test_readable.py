"""Headlines for people: case from the source, PTB tokens and spacing undone, <unk> replaced or dropped."""
import pytest

from summarizer.readable import readable

NORM = {"lowercase": True, "mask_digits": True}


class Spelling:
    """A stand-in tokenizer: it cannot spell words holding any of `unknown` (as SentencePiece gives UNK)."""

    def __init__(self, unknown=""):
        self.unknown = unknown

    def encode_raw(self, text, normalization):
        return [1] if any(c in self.unknown for c in text) else [5]


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
])
def test_case_punctuation_and_digits_come_back_from_the_source(summary, source, expected):
    assert readable(summary, source, Spelling(), NORM) == expected


def test_unknown_words_come_from_the_source_word_the_tokenizer_could_not_spell_or_are_dropped():
    source = "Zoë Ångström wins the Nobel prize."
    assert readable("<unk> wins nobel prize", source, Spelling("ëÅ"), NORM) == "Zoë wins Nobel prize"
    assert readable("<unk> and <unk> win", source, Spelling("ëÅ"), NORM) == "Zoë and Ångström win"
    assert readable("<unk> wins nobel", "A scientist wins the Nobel.", Spelling(), NORM) == "Wins Nobel"


def test_eval_writes_the_readable_form_beside_the_scored_one_and_summarize_can_print_either(trained_run, capsys,
                                                                                            monkeypatch):
    import io

    from summarizer.__main__ import main
    tmp, args = trained_run
    out = tmp / "readable_eval"
    assert main(["eval", *args, "eval.beam_size=1", f"eval.out_dir={out}"]) == 0
    scored = (out / "predictions.txt").read_text().splitlines()
    for_people = (out / "predictions.readable.txt").read_text().splitlines()
    assert len(scored) == len(for_people) == 40
    assert all(p[:1] == p[:1].upper() for p in for_people if p)
    assert [p.lower().replace(" ", "") for p in for_people][:5] == [s.replace(" ", "") for s in scored][:5]
    capsys.readouterr()
    outputs = []
    for switch in ("true", "false"):
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"the mayor opened a new park on monday .\n")))
        assert main(["summarize", *args, "eval.beam_size=1", f"eval.readable={switch}"]) == 0
        outputs.append(capsys.readouterr().out.strip())
    assert outputs[0][:1].isupper() and outputs[1] == outputs[1].lower() and outputs[0].lower() == outputs[1]
