import json

import pytest

from summarizer.decode.inference import truncate_bytes
from summarizer.evaluation.scoring import pair_scores, quality, rouge_report, unify_unk


def test_rouge_of_a_text_against_itself_is_100():
    texts = ["police arrest suspect in bank robbery", "storm cuts power to thousands"]
    report = rouge_report(texts, [[t] for t in texts], samples=50)
    for kind in ("rouge1", "rouge2", "rougeL"):
        assert report[kind]["f"] == pytest.approx(100.0)
        assert report[kind]["f_ci"] == pytest.approx([100.0, 100.0])


def test_multi_reference_takes_the_best_reference():
    pred = ["police arrest suspect"]
    single = rouge_report(pred, [["storm cuts power"]], samples=10)
    multi = rouge_report(pred, [["storm cuts power", "police arrest suspect"]], samples=10)
    assert single["rouge1"]["f"] == 0.0 and multi["rouge1"]["f"] == pytest.approx(100.0)


def test_unk_spellings_score_alike():
    assert unify_unk("a UNK b <unk> c") == "a unk b unk c"
    assert unify_unk("UNKNOWN <unk>s") == "UNKNOWN <unk>s"
    report = rouge_report(["talks on UNK deal"], [["talks on <unk> deal"]], samples=10)
    assert report["rouge1"]["f"] == pytest.approx(100.0)


def test_confidence_interval_brackets_the_mean():
    preds = ["a b c", "a b d", "x y z", "a q c", "b c d"]
    refs = [["a b c"], ["a b c"], ["a b c"], ["a b c"], ["a b c"]]
    r = rouge_report(preds, refs, samples=200)["rouge1"]
    assert r["f_ci"][0] <= r["f"] <= r["f_ci"][1] and r["f_ci"][0] < r["f_ci"][1]
    assert json.dumps(r)  # plain floats, serialisable


def test_truncation_never_splits_a_character():
    text = "zürich café ñandú 東京"  # 1-, 2- and 3-byte characters
    for limit in range(len(text.encode()) + 2):
        cut = truncate_bytes(text, limit or 1)
        assert text.startswith(cut) and len(cut.encode()) <= max(limit, 1)
    assert truncate_bytes("zürich", 2) == "z" and truncate_bytes("zürich", 3) == "zü"  # ü is 2 bytes
    assert truncate_bytes("abc", 0) == "abc"  # 0 = no limit
    assert truncate_bytes("police arrest suspect", 15) == "police arrest s"  # as ROUGE-1.5.5 -b cuts
    assert truncate_bytes("police arrest suspect", 15, whole_words=True) == "police arrest"
    assert truncate_bytes("police arrest suspect", 14, whole_words=True) == "police arrest"
    assert truncate_bytes("zürich café", 13, whole_words=True) == "zürich café"  # fits: 13 bytes
    assert truncate_bytes("zürich café", 12, whole_words=True) == "zürich"


def test_f_takes_the_best_reference_and_recall_pools_the_references_as_rouge_155_does():
    """ROUGE-1.5.5 -f A (its default for several references) sums hits and counts over the references."""
    pred = ["police arrest suspect"]
    refs = [["police arrest suspect in bank robbery", "police arrest suspect"]]  # 3 of 6 tokens, 3 of 3
    by_f, by_r = pair_scores(pred, refs, "f")[0], pair_scores(pred, refs, "r")[0]  # (rouge1, 2, L) x (p, r, f)
    assert by_f[0, 2] == pytest.approx(1.0) and by_f[0, 1] == pytest.approx(1.0)  # the identical reference
    assert by_r[0, 1] == pytest.approx(6 / 9)  # (3 + 3) / (6 + 3), not the mean of 3/6 and 3/3
    assert by_r[1, 1] == pytest.approx(4 / 7)  # bigrams: (2 + 2) / (5 + 2)
    assert by_r[0, 0] == pytest.approx(1.0) and by_r[0, 2] == pytest.approx(2 * (6 / 9) / (1 + 6 / 9))
    report = rouge_report(pred * 2, refs * 2, samples=20, measure="r")
    assert report["rouge1"]["r"] == pytest.approx(600 / 9) and report["rouge1"]["r_ci"] == pytest.approx([600 / 9] * 2)


def test_quality_rates_on_hand_made_cases():
    known = {"police", "arrest", "suspect", "in", "robbery", "bank"}
    predictions = ["police arrest suspect", "police arrest supercomput", "bank bank robbery", "arrest zorblat"]
    sources = [[["police", "held", "a", "man"]], [["a", "man"]], [["bank"]], [["zorblat", "arrested"]]]
    references = [["police arrest man"], ["a b c d e"], ["bank robbery"], ["x"]]
    rates = quality(predictions, sources, references, known)
    assert rates["nonword_rate"] == pytest.approx(25.0)  # "supercomput"; "zorblat" is in its own source
    assert rates["repeat_rate"] == pytest.approx(25.0)  # "bank bank"
    assert rates["words_per_prediction"] == pytest.approx(2.75)
    assert rates["words_per_reference"] == pytest.approx((3 + 5 + 2 + 1) / 4)
    # closing punctuation does not make a word new; punctuation inside one does, and so does none at all
    repeats = quality(["gold rises in feb feb.", "u.s. and us", "#,### to ####", "-- and -"], [[[]]] * 4,
                      [["x"]] * 4, set())["repeat_rate"]
    assert repeats == pytest.approx(25.0)  # "feb feb."; not "u.s." and "us", nor "#,###" and "####", nor "--" and "-"
