"""Tests for data_prep and summarizer/data/prepared.py: readers, splits, cleaning, arrays, meta, idempotency, errors."""
import gzip
import hashlib
import json
import re
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest
import yaml
from conftest import ASSETS, data_config

from data_prep import prepare
from data_prep.__main__ import main
from data_prep.clean import RULES, clean_split, hold_out
from data_prep.sources import load_splits, local_files
from data_prep.tokenize import atomic_open
from summarizer.config.load import load_config
from summarizer.data.prepared import load_split, read_meta, read_pairs, split_files
from summarizer.errors import ConfigError, DataError


def _load(tmp_path, *overrides):
    cfg = data_config(tmp_path / "prep", *overrides)
    return load_splits(cfg, tmp_path / "cache")[:2]


def _lines(path):
    return path.read_text().splitlines()


# --- sources ---------------------------------------------------------------------------------

def test_jsonl_dir_maps_splits_and_skips_unmapped(tmp_path):
    splits, ignored = _load(tmp_path, f"data.source={ASSETS / 'jsonl'}")
    assert set(splits) == {"train", "valid"} and ignored == ["test_dev"]
    assert len(splits["train"]) == len(_lines(ASSETS / "jsonl/train.jsonl"))
    refs = splits["valid"]["references"]
    assert all(len(r) == 4 for r in refs) and list(splits["valid"]["target"]) == [r[0] for r in refs]


def test_jsonl_gz_split_is_named_by_its_stem(tmp_path):
    splits, ignored = _load(tmp_path, f"data.source={ASSETS / 'jsonl'}",
                           "data.splits={train: [train], valid: [valid], test: [test_dev]}")
    assert ignored == [] and len(splits["test"]) == 3
    assert splits["test"][0]["source"] == "the orchestra will tour five cities next spring ."


def test_rush_pair_is_read_line_by_line(tmp_path):
    splits, _ = _load(tmp_path, f"data.source={ASSETS / 'rush'}")
    assert list(splits["train"]["source"]) == _lines(ASSETS / "rush/train.article.txt")
    assert list(splits["train"]["target"]) == _lines(ASSETS / "rush/train.title.txt")
    assert len(splits["valid"]) == 2


def test_a_carriage_return_inside_a_rush_line_splits_nothing(tmp_path):
    """Universal newlines split a line at a lone \r: one in an article line and one in a later title line kept the
    counts equal and paired every line between them with its neighbour's title."""
    source = tmp_path / "src"
    source.mkdir()
    articles = [f"article {i} words" for i in range(6)]
    titles = [f"title {i}" for i in range(6)]
    articles[1], titles[4] = "article 1 \r words", "title \r 4"
    (source / "train.article.txt").write_bytes("".join(f"{a}\n" for a in articles).encode())
    (source / "train.title.txt").write_bytes("".join(f"{t}\r\n" for t in titles).encode())  # CRLF endings
    splits, _ = _load(tmp_path, f"data.source={source}")
    assert list(splits["train"]["source"]) == articles and list(splits["train"]["target"]) == titles


def test_csv_uses_configured_field_names(tmp_path):
    splits, _ = _load(tmp_path, f"data.source={ASSETS / 'csv'}", "data.source_field=document",
                      "data.target_field=summary")
    assert len(splits["train"]) == 4 and len(splits["valid"]) == 1
    assert "the library, which opened in 1905, will be restored ." in list(splits["train"]["source"])


def test_hub_source_goes_through_load_dataset(tmp_path, monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        rows = {"document": ["the mayor opened a new park on monday .", "a storm cut power to ### homes ."],
                "summary": ["mayor opens park", "storm cuts power"]}
        return datasets.DatasetDict({split: datasets.Dataset.from_dict(rows)
                                     for split in ("train", "validation", "test")})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr("data_prep.hub.reach_hub", lambda name: None)  # as if online
    cfg = data_config(tmp_path / "prep", "data.source=hf:fake/gigaword:default",
                      "data.source_field=document", "data.target_field=summary")
    meta = prepare(cfg)
    path, name, kwargs = calls[0]
    assert (path, name) == ("fake/gigaword", "default")
    assert kwargs["cache_dir"].startswith(str(tmp_path / "prep"))  # nothing lands in the home directory
    assert set(meta["splits"]) == {"train", "valid", "test"} and meta["source"] == "hf:fake/gigaword:default"
    assert read_pairs(tmp_path / "prep", "valid")[1] == {"source": "a storm cut power to ### homes .",
                                                         "target": "storm cuts power"}


def test_yaml_mapping_source(tmp_path):
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump({"data": {"source": {
        "train": [str(ASSETS / "jsonl/train.jsonl"), str(ASSETS / "rush/train.article.txt")],
        "test": [str(ASSETS / "jsonl/test_dev.jsonl.gz")]}}}))
    cfg = load_config(config, [f"data.dir={tmp_path / 'prep'}"]).data
    splits, ignored, _ = load_splits(cfg, tmp_path / "cache")
    assert set(splits) == {"train", "test"} and ignored == []
    assert len(splits["train"]) == len(_lines(ASSETS / "jsonl/train.jsonl")) + 6
    assert len(splits["test"]) == 3


def test_a_file_listed_under_two_splits_of_a_mapping_source_is_refused(tmp_path):
    """Model selection on the test set, as a directory source mapped that way is refused."""
    test = str(ASSETS / "jsonl/test_dev.jsonl.gz")
    source = f"data.source={{train: [{ASSETS / 'jsonl/train.jsonl'}], valid: [{test}], test: [{test}]}}"
    with pytest.raises(ConfigError, match="lists .*test_dev.jsonl.gz under both valid and test: its pairs would be "
                                          "in both"):
        _load(tmp_path, source)


def test_a_valid_split_mapped_to_train_is_said(tmp_path, capsys):
    """The recipe's data.splits trains on the source's valid split: said, not silent, with what it validates on."""
    _load(tmp_path, f"data.source={ASSETS / 'jsonl'}", "data.splits={train: [train, valid]}")
    assert "note: source split(s) valid are mapped to train (data.splits.train=['train', 'valid']); to validate " \
        "on valid instead" in capsys.readouterr().out
    _load(tmp_path, f"data.source={ASSETS / 'jsonl'}", "data.splits={train: [train, valid]}", "data.valid_holdout=20")
    assert "(data.splits.train=['train', 'valid']), and validation is on data.valid_holdout=20 pairs held out of " \
        "train; to validate on valid instead" in capsys.readouterr().out
    _load(tmp_path, f"data.source={ASSETS / 'jsonl'}")
    assert "mapped to train" not in capsys.readouterr().out


def test_missing_train_split_names_what_was_found(tmp_path):
    with pytest.raises(DataError, match=r"no train split.*\['train', 'valid'\]"):
        _load(tmp_path, f"data.source={ASSETS / 'rush'}", "data.splits={train: [training]}")


def test_unknown_product_split_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="dev"):
        _load(tmp_path, f"data.source={ASSETS / 'rush'}", "data.splits={train: [train], dev: [valid]}")


def test_a_source_split_mapped_to_two_product_splits_is_refused(tmp_path):
    """The recipe's train takes [train, valid]: mapping valid as the valid split too would validate, and pick
    best.pt, on training pairs."""
    with pytest.raises(ConfigError, match="'valid' to both train and valid.*data.splits.train=\\[train\\]"):
        _load(tmp_path, f"data.source={ASSETS / 'jsonl'}", "data.splits.train=[train, valid]",
              "data.splits.valid=[valid]")
    splits, _ = _load(tmp_path, f"data.source={ASSETS / 'jsonl'}", "data.splits.train=[train]",
                      "data.splits.valid=[valid]")
    assert set(splits) == {"train", "valid"}


@pytest.mark.parametrize("value", ["null", "5"])
def test_a_split_mapped_to_no_list_is_a_config_error(tmp_path, value):
    with pytest.raises(ConfigError, match="data.splits.valid"):
        _load(tmp_path, f"data.source={ASSETS / 'jsonl'}", f"data.splits.valid={value}")
    train = ASSETS / "jsonl" / "train.jsonl"
    with pytest.raises(ConfigError, match="split 'valid' lists"):  # a mix's split, likewise
        _load(tmp_path, f"data.source={{train: [{train}], valid: {value if value != '5' else '[]'}}}")


# --- cleaning --------------------------------------------------------------------------------

def test_cleaning_counts_every_rule(tmp_path):
    cfg = data_config(tmp_path, f"data.source={ASSETS / 'jsonl'}", "data.lowercase=true",
                      "data.mask_digits=true", "data.max_source_words=30", "data.max_target_words=10")
    raw, _, _ = load_splits(cfg, tmp_path / "cache")
    cleaned, dropped = clean_split(raw["train"], cfg, "train", num_proc=None)
    assert dropped == {"bad_chars": 1, "empty": 1, "source_too_long": 1, "target_too_long": 1, "duplicate": 1}
    assert tuple(dropped) == RULES and len(cleaned) + sum(dropped.values()) == len(raw["train"])
    sources = list(cleaned["source"])
    assert sources[0] == "the central bank raised interest rates by #.## percentage points on tuesday ."
    assert sources[1] == "heavy rain caused flooding in <unk> province , officials said ."
    assert "record <unk> harvest expected" in list(cleaned["target"])
    # whitespace variants of one pair are one pair: the first occurrence is kept, in input order
    assert sources.count("the city council approved a new budget for parks and libraries .") == 1


def test_undecodable_bytes_drop_only_their_pair(tmp_path):
    raw = tmp_path / "train.jsonl"
    raw.write_bytes(b'{"source": "caf\xe9 closes", "target": "cafe"}\n{"source": "a b c", "target": "a b"}\n')
    meta = prepare(data_config(tmp_path / "prep", f"data.source={tmp_path}", "data.vocab_size=16"))
    assert meta["dropped"]["train"]["bad_chars"] == 1 and meta["splits"]["train"]["pairs"] == 1


def test_valid_holdout_is_deterministic_and_order_independent(tmp_path):
    cfg = data_config(tmp_path, f"data.source={ASSETS / 'tiny'}", "data.splits={train: [train]}")
    raw, _, _ = load_splits(cfg, tmp_path / "cache")
    cleaned, _ = clean_split(raw["train"], cfg, "train", num_proc=None)
    train, valid = hold_out(cleaned, 25)
    train2, valid2 = hold_out(cleaned.shuffle(seed=7).flatten_indices(), 25)
    assert len(valid) == 25 and len(train) == len(cleaned) - 25
    assert set(valid["source"]) == set(valid2["source"])
    assert not set(valid["source"]) & set(train["source"])
    kept = list(train["source"])
    assert kept == [s for s in cleaned["source"] if s in set(kept)]  # train keeps its order


@pytest.mark.parametrize("kind", ["another tag", "unpaired"])
def test_a_held_out_source_leaves_train_under_every_tag(kind):
    """Held-out pairs are drawn from one tag (data.source_tag) and never from unpaired sentences; a held-out
    source's copies under another tag, or unpaired, leave train too, or valid would score what train taught."""
    rows = [{"source": f"sentence {i}", "target": f"headline {i}", "source_hash": 1000 + i, "tag": "news"}
            for i in range(20)]
    other = "extra" if kind == "another tag" else "text"
    rows += [{**row, "target": f"other {i}", "tag": other} for i, row in enumerate(rows)]
    train, valid = hold_out(datasets.Dataset.from_list(rows), 5, ("text",) if kind == "unpaired" else (), "news")
    assert sorted(valid["source"]) == [f"sentence {i}" for i in range(5)] and set(valid["tag"]) == {"news"}
    assert not set(valid["source"]) & set(train["source"])
    assert len(train) == 30  # 15 news pairs and their 15 copies


def test_a_source_dir_names_the_data_files_it_does_not_read(tmp_path, capsys):
    (tmp_path / "train.jsonl").write_text('{"source": "a b", "target": "a"}\n')
    for name in ("test.json", "valid.jsonl.bz2", "dev.csv.gz", "README.md", "notes.txt"):
        (tmp_path / name).write_text("x")
    assert list(local_files(str(tmp_path))) == ["train"]
    out = capsys.readouterr().out
    assert "dev.csv.gz, test.json, valid.jsonl.bz2 not read (split files are NAME.jsonl" in out
    assert "README" not in out and "notes" not in out


def test_a_rebuild_reads_its_inputs_again_though_their_modification_time_is_the_same(tmp_path):
    """datasets keys its cache of a local file by path and modification time: a file rewritten with its time kept
    (cp -p, rsync -t, an archive) would come back from the cache as it was, and of the same size it looks unchanged
    to prep as well. data.rebuild reads the files."""
    import os
    source = tmp_path / "src"
    source.mkdir()
    train = source / "train.jsonl"
    train.write_text("".join(f'{{"source": "old words number {i} here", "target": "old {i}"}}\n' for i in range(40)))
    stamp = train.stat().st_mtime_ns
    cfg = [f"data.source={source}", "data.splits={train: [train]}", "data.vocab_size=40"]
    prepare(data_config(tmp_path / "out", *cfg))
    size = train.stat().st_size
    train.write_text("".join(f'{{"source": "new words number {i} here", "target": "new {i}"}}\n' for i in range(40)))
    os.utime(train, ns=(stamp, stamp))
    assert train.stat().st_size == size
    prepare(data_config(tmp_path / "out", *cfg, "data.rebuild=true"))
    pairs = read_pairs(tmp_path / "out", "train")
    assert len(pairs) == 40 and all(p["target"].startswith("new") for p in pairs)


def test_valid_holdout_in_prepare(tmp_path):
    meta = prepare(data_config(tmp_path, f"data.source={ASSETS / 'tiny'}",
                               "data.splits={train: [train], test: [test]}", "data.valid_holdout=30"))
    assert meta["splits"]["valid"]["pairs"] == 30 == meta["held_out_as_valid"]
    assert meta["splits"]["train"]["pairs"] == meta["raw_pairs"]["train"] - 30
    assert meta["raw_pairs"]["valid"] == 30 and sum(meta["dropped"]["valid"].values()) == 0


# --- prepared output -------------------------------------------------------------------------

def test_splits_are_memory_mapped_and_consistent_with_jsonl(tiny_prepared):
    from summarizer.data.prepared import open_tokenizer

    meta, tokenizer = read_meta(tiny_prepared), open_tokenizer(tiny_prepared)
    for split, stats in meta["splits"].items():
        arrays, pairs = load_split(tiny_prepared, split), read_pairs(tiny_prepared, split)
        assert isinstance(arrays.src, np.memmap) and arrays.src.dtype == np.uint16 == arrays.tgt.dtype
        for tokens, offsets, side in ((arrays.src, arrays.src_offsets, "source"),
                                      (arrays.tgt, arrays.tgt_offsets, "target")):
            assert offsets.dtype == np.int64 and len(offsets) == len(pairs) + 1 == stats["pairs"] + 1
            assert offsets[0] == 0 and offsets[-1] == len(tokens) == stats[f"{side}_tokens"]
            assert np.all(np.diff(offsets) > 0) and np.diff(offsets).max() == stats[f"max_{side}_len"]
            assert all(tokenizer.decode(tokens[offsets[i]:offsets[i + 1]]) == p[side] for i, p in enumerate(pairs))
            assert not np.isin(tokens, [0, 2, 3]).any()  # no PAD/BOS/EOS stored


def test_test_split_unk_is_unified(tiny_prepared):
    raw = (ASSETS / "tiny/test.jsonl").read_text()
    prepared = (tiny_prepared / "test.jsonl").read_text()
    assert "UNK" in raw and "UNK" not in prepared and prepared.count("<unk>") == raw.count("UNK")


def test_meta_records_what_training_needs(tiny_prepared):
    meta = read_meta(tiny_prepared)
    assert meta["format_version"] == 1 and meta["dtype"] == "uint16"
    assert meta["special_ids"] == {"pad": 0, "unk": 1, "bos": 2, "eos": 3}
    assert meta["spm_sha256"] == hashlib.sha256((tiny_prepared / meta["spm_model"]).read_bytes()).hexdigest()
    assert meta["normalization"] == {"lowercase": False, "mask_digits": True, "words": "ptb"}
    assert meta["source"] == str(ASSETS / "tiny") and len(meta["fingerprint"]) == 64 and meta["seconds"] > 0
    assert meta["raw_pairs"] == {"train": 300, "valid": 40, "test": 40}
    for split, stats in meta["splits"].items():
        assert stats["pairs"] + sum(meta["dropped"][split].values()) == meta["raw_pairs"][split]
    assert meta["vocab_size"] <= meta["requested_vocab_size"]


def test_spm_training_is_reproducible(tiny_prepared, tmp_path):
    meta = prepare(data_config(tmp_path, f"data.source={ASSETS / 'tiny'}", "data.vocab_size=150",
                               "data.mask_digits=true"))
    assert meta["spm_sha256"] == read_meta(tiny_prepared)["spm_sha256"]


def test_a_train_split_above_spm_input_sentence_size_gets_the_same_vocabulary_in_every_process(tmp_path):
    """SentencePiece's own sampling of its input (680 sentences here, 200 asked for) drew other sentences in every
    process, seed or not: prep draws them itself."""
    import subprocess
    import sys

    models = []
    for run in ("a", "b"):
        subprocess.run([sys.executable, "-m", "data_prep", f"data.source={ASSETS / 'tiny'}",
                        f"data.dir={tmp_path / run}", "data.spm_input_sentence_size=200", "data.vocab_size=64",
                        "data.num_proc=1",
                        "data.valid_holdout=0"], check=True, capture_output=True, cwd=Path(__file__).parents[1])
        models.append((tmp_path / run / "spm.model").read_bytes())
    assert models[0] == models[1]


def test_the_vocabulary_does_not_depend_on_the_processes_prep_uses(tmp_path):
    """SentencePiece's unigram training sums its statistics per thread: its pieces change with the thread count
    (four counts, four vocabularies on the Gigaword sample), so it runs on a fixed count, not data.num_proc."""
    shas = {n: prepare(data_config(tmp_path / str(n), f"data.source={ASSETS / 'tiny'}", "data.vocab_size=150",
                                   f"data.num_proc={n}"))["spm_sha256"] for n in (1, 3)}
    assert shas[1] == shas[3]


def test_small_data_falls_back_to_the_vocab_it_supports(tmp_path):
    meta = prepare(data_config(tmp_path, f"data.source={ASSETS / 'rush'}", "data.vocab_size=5000"))
    assert meta["requested_vocab_size"] == 5000 and 8 < meta["vocab_size"] < 5000


def test_second_run_does_nothing(tmp_path, capsys):
    args = [f"data.source={ASSETS / 'rush'}", f"data.dir={tmp_path}", "data.vocab_size=64", "data.num_proc=1",
            "data.valid_holdout=0"]
    assert main(args) == 0
    assert "prepared" in capsys.readouterr().out
    mtimes = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.is_file()}
    assert main(args) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.is_file()} == mtimes
    changed = args[:-3] + ["data.vocab_size=60", "data.num_proc=1", "data.valid_holdout=0"]
    assert main(changed) == 2  # a changed key rebuilds only when asked: runs may depend on the tokenizer
    assert "vocab_size 64 -> 60" in capsys.readouterr().err and read_meta(tmp_path)["requested_vocab_size"] == 64
    assert main([*changed, "data.rebuild=true"]) == 0
    assert read_meta(tmp_path)["requested_vocab_size"] == 60


def test_rebuild_removes_splits_no_longer_produced(tmp_path):
    prepare(data_config(tmp_path, f"data.source={ASSETS / 'rush'}"))
    assert (tmp_path / "valid.src.npy").exists()
    prepare(data_config(tmp_path, f"data.source={ASSETS / 'rush'}", "data.splits={train: [train]}",
                        "data.rebuild=true"))
    assert set(read_meta(tmp_path)["splits"]) == {"train"}
    assert not any((tmp_path / f).exists() for f in split_files("valid").values())


def test_failed_rebuild_keeps_the_previous_data(tmp_path):
    meta = prepare(data_config(tmp_path, f"data.source={ASSETS / 'rush'}"))
    with pytest.raises(DataError, match="malformed"):
        prepare(data_config(tmp_path, f"data.source={{train: [{ASSETS / 'bad/malformed.jsonl'}]}}",
                            "data.rebuild=true"))
    assert read_meta(tmp_path) == meta and len(load_split(tmp_path, "train").src_offsets) == 7


@pytest.mark.parametrize("meta", ["{not json", '{"vocab_size": 8000, "source": "my corpus"}'])
def test_prep_never_replaces_a_users_dir_that_holds_a_meta_json(tmp_path, capsys, meta):
    """A meta.json does not make a dir the product's (only its .summarizer marker does): an unparseable one was
    replaced with the user's train/valid.jsonl beside it, and a valid one led to data.rebuild=true, the same loss."""
    mine = tmp_path / "mine"
    mine.mkdir()
    files = {"meta.json": meta, "train.jsonl": '{"source": "a", "target": "b"}\n', "valid.jsonl": "mine\n"}
    for name, text in files.items():
        (mine / name).write_text(text)
    for rebuild in ("false", "true"):
        assert main([f"data.source={ASSETS / 'rush'}", f"data.dir={mine}", "data.vocab_size=64",
                     "data.num_proc=1", "data.valid_holdout=0", f"data.rebuild={rebuild}"]) == 2
        err = capsys.readouterr().err
        assert f"data.dir={mine} already holds files this product did not write (meta.json, train.jsonl, " \
               f"valid.jsonl)" in err and "Choose a new or empty directory for data.dir" in err
        assert "data.rebuild" not in err
        assert {p.name: p.read_text() for p in mine.iterdir()} == files  # no marker either


def test_reading_an_unprepared_dir_says_how_to_prepare(tmp_path):
    with pytest.raises(DataError, match="make prep"):
        read_meta(tmp_path / "nowhere")
    with pytest.raises(DataError, match="make prep"):
        load_split(tmp_path, "train")


def test_atomic_open_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out.npy"
    with pytest.raises(RuntimeError):
        with atomic_open(target) as f:
            f.write(b"half")
            raise RuntimeError("crash")
    assert list(tmp_path.iterdir()) == []


# --- bad inputs ------------------------------------------------------------------------------

@pytest.mark.parametrize("source, pattern", [
    ("{missing}", r"does not exist"),
    ("{{train: [{bad}/malformed.jsonl]}}", r"malformed\.jsonl:3: malformed JSON"),
    ("{{train: [{bad}/mismatch.article.txt]}}", r"mismatch\.article\.txt has 4 lines but .*mismatch\.title\.txt has 3"),
    ("{{train: [{bad}/empty.jsonl]}}", r"empty\.jsonl is empty"),
    ("{{train: [{bad}/missing_field.jsonl]}}", r"no field 'source'.*data\.source_field"),
])
def test_bad_inputs_raise_clear_data_errors(tmp_path, source, pattern):
    source = source.format(missing=tmp_path / "no_such_dir", bad=ASSETS / "bad")
    with pytest.raises(DataError, match=pattern):
        prepare(data_config(tmp_path / "prep", f"data.source={source}"))
    assert not (tmp_path / "prep" / "meta.json").exists()


def test_a_bad_line_of_a_gzip_file_without_the_gz_ending_is_named(tmp_path):
    """datasets reads a gzip file by its first bytes, whatever its name: the bad line was sought in the compressed
    bytes, and reported as line 1."""
    (tmp_path / "train.jsonl").write_bytes(gzip.compress(b'{"source": "a b", "target": "a"}\n' * 2 + b"{not json\n"))
    with pytest.raises(DataError, match="train.jsonl:3: malformed JSON"):
        _load(tmp_path, f"data.source={tmp_path}")


@pytest.mark.parametrize("name, content", [("blank.jsonl", b"\n  \n\n"), ("nothing.jsonl.gz", gzip.compress(b""))])
def test_a_split_file_without_rows_is_named_so(tmp_path, name, content):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match=rf"{re.escape(name)} holds no rows: remove it or fill it with pairs"):
        prepare(data_config(tmp_path / "prep", f"data.source={{train: [{tmp_path / name}]}}"))


@pytest.mark.parametrize("bad, line", [({"source": ["a", "b"], "target": "t"}, 3),
                                       ({"source": "s", "target": 12345}, 3), ({"source": "s", "target": 7}, 1)])
def test_a_field_that_is_not_text_is_refused_naming_its_line(tmp_path, bad, line):
    """Cast to text, a list became its JSON ("-lsb- `` a '' ..."), a number its digits; and one number before the
    texts turned every text of its column into JSON, quotes and all."""
    records = [{"source": "a storm cut power", "target": "storm cuts power"}] * 2
    records.insert(line - 1, bad)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    field = next(k for k, v in bad.items() if not isinstance(v, str))
    shown = re.escape(json.dumps(bad[field]))
    with pytest.raises(DataError, match=f"train.jsonl:{line}: field '{field}' holds {shown}, not text"):
        _load(tmp_path, f"data.source={tmp_path}")


@pytest.mark.parametrize("late, error", [({"id": 7, "note": None}, None),
                                         ({"id": "x7"}, r"train.jsonl:11002: field 'id' holds \"x7\", line 1 1: give")])
def test_a_field_first_met_after_a_jsonl_files_first_10_mb_is_read_and_one_of_two_kinds_named(tmp_path, late, error):
    """datasets' json builder types a file by its first 10 MB (its chunk) and failed at a field first met after
    them, or one holding another kind of value there, saying only "column names don't match"."""
    text = "the council voted on the budget of the city " * 24  # ~1 KB a line: 11,000 lines pass 10 MB
    records = [{"source": text, "target": "council votes budget", **({"id": 1} if error else {})}] * 11_001
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records + [
        {"source": text, "target": "council votes again", **late}]))
    if error:
        with pytest.raises(DataError, match=error):
            _load(tmp_path, f"data.source={tmp_path}")
        return
    splits, _ = _load(tmp_path, f"data.source={tmp_path}", "data.valid_holdout=0")
    assert len(splits["train"]) == 11_002 and splits["train"]["target"][-1] == "council votes again"


def test_a_file_with_lines_that_are_not_utf8_is_named_with_their_count_and_first_line(tmp_path, capsys):
    """Undecodable bytes read as U+FFFD and cleaning drops those pairs: for a Latin-1 file, every pair with an
    accent, counted only among the drops unless the file is named."""
    rows = [{"source": f"the {w} of the city council met on day {i}", "target": f"{w} meets"}
            for i, w in enumerate(["mayor", "café owner", "board", "résumé writer"] * 10)]
    (tmp_path / "train.jsonl").write_bytes("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
                                          .encode("latin-1"))
    (tmp_path / "valid.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    cfg = data_config(tmp_path / "prep", f"data.source={tmp_path}")
    _, _, inputs = load_splits(cfg, tmp_path / "cache")
    out = capsys.readouterr().out
    assert f"note: {tmp_path / 'train.jsonl'}: 20 line(s) are not UTF-8 (the first: line 2)" in out
    assert "iconv -f LATIN1 -t UTF-8 train.jsonl > NEW" in out and "valid.jsonl:" not in out
    assert [i.get("not_utf8_lines") for i in inputs] == [20, None]


def test_csv_headlines_that_read_as_missing_values_are_kept_as_text(tmp_path):
    """pandas reads "NA", "null", "None" and "nan" as missing: as headlines they are words."""
    source = tmp_path / "src"
    source.mkdir()
    rows = [f"the council voted on item {i} of the budget today .,{word}" for i, word in
            enumerate(["NA", "null", "None", "nan", "budget vote"] * 8)]
    (source / "train.csv").write_text("source,target\n" + "\n".join(rows) + "\n")
    splits, _ = _load(tmp_path, f"data.source={source}", "data.splits={train: [train]}", "data.valid_holdout=0")
    assert len(splits["train"]) == 40 and {"NA", "null", "None", "nan"} <= set(splits["train"]["target"])


def test_cleaning_counts_only_the_pairs_a_rule_changed():
    from data_prep.mix import FileSpec, apply_cleaning
    ds = datasets.Dataset.from_dict({"source": ["a", "b", "c"], "target": [None, None, "headline (AP)"]})
    _, changed = apply_cleaning(ds, FileSpec(path=Path("x.jsonl"), clean=("agency_suffix",)))
    assert changed == {"agency_suffix": 1}


def test_cli_prints_error_line_and_exits_2(tmp_path, capsys):
    code = main([f"data.source={tmp_path / 'no_such_dir'}", f"data.dir={tmp_path / 'prep'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "no_such_dir" in err and "Traceback" not in err


def test_cli_rejects_bad_config_keys(tmp_path, capsys):
    assert main(["data.sourse=x"]) == 2
    assert "data.source" in capsys.readouterr().err


def test_script_only_hub_repo_falls_back_to_the_parquet_conversion(tmp_path, monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append(kwargs.get("revision"))
        if kwargs.get("revision") is None:
            raise RuntimeError("Dataset scripts are no longer supported, but found gigaword.py")
        rows = {"document": ["the mayor opened a new park on monday ."], "summary": ["mayor opens park"]}
        return datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr("data_prep.hub.reach_hub", lambda name: None)  # as if online
    meta = prepare(data_config(tmp_path / "prep", "data.source=hf:Harvard/gigaword",
                               "data.source_field=document", "data.target_field=summary"))
    assert calls == [None, "refs/convert/parquet"] and meta["splits"]["train"]["pairs"] == 1


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_several_sources_with_their_own_reader_settings_in_one_prepared_dir(tmp_path):
    """A mapping entry may filter on a record's field, run named cleaning rules and tag its pairs; meta.json
    records each input's sha256, rows, what the filter kept and what each rule changed, and pairs per tag."""
    import hashlib

    from data_prep import prepare
    wire = _write_jsonl(tmp_path / "wire.jsonl", [
        {"source": "Standard Oil said it will form a unit .", "target": "STANDARD OIL <SRD> TO FORM UNIT",
         "prose": True},
        {"source": "Shr 18 cts vs 31 cts Net 1.2 mln", "target": "ACME <ACM> 4TH QTR NET", "prose": False},
        {"source": "Texas Commerce said it filed a plan .", "target": "TEXAS COMMERCE <TCB> FILES PLAN",
         "prose": True}])
    ag = _write_jsonl(tmp_path / "ag.jsonl", [
        {"source": "AP - A company won a grant to study peptides .", "target": "Company Wins Grant (AP)"},
        {"source": "SPACE.com - TORONTO, Canada -- A team set a launch date .",
         "target": "Team Sets Date (SPACE.com)"}])
    plain = _write_jsonl(tmp_path / "plain.jsonl",
                         [{"source": "the mayor opened a park .", "target": "mayor opens park"}])
    test = _write_jsonl(tmp_path / "test.jsonl", [{"source": "the mayor closed a road .", "target": "road closed"}])
    source = {"train": [str(plain),
                        {"path": str(wire), "filter": {"prose": True}, "clean": ["ticker_tags"], "tag": "wire"},
                        {"path": str(ag), "clean": ["agency_prefix", "agency_suffix"], "tag": "ag"}],
              "test": [str(test)]}
    cfg = data_config(tmp_path / "out", "data.splits={train: [train], test: [test]}", "data.vocab_size=60")
    cfg.source = source
    meta = prepare(cfg)
    pairs = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert [p["target"] for p in pairs] == ["mayor opens park", "STANDARD OIL TO FORM UNIT",
                                            "TEXAS COMMERCE FILES PLAN", "Company Wins Grant", "Team Sets Date"]
    assert pairs[3]["source"] == "A company won a grant to study peptides ."
    assert pairs[4]["source"] == "A team set a launch date ."
    assert [p.get("tag") for p in pairs] == [None, "wire", "wire", "ag", "ag"]
    assert meta["splits"]["train"]["pairs_by_tag"] == {"(untagged)": 1, "ag": 2, "wire": 2}
    assert "pairs_by_tag" not in meta["splits"]["test"]
    by_path = {(i["split"], i["path"].rsplit("/", 1)[-1]): i for i in meta["inputs"]}
    assert by_path[("train", "wire.jsonl")]["rows"] == 3 and by_path[("train", "wire.jsonl")]["kept_by_filter"] == 2
    assert by_path[("train", "wire.jsonl")]["cleaned"] == {"ticker_tags": 2}
    assert by_path[("train", "ag.jsonl")]["cleaned"] == {"agency_prefix": 2, "agency_suffix": 2}
    assert by_path[("train", "ag.jsonl")]["sha256"] == hashlib.sha256(ag.read_bytes()).hexdigest()
    assert prepare(cfg) is None  # nothing changed: nothing to do
    cfg.source, cfg.rebuild = {**source, "train": source["train"][:2]}, True  # reader settings count as inputs
    assert prepare(cfg)["splits"]["train"]["pairs"] == 3


@pytest.mark.parametrize("entry, message", [
    ({"path": "X", "clean": ["tickers"]}, "unknown cleaning rule"),
    ({"path": "X", "weight": 2}, "unknown entry key"),
    ({"clean": ["ticker_tags"]}, "mapping with 'path'"),
    ({"path": "X", "filter": ["prose"]}, "'filter' of X must map"),
    ({"path": "X", "tag": "a b"}, "must be a plain name")])
def test_bad_source_entries_are_refused_naming_the_fix(entry, message):
    from data_prep.mix import parse_entry
    with pytest.raises(ConfigError, match=message):
        parse_entry(entry, "train")


def test_a_filter_on_a_field_the_file_lacks_is_refused(tmp_path):
    from data_prep import prepare
    plain = _write_jsonl(tmp_path / "plain.jsonl", [{"source": "a b c", "target": "a b"}])
    cfg = data_config(tmp_path / "out", "data.splits={train: [train]}")
    cfg.source = {"train": [{"path": str(plain), "filter": {"prose": True}}]}
    with pytest.raises(DataError, match="no field 'prose' to filter on"):
        prepare(cfg)


def test_a_filter_that_keeps_nothing_is_refused_with_the_values_seen(tmp_path):
    """A value of another type (the string "true" for the boolean true) would drop a whole source silently."""
    from data_prep import prepare
    prose = _write_jsonl(tmp_path / "prose.jsonl", [{"source": "a b c", "target": "a b", "prose": True}])
    cfg = data_config(tmp_path / "out", "data.splits={train: [train]}")
    cfg.source = {"train": [{"path": str(prose), "filter": {"prose": "true"}}]}
    with pytest.raises(DataError, match="prose='true' .str. of .* keeps none of its 1 records; .* include True"):
        prepare(cfg)


def test_the_hub_path_reads_a_local_dataset_directory_without_a_network(tmp_path, monkeypatch):
    """`datasets.load_dataset` itself, on local files laid out as a hub repo (Gigaword's column names)."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # no hub reachable: a local path must not need one
    repo = tmp_path / "gigaword"
    repo.mkdir()
    _write_jsonl(repo / "train.jsonl", [{"document": f"the mayor opened park number {i} .", "summary": "park opens"}
                                        for i in range(6)])
    _write_jsonl(repo / "test.jsonl", [{"document": "rain fell on monday .", "summary": "rain falls"}])
    meta = prepare(data_config(tmp_path / "prep", f"data.source=hf:{repo}", "data.source_field=document",
                               "data.target_field=summary", "data.vocab_size=40"))
    assert meta["splits"]["train"]["pairs"] == 6 and meta["splits"]["test"]["pairs"] == 1


def test_without_a_network_the_hub_source_fails_in_seconds_saying_what_to_do(tmp_path, monkeypatch):
    import time
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # a port nothing listens on: refused at once
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",  # a CI machine's own settings: no probe is made, or
                "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):  # one is made to the proxy
        monkeypatch.delenv(var, raising=False)
    started = time.monotonic()
    with pytest.raises(DataError, match=r"cannot reach the Hugging Face hub \(127.0.0.1:9.*data.source=DIR.*smoke"):
        prepare(data_config(tmp_path / "prep", "data.source=hf:Harvard/gigaword"))
    assert time.monotonic() - started < 10
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline on purpose: no probe, datasets' cache decides
    from data_prep.hub import reach_hub
    reach_hub("Harvard/gigaword")


def test_behind_a_proxy_the_hub_probe_asks_the_proxy(monkeypatch):
    """Where only a proxy reaches out (HTTPS_PROXY), a direct connection to the hub fails though datasets would
    download through the proxy: the probe connects to the proxy instead, and names it when it does not answer."""
    import socket

    from data_prep.hub import reach_hub
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT", "NO_PROXY", "no_proxy", "https_proxy",
                "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    with socket.socket() as proxy:
        proxy.bind(("127.0.0.1", 0))
        proxy.listen()
        monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{proxy.getsockname()[1]}")
        reach_hub("Harvard/gigaword")  # the proxy answers: no error, whatever the hub's own reachability
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    with pytest.raises(DataError, match=r"hub \(127.0.0.1:9, through the proxy http://127.0.0.1:9: "):
        reach_hub("Harvard/gigaword")
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")  # every scheme's proxy, as requests reads it
    with pytest.raises(DataError, match=r"through the proxy http://127.0.0.1:9: "):
        reach_hub("Harvard/gigaword")


def test_if_missing_prepares_an_unprepared_dir_and_refuses_a_data_key_given_with_another_value(
        tmp_path, capsys, monkeypatch):
    """What `make train` and `make eval` run first: a missing data.dir is prepared, one prepared from these inputs
    and settings used as it is. A data key given on the command line with another value than the dir holds (another
    data.source, other cleaning) is refused as `make prep` refuses it, naming what differs, or rebuilt when asked.
    The config's own values are not asked for here: the dir is used as it is, with a note where its pieces or their
    cleaning differ (another config's data.source is the dir's own record: `make eval ARGS="data.dir=..."`)."""
    data = tmp_path / "data"
    args = ["--if-missing", f"data.dir={data}", f"data.source={ASSETS / 'rush'}", "data.vocab_size=64",
            "data.num_proc=1", "data.valid_holdout=0"]
    assert main(args) == 0
    assert "not prepared yet" in capsys.readouterr().out and (data / "meta.json").is_file()
    before = (data / "meta.json").read_text()
    assert main(args) == 0 and capsys.readouterr().out == "" and (data / "meta.json").read_text() == before
    for change, named in ((f"data.source={ASSETS / 'jsonl'}", f"data.source '{ASSETS / 'rush'}' -> "
                                                             f"'{ASSETS / 'jsonl'}'"),
                          ("data.max_source_words=3", "data.max_source_words 120 -> 3")):
        assert main([*args, change]) == 2
        err = capsys.readouterr().err
        assert named in err and "pass data.rebuild=true to replace it" in err
        assert (data / "meta.json").read_text() == before
    config = tmp_path / "other.yaml"
    config.write_text(f"data:\n  source: {ASSETS / 'jsonl'}\n  max_source_words: 3\n")
    assert main(["--config", str(config), "--if-missing", f"data.dir={data}", "data.vocab_size=64"]) == 0
    err = capsys.readouterr().err
    assert "data.max_source_words 120 -> 3" in err and "it is used as it is" in err
    assert "data.source" not in err and "an input" not in err  # its files are another source's
    assert (data / "meta.json").read_text() == before
    monkeypatch.setattr("data_prep.pipeline.PREP_VERSION", 2)
    assert main(args) == 0 and "(prep version 1 -> 2)" in capsys.readouterr().err
    assert (data / "meta.json").read_text() == before
    assert main([*args, "data.rebuild=true"]) == 0 and read_meta(data)["prep_version"] == 2
    before = (data / "meta.json").read_text()
    assert main([*args, "data.splits.train=[train]"]) == 2  # a dotted edit of a key is that key given
    err = capsys.readouterr().err
    assert "data.splits {" in err and "pass data.rebuild=true" in err and (data / "meta.json").read_text() == before


def test_if_missing_uses_a_dir_whose_inputs_are_gone_and_refuses_one_missing_a_file(tmp_path, capsys):
    """A prepared dir copied to a machine without its raw inputs trains as it is, unless the command names the
    inputs (data.source); one missing a file it needs is refused, not used to fail later."""
    raw, data = tmp_path / "raw", tmp_path / "data"
    shutil.copytree(ASSETS / "rush", raw)
    args = ["--if-missing", f"data.dir={data}", "data.vocab_size=64", "data.num_proc=1", "data.valid_holdout=0"]
    assert main([*args, f"data.source={raw}"]) == 0
    shutil.rmtree(raw)
    capsys.readouterr()
    assert main(args) == 0 and capsys.readouterr().err == ""
    assert main([*args, f"data.source={raw}"]) == 2 and "does not exist" in capsys.readouterr().err
    shutil.copytree(ASSETS / "rush", raw)
    (data / "spm.model").unlink()
    assert main([*args, f"data.source={raw}"]) == 2
    err = capsys.readouterr().err
    assert "spm.model is missing" in err and "data.rebuild=true" in err


def test_a_meta_json_without_a_prep_version_or_input_record_is_still_read(tmp_path, capsys):
    """Dirs prepared before meta.json recorded them: prep version 1, up to date by their fingerprint."""
    args = [f"data.dir={tmp_path}", f"data.source={ASSETS / 'rush'}", "data.vocab_size=64", "data.num_proc=1",
            "data.valid_holdout=0"]
    assert main(args) == 0
    meta = read_meta(tmp_path)
    del meta["prep_version"], meta["prepared_from"]
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert main(["--if-missing", *args]) == 0 and capsys.readouterr().out == ""
    assert main([*args, "data.max_source_words=3"]) == 2
    assert "(data.max_source_words 120 -> 3)" in capsys.readouterr().err


def test_an_input_with_another_modification_time_is_compared_by_its_contents(tmp_path, capsys):
    """`touch train.jsonl` made prep refuse a rebuild; a changed input is named."""
    import os
    source = tmp_path / "src"
    source.mkdir()
    train = source / "train.jsonl"
    train.write_text("".join(f'{{"source": "words number {i} here", "target": "n {i}"}}\n' for i in range(40)))
    args = [f"data.dir={tmp_path / 'out'}", f"data.source={source}", "data.splits={train: [train]}",
            "data.vocab_size=40", "data.num_proc=1", "data.valid_holdout=0"]
    assert main(args) == 0
    os.utime(train, ns=(train.stat().st_mtime_ns + 10**9,) * 2)
    capsys.readouterr()
    assert main(args) == 0 and "nothing to do" in capsys.readouterr().out
    with train.open("a") as fh:
        fh.write('{"source": "one more pair", "target": "more"}\n')
    assert main(args) == 2
    assert f"({train} changed (another sha256))" in capsys.readouterr().err


def test_source_tags_put_each_pairs_tag_piece_first_and_untagged_text_gets_the_asked_one(tmp_path):
    """data.source_tag: every tag is one piece, first in its pairs' sources; untagged splits, eval.pairs and
    `summarize` text get data.source_tag's; the word rules never offer a tag piece as a word."""
    import numpy as np

    from data_prep import prepare
    from summarizer.data.tokenizer import Tokenizer
    from summarizer.decode.lexicon import Lexicon
    days = ("monday", "tuesday", "sunday")
    wire = _write_jsonl(tmp_path / "wire.jsonl", [{"source": f"oil prices rose sharply on {day} .",
                                                   "target": "OIL PRICES RISE"} for day in days])
    news = _write_jsonl(tmp_path / "news.jsonl", [{"source": f"the mayor opened a new park on {day} .",
                                                   "target": "mayor opens park"} for day in days])
    untagged = _write_jsonl(tmp_path / "test.jsonl", [json.loads(line) for line in news.read_text().splitlines()])
    source = {"train": [{"path": str(news), "tag": "news"}, {"path": str(wire), "tag": "wire"}],
              "test": [str(untagged)]}
    cfg = data_config(tmp_path / "out", "data.splits={train: [train], test: [test]}", "data.vocab_size=60",
                      "data.valid_holdout=0", "data.source_tag=news")
    cfg.source = source
    meta = prepare(cfg)
    assert meta["normalization"]["source_tag"] == "news"
    tok = Tokenizer(tmp_path / "out" / "spm.model")
    news_id, wire_id = tok.tag_id("news"), tok.tag_id("wire")
    firsts = {}
    for split in ("train", "test"):
        src = np.load(tmp_path / "out" / f"{split}.src.npy")
        firsts[split] = src[np.load(tmp_path / "out" / f"{split}.src_offsets.npy")[:-1]].tolist()
    assert sorted(firsts["train"]) == sorted([news_id] * 3 + [wire_id] * 3)
    assert firsts["test"] == [news_id] * 3  # untagged: the asked-for tag
    ids = tok.encode_raw("the mayor opened a park", meta["normalization"])
    assert ids[0] == news_id and ids[1:] == tok.encode("the mayor opened a park")
    assert len(tok.pieces_raw("the mayor opened a park", meta["normalization"])) == len(ids)
    lexicon = Lexicon(tok, ["mayor", "park"])
    assert not lexicon.text[news_id] and not lexicon.starts_word[news_id]
    pieces, lengths, _ = lexicon.source_word_arrays([ids])
    assert news_id not in pieces and (lengths > 0).sum() == 5  # the tag is no piece of the source's 5 words
    cfg.source_tag, cfg.rebuild = "sport", True
    with pytest.raises(DataError, match=r"data.source_tag='sport' is not the tag of any data.source entry "
                                        r"\(tags: news, wire\)"):
        prepare(cfg)


def test_every_source_is_split_into_ptb_words_as_raw_input_is_at_inference(tmp_path):
    """data.word_tokenizer=ptb: raw text of any source is prepared as Gigaword's tokenized text is, and raw input
    at inference is normalised alike, so raw and tokenized input are the same to the model."""
    from data_prep import prepare
    from summarizer.data.tokenizer import Tokenizer
    raw = [{"source": f"The mayor's park (in Gilmer) opened on May {n}, \"finally\".", "target": f"Park opens, {n}"}
           for n in range(10, 16)]
    tokenized = [{"source": "the mayor 's park -lrb- in gilmer -rrb- opened on may ## , `` finally '' .",
                  "target": "park opens , ##"}]
    source = {"train": [str(_write_jsonl(tmp_path / "raw.jsonl", raw)),
                        str(_write_jsonl(tmp_path / "gw.jsonl", tokenized))]}
    cfg = data_config(tmp_path / "out", "data.splits={train: [train]}", "data.vocab_size=60", "data.lowercase=true",
                      "data.mask_digits=true", "data.word_tokenizer=ptb")
    cfg.source = source
    meta = prepare(cfg)
    assert meta["normalization"]["words"] == "ptb"
    assert {p["source"] for p in read_pairs(tmp_path / "out", "train")} == {tokenized[0]["source"]}  # one pair now
    assert meta["dropped"]["train"]["duplicate"] == 6
    tok = Tokenizer(tmp_path / "out" / "spm.model")
    assert tok.encode_raw(raw[0]["source"], meta["normalization"]) == tok.encode(tokenized[0]["source"])
    cfg.word_tokenizer = "none"
    with pytest.raises(DataError, match="data.word_tokenizer 'ptb' -> 'none'"):
        prepare(cfg)


def test_relative_source_paths_are_read_from_data_root(tmp_path):
    from data_prep import prepare
    (tmp_path / "root" / "sub").mkdir(parents=True)
    _write_jsonl(tmp_path / "root" / "sub" / "a.jsonl",
                 [{"source": "x y z", "target": "x"}, {"source": "q", "target": "q"}])
    cfg = data_config(tmp_path / "out", "data.splits={train: [train]}", f"data.root={tmp_path / 'root'}")
    cfg.source = {"train": [{"path": "sub/a.jsonl", "tag": "a"}]}
    assert prepare(cfg)["splits"]["train"]["pairs"] == 2
    cfg.root = str(tmp_path / "nowhere")
    with pytest.raises(DataError, match=r"data.root=.*nowhere is not a directory: set data.root=DIR"):
        prepare(cfg)


def test_the_valid_split_is_held_out_of_the_asked_for_tag_only(tmp_path):
    from data_prep import prepare
    own = [{"source": f"own pair number {i}", "target": f"own {i}"} for i in range(30)]
    other = [{"source": f"other pair number {i}", "target": f"other {i}"} for i in range(30)]
    cfg = data_config(tmp_path / "out", "data.splits={train: [train]}", "data.valid_holdout=10",
                      "data.source_tag=own")
    cfg.source = {"train": [{"path": str(_write_jsonl(tmp_path / "own.jsonl", own)), "tag": "own"},
                            {"path": str(_write_jsonl(tmp_path / "other.jsonl", other)), "tag": "other"}]}
    meta = prepare(cfg)
    assert meta["splits"]["valid"]["pairs"] == 10 and meta["splits"]["train"]["pairs"] == 50
    assert all(p["source"].startswith("own") for p in read_pairs(tmp_path / "out", "valid"))


def test_a_source_tag_no_entry_has_is_named_before_the_hold_out(tmp_path):
    """A typo said that data.valid_holdout would leave no train pairs."""
    from data_prep import prepare
    cfg = data_config(tmp_path / "out", "data.splits={train: [train]}", "data.valid_holdout=5",
                      "data.source_tag=gigaword")
    pairs = [{"source": f"pair number {i}", "target": f"n {i}"} for i in range(30)]
    cfg.source = {"train": [{"path": str(_write_jsonl(tmp_path / "gw.jsonl", pairs)), "tag": "gw"}]}
    with pytest.raises(DataError, match=r"data.source_tag='gigaword' is not the tag of any data.source entry "
                                        r"\(tags: gw\)"):
        prepare(cfg)


def test_unpaired_sentences_become_pairs_with_themselves_tagged_and_never_held_out(tmp_path):
    """An `unpaired` entry reads sentences (its `text` field) as pairs of each sentence with itself, under its
    tag; meta.json names its tags, the tokenizer gets the mask piece, and valid is held out of pairs only."""
    from data_prep import prepare
    from summarizer.data.tokenizer import Tokenizer
    from summarizer.decode.lexicon import Lexicon
    days = ("monday", "tuesday", "sunday", "friday")
    news = _write_jsonl(tmp_path / "news.jsonl", [{"source": f"the mayor opened a new park on {day} .",
                                                   "target": "mayor opens park"} for day in days])
    text = _write_jsonl(tmp_path / "text.jsonl", [{"id": str(i), "text": f"Oil prices rose on {day} ."}
                                                  for i, day in enumerate(days)])
    cfg = data_config(tmp_path / "out", "data.splits={train: [train]}", "data.vocab_size=60", "data.valid_holdout=2",
                      "data.source_tag=news", "data.lowercase=true")
    cfg.source = {"train": [{"path": str(news), "tag": "news"}, {"path": str(text), "unpaired": True, "tag": "text"}]}
    meta = prepare(cfg)
    assert meta["unpaired_tags"] == ["text"]
    assert meta["splits"]["train"]["pairs_by_tag"] == {"news": 2, "text": 4} and meta["splits"]["valid"]["pairs"] == 2
    pairs = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert {(p["source"], p["target"]) for p in pairs if p["tag"] == "text"} == {
        (f"oil prices rose on {day} .",) * 2 for day in days}
    valid = (tmp_path / "out" / "valid.jsonl").read_text().splitlines()
    assert all(json.loads(line)["tag"] == "news" for line in valid)
    tok = Tokenizer(tmp_path / "out" / "spm.model")
    assert tok.sp.id_to_piece(tok.mask_id()) == "<mask>"
    assert not Lexicon(tok, ["park"]).text[tok.mask_id()]  # never a word decoding could write
    headline_only = data_config(tmp_path / "plain", "data.splits={train: [train]}", "data.vocab_size=60")
    headline_only.source = {"train": [str(news)]}
    prepare(headline_only)
    with pytest.raises(DataError, match="prepared without unpaired sentences"):
        Tokenizer(tmp_path / "plain" / "spm.model").mask_id()
    cfg.source["train"][0]["tag"], cfg.rebuild = "text", True
    with pytest.raises(ConfigError, match="tag.s. text name both headline pairs and unpaired sentences"):
        prepare(cfg)


@pytest.mark.parametrize("split, entry, message", [
    ("train", {"path": "X", "unpaired": True}, "needs a tag"),
    ("valid", {"path": "X", "unpaired": True, "tag": "t"}, "must be a train entry"),
    ("train", {"path": "X", "unpaired": "yes", "tag": "t"}, "must be true or false"),
    ("train", {"path": "x.article.txt", "unpaired": True, "tag": "t"}, "Rush pair"),  # plain text: pairs already
    ("train", {"path": "x.article.txt", "filter": {"prose": True}}, "Rush pair")])
def test_unpaired_entries_are_tagged_train_entries(split, entry, message):
    from data_prep.mix import parse_entry
    with pytest.raises(ConfigError, match=message):
        parse_entry(entry, split)
