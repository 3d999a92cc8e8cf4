import json
from pathlib import Path

import pytest
import torch

from summarizer.decode.inference import truncate_bytes
from summarizer.evaluation.scoring import rouge_report


@pytest.fixture
def trained_tiny(trained_run):
    return trained_run


def test_eval_writes_predictions_and_report(trained_tiny, capsys):
    from summarizer.__main__ import main
    tmp, args = trained_tiny
    assert main(["eval", *args, "eval.beam_size=2", f"eval.out_dir={tmp / 'eval'}"]) == 0
    predictions = (tmp / "eval" / "predictions.txt").read_text().splitlines()
    report = json.loads((tmp / "eval" / "rouge.json").read_text())
    assert len(predictions) == 40  # one line per test pair, in order
    for kind in ("rouge1", "rouge2", "rougeL"):
        assert set(report[kind]) == {"f", "p", "r", "f_ci"} and 0 <= report[kind]["f"] <= 100
    assert set(report["lead"]) == {"lead-8", "lead-10", "lead-12"}
    assert report["settings"]["beam_size"] == 2 and report["sentences_per_s"] > 0 and report["startup_s"] > 0
    # what the scores were measured against and what produced them, for compare, seeds and report to check
    from summarizer.data.prepared import read_pairs
    from summarizer.evaluation.scoring import pair_references, references_sha256
    from summarizer.outputs import code_version
    data_dir = next(a.split("=", 1)[1] for a in args if a.startswith("data.dir="))
    assert report["settings"]["data_dir"] == data_dir and report["settings"]["references_sha256"] == \
        references_sha256(pair_references(read_pairs(data_dir, "test")))
    assert {k: report["settings"][k] for k in ("git_commit", "git_dirty")} == code_version()


def test_summarize_reads_stdin_and_writes_one_line_each(trained_tiny, monkeypatch, capsys):
    import io

    from summarizer.__main__ import main
    _, args = trained_tiny
    text = "The Mayor of Springfield opened 3 parks on Monday.\n\nSecond line\n"
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    assert main(["summarize", *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[1] == "" and lines[0]


def test_missing_checkpoint_and_tokenizer_mismatch_are_clear(trained_tiny, capsys):
    from data_prep.__main__ import main as prep
    from summarizer.__main__ import main
    tmp, args = trained_tiny
    assert main(["eval", *args, f"eval.checkpoint={tmp / 'nope.pt'}"]) == 2
    assert "does not exist" in capsys.readouterr().err
    other = [f"data.dir={tmp / 'other'}", "data.vocab_size=120"]
    assert prep(args[:2] + other) == 0
    assert main(["eval", *args, *other]) == 2
    assert "tokenizer mismatch" in capsys.readouterr().err


def test_eval_builds_the_checkpoints_own_model_whatever_the_current_config(trained_tiny):
    from summarizer.__main__ import main
    tmp, args = trained_tiny
    assert main(["eval", *args, "model.d_model=48", "model.encoder_layers=1", "eval.limit=4",
                 f"eval.out_dir={tmp / 'other_config'}"]) == 0
    assert len((tmp / "other_config" / "predictions.txt").read_text().splitlines()) == 4


def test_eval_scores_a_pairs_file_of_raw_text_with_the_runs_normalisation(trained_tiny):
    """eval.pairs: raw (cased, digits unmasked) pairs, with several references and DUC's byte truncation."""
    import gzip

    from summarizer.__main__ import main
    tmp, args = trained_tiny
    pairs = [{"source": "The Government of FRANCE said Monday it would cut fuel taxes by 12 percent .",
              "target": "France to cut fuel taxes", "references": ["France to cut fuel taxes", "French tax cut"]},
             {"source": "Acme Corp shares fell 3.5 percent on Friday .", "target": "Acme shares fall"},
             {"source": "Fuel tax cuts are planned , France said .", "target": "French tax cut"}]
    path = tmp / "raw_pairs.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(p) + "\n" for p in pairs).encode()))
    assert main(["eval", *args, f"eval.pairs={path}", "eval.truncate_bytes=12", f"eval.out_dir={tmp / 'raw'}"]) == 0
    predictions = (tmp / "raw" / "predictions.txt").read_text().splitlines()
    report = json.loads((tmp / "raw" / "rouge.json").read_text())
    assert len(predictions) == 3 and all(len(p.encode()) <= 12 for p in predictions)
    assert report["settings"]["pairs_file"] == str(path) and report["settings"]["measure"].startswith("recall")
    assert "references pooled" in report["settings"]["aggregation"]  # recall pools them, as ROUGE-1.5.5 -f A
    assert report["rouge1"]["r_ci"] is not None and 0 <= report["rouge1"]["r"] <= 100
    for key in ("nonword_rate", "repeat_rate", "words_per_prediction", "words_per_reference"):
        assert key in report
    # lead-8 cut as the summaries are, to whole words ("Fuel tax"), not mid-word ("Fuel tax cut" of "cuts")
    references = [p.get("references") or [p["target"]] for p in pairs]
    whole, cut = (rouge_report([truncate_bytes(" ".join(p["source"].split()[:8]), 12, whole_words=whole)
                                for p in pairs], references, 0, measure="r")["rouge1"]["r"] for whole in (True, False))
    assert report["lead"]["lead-8"]["rouge1"] == pytest.approx(whole) and whole != pytest.approx(cut)


@pytest.mark.parametrize("host_bf16", [False, True], ids=["fp32-host", "bf16-host"])
def test_int8_decoding_runs_in_fp32_on_either_kind_of_cpu(trained_tiny, monkeypatch, host_bf16):
    """Both kinds of CPU, whatever this one is: where eval.precision=auto picks bf16, an explicit
    eval.quantize=int8 decodes in fp32 (int8 layers take float32 activations) instead of failing. How close int8
    stays to float is tested on fixed weights (tests/test_decoding.py), not by ROUGE of a model trained in the run:
    on 40 pairs that moves with the machine by more than any bound worth setting."""
    from summarizer import runtime
    from summarizer.__main__ import main
    monkeypatch.setattr(runtime.device, "cpu_has_fast_bf16", lambda: host_bf16)
    tmp, args = trained_tiny
    reports = {}
    for quantize in ("none", "int8"):
        out = tmp / f"q_{quantize}_{host_bf16}"
        assert main(["eval", *args, f"eval.quantize={quantize}", f"eval.out_dir={out}"]) == 0
        reports[quantize] = json.loads((out / "rouge.json").read_text())
    assert reports["int8"]["settings"]["quantize"] == "int8" and reports["int8"]["settings"]["precision"] == "fp32"
    assert reports["none"]["settings"]["precision"] == ("bf16" if host_bf16 else "fp32")
    for quantize in ("none", "int8"):
        assert len((tmp / f"q_{quantize}_{host_bf16}" / "predictions.txt").read_text().splitlines()) == 40


def test_int8_beside_16_bit_decoding_is_refused_clearly(trained_tiny, capsys):
    from summarizer.__main__ import main
    tmp, args = trained_tiny
    assert main(["eval", *args, "eval.quantize=int8", "eval.precision=bf16", f"eval.out_dir={tmp / 'q_bad'}"]) == 2
    err = capsys.readouterr().err
    assert "eval.quantize=int8" in err and "eval.precision=bf16" in err and "Traceback" not in err


def test_summarize_streams_in_chunks_keeping_order_and_empty_lines(trained_tiny, monkeypatch, capsys):
    """In float32 (eval.quantize=none) a line's summary does not depend on the lines around it, so each line
    summarised alone must give the same line; int8 scales activations per batch, so there it may not."""
    import io

    from summarizer import summarize
    from summarizer.__main__ import main
    _, args = trained_tiny
    args = [*args, "eval.quantize=none"]
    monkeypatch.setattr(summarize, "CHUNK_LINES", 3)
    texts = [f"the {w} government said monday it would cut fuel taxes ." if w else "" for w in
             ["france", "", "japan", "kenya", "", "", "chile", "india"]]
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(("\n".join(texts) + "\n").encode())))
    assert main(["summarize", *args]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == len(texts) and [bool(x) for x in lines] == [bool(t) for t in texts]
    alone = []
    for text in texts:  # each line summarised on its own gives the same line: order is kept across chunks
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO((text + "\n").encode())))
        assert main(["summarize", *args]) == 0
        alone.append(capsys.readouterr().out.rstrip("\n"))
    assert lines == alone and "summarized 8 lines" in err


@pytest.mark.shared_data
@pytest.mark.skipif(not Path(__file__).resolve().parents[2].joinpath("shared", "data").is_dir(),
                    reason="../shared/data is not here")
def test_the_shared_dev_sets_read_as_pairs_files():
    """DUC-2003 (four references each) and the Gigaword test_dev sample, as eval.pairs reads them."""
    from summarizer.data.pairs import read_pairs_file
    data = Path(__file__).resolve().parents[2] / "shared" / "data"
    duc = read_pairs_file(data / "duc2003" / "valid.jsonl.gz")
    assert len(duc) == 585 and all(len(p["references"]) == 4 and p["target"] == p["references"][0] for p in duc)
    test_dev = read_pairs_file(data / "gigaword" / "test_dev.jsonl.gz")
    assert len(test_dev) == 2000 and all(p["references"] == [p["target"]] for p in test_dev)


def test_quantize_auto_is_int8_only_where_decoding_runs_on_the_cpu_in_fp32():
    from types import SimpleNamespace

    import torch

    from summarizer.decode.quantize import resolve_quantize
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    rt = lambda dev, dec, precision: SimpleNamespace(device=dev, decoder_device=dec, precision=precision)  # noqa: E731
    assert resolve_quantize("auto", rt(cpu, cpu, "fp32")) == "int8"
    assert resolve_quantize("auto", rt(cpu, cpu, "bf16")) == "none"  # eval.precision=bf16 asked for: 16-bit form
    assert resolve_quantize("auto", rt(cuda, cuda, "bf16")) == "none"
    assert resolve_quantize("auto", rt(cuda, cpu, "fp32")) == "none"  # encoder on a GPU: int8 is CPU only
    assert resolve_quantize("none", rt(cpu, cpu, "fp32")) == "none"
    assert resolve_quantize("int8", rt(cpu, cpu, "fp32")) == "int8"


def test_quantize_int8_returns_a_copy_and_leaves_its_argument_untouched():
    import torch

    from summarizer.config.schema import ModelConfig
    from summarizer.decode.quantize import Int8Linear, quantize_int8
    from summarizer.model.transformer import Seq2Seq
    model = Seq2Seq(ModelConfig(d_model=16, n_heads=2, encoder_layers=1, decoder_layers=1, ffn_dim=32), 40).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantized = quantize_int8(model, torch.device("cpu"))
    assert quantized is not model and model.vocab_projection is None and model.training
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert not any(isinstance(m, torch.nn.Linear) for m in quantized.modules())
    assert any(isinstance(m, Int8Linear) for m in quantized.modules())
    assert not any(isinstance(m, Int8Linear) for m in model.modules())


def test_int8_layers_compute_what_torchs_dynamic_quantization_does():
    """The same int8 numbers as torch.ao.quantization.quantize_dynamic (deprecated for torchao; the product does not
    use it) where this torch still has it: bitwise, on a model's outputs, and the same greedy and beam searches."""
    import copy
    import warnings

    import torch

    from summarizer.config.schema import ModelConfig
    from summarizer.decode.quantize import quantize_int8
    from summarizer.decode.search import beam_search, greedy
    from summarizer.model.transformer import Seq2Seq
    from tests.decoding_models import settings
    ao = getattr(getattr(torch, "ao", None), "quantization", None)
    if ao is None or not hasattr(ao, "quantize_dynamic"):
        pytest.skip("this torch has no torch.ao.quantization to compare with")
    torch.manual_seed(0)
    model = Seq2Seq(ModelConfig(d_model=32, n_heads=4, encoder_layers=2, decoder_layers=2, ffn_dim=64), 50).eval()
    with torch.no_grad():
        for p in model.parameters():  # weights far from the initialisation's, of every magnitude
            p.mul_(torch.empty_like(p).uniform_(0.2, 4.0))
    ours = quantize_int8(model, torch.device("cpu"))
    theirs = copy.deepcopy(model)
    vocab, d_model = theirs.embedding.weight.shape
    theirs.vocab_projection = torch.nn.Linear(d_model, vocab, bias=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs.vocab_projection.weight.copy_(theirs.embedding.weight)
        theirs = ao.quantize_dynamic(theirs, {torch.nn.Linear}, dtype=torch.qint8)
    src, tgt = torch.randint(4, 50, (6, 11)), torch.randint(4, 50, (6, 7))
    with torch.inference_mode():
        a, b = ours(src, tgt), theirs(src, tgt)
        assert torch.equal(a.logits, b.logits) and not torch.equal(a.logits, model(src, tgt).logits)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True) if torch.is_tensor(x))
        s = settings(max_len=10)
        assert greedy(ours, src, s) == greedy(theirs, src, s)
        assert beam_search(ours, src, settings(max_len=10, beam_size=3)) == \
            beam_search(theirs, src, settings(max_len=10, beam_size=3))


@pytest.mark.parametrize("failing", ["predictions.readable.txt", "predictions.txt", "rouge.json"])
def test_a_failed_eval_write_leaves_the_earlier_eval_whole(trained_tiny, monkeypatch, capsys, failing):
    """A full disk while writing any of eval's three files: the earlier eval's files stay as they were, all
    three (never new predictions beside an old report, nor an old report deleted), and the message names the
    file."""
    import builtins

    from summarizer import outputs
    from summarizer.__main__ import main
    tmp, args = trained_tiny
    out = tmp / f"consistent_{failing}"
    assert main(["eval", *args, "eval.beam_size=1", f"eval.out_dir={out}"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    class FullDisk:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, text):
            raise OSError(28, "No space left on device")

    def fake_open(path, *a, **k):
        fh = builtins.open(path, *a, **k)
        return FullDisk(fh) if Path(path).name.startswith(failing + ".") else fh
    monkeypatch.setattr(outputs, "open", fake_open, raising=False)
    assert main(["eval", *args, "eval.beam_size=2", f"eval.out_dir={out}"]) == 1
    err = capsys.readouterr().err
    assert "No space left on device" in err and str(out / failing) in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def _files(directory: Path) -> dict:
    return {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def test_eval_refuses_a_users_directory_holding_its_file_names(trained_tiny, tmp_path, capsys):
    """A rouge.json does not make a directory the product's (it once did: the user's two files were replaced)."""
    from summarizer.__main__ import main
    _, args = trained_tiny
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "predictions.txt").write_text("my summaries\n")
    (mine / "rouge.json").write_text('{"rouge1": 99}\n')
    before = _files(mine)
    assert main(["eval", *args, "eval.beam_size=1", "eval.limit=4", f"eval.out_dir={mine}"]) == 2
    err = capsys.readouterr().err
    assert f"eval.out_dir={mine} already holds files this product did not write (predictions.txt, rouge.json)" in err
    assert "Traceback" not in err and _files(mine) == before


def test_eval_writes_into_a_run_dir_only_when_it_evaluates_that_runs_checkpoint(trained_tiny, tmp_path, capsys):
    """The default (eval.out_dir empty: the run dir of the run's own best.pt) works; another run's dir is refused,
    so its predictions and rouge.json stay the ones of its own weights."""
    import shutil

    from summarizer.__main__ import main
    tmp, args = trained_tiny
    other = tmp_path / "other_run"
    shutil.copytree(tmp / "run", other, ignore=shutil.ignore_patterns("*.txt", "rouge.json", "*.lock"))
    as_other = [a for a in args if not a.startswith("run.dir=")] + [f"run.dir={other}", "eval.beam_size=1",
                                                                     "eval.limit=4"]
    assert main(["eval", *as_other]) == 0
    assert len((other / "predictions.txt").read_text().splitlines()) == 4
    before = _files(other)
    assert main(["eval", *args, "eval.beam_size=1", "eval.limit=4", f"eval.out_dir={other}"]) == 2
    err = capsys.readouterr().err
    assert f"eval.out_dir={other} is a run directory of this product, not a eval directory (an eval writes into " \
           f"a run's dir only when it evaluates that run's checkpoint, not {tmp / 'run' / 'best.pt'})" in err
    assert "Traceback" not in err and _files(other) == before


@pytest.mark.parametrize("host_bf16", [False, True], ids=["fp32-host", "bf16-host"])
def test_default_decoding_on_either_kind_of_cpu_is_fp32_with_int8_layers(trained_tiny, monkeypatch, host_bf16):
    """eval.precision=auto with eval.quantize=auto: int8 in fp32 on a CPU, also where bf16 is fast (int8 decodes
    the recipe faster there); an explicit precision or quantize is kept as asked."""
    from summarizer import runtime
    from summarizer.__main__ import main
    from summarizer.config.load import load_config
    from summarizer.decode.quantize import decoding_precision
    monkeypatch.setattr(runtime.device, "cpu_has_fast_bf16", lambda: host_bf16)
    assert decoding_precision(load_config(None, ["system.device=cpu"])) == "fp32"
    assert decoding_precision(load_config(None, ["system.device=cpu", "eval.precision=bf16"])) == "bf16"
    assert decoding_precision(load_config(None, ["system.device=cpu", "eval.quantize=none"])) == "auto"
    with monkeypatch.context() as gpu:  # the GPU branch, taken on any machine: fp32 (TF32), int8 or not
        gpu.setattr(runtime, "resolve_device", lambda name: torch.device("cuda"))
        assert decoding_precision(load_config(None)) == "fp32"
        assert decoding_precision(load_config(None, ["eval.quantize=none"])) == "fp32"
        assert decoding_precision(load_config(None, ["eval.precision=bf16", "eval.quantize=none"])) == "bf16"
    tmp, args = trained_tiny
    out = tmp / f"default_{host_bf16}"
    assert main(["eval", *args, f"eval.out_dir={out}"]) == 0
    settings = json.loads((out / "rouge.json").read_text())["settings"]
    assert (settings["precision"], settings["quantize"]) == ("fp32", "int8")
    assert (settings["shapes"], settings["batch_tokens"]) == ("dynamic", 16_384)


def test_on_a_gpu_a_few_sentences_are_decoded_before_the_clock_starts(monkeypatch):
    """A GPU's first decode pays one-off costs (cuBLAS handles, kernel modules) that are start-up; a CPU needs
    none. decode_all is recorded (the GPU branch runs on any machine)."""
    from summarizer.config.load import load_config
    from summarizer.evaluation import evaluate as ev
    from summarizer.runtime import Runtime
    decoded = []
    monkeypatch.setattr(ev, "decode_all", lambda model, ids, settings, rt, lexicon: decoded.append(len(ids)))
    cfg = load_config(None, [])
    ids = [[5, 6]] * 20
    ev.warm_up(None, ids, cfg, Runtime(torch.device("cpu"), torch.device("cpu"), "fp32"), None)
    assert decoded == []
    ev.warm_up(None, ids, cfg, Runtime(torch.device("cuda"), torch.device("cuda"), "fp32"), None)
    assert decoded == [8]


def test_lengths_past_the_checkpoints_own_position_table_are_refused_in_one_message(trained_tiny, capsys):
    """The current config's model.max_positions says nothing of a checkpoint's: eval, summarize and bench check
    eval.max_len and data.max_source_len against the positions of the model they restore."""
    import io

    from summarizer import runtime
    from summarizer.__main__ import main
    from summarizer.bench import decoding
    from summarizer.config.load import load_config
    from summarizer.errors import ConfigError
    from summarizer.model import checkpoint
    tmp, args = trained_tiny
    state = checkpoint.load(tmp / "run" / "best.pt")
    state["config"]["model"]["max_positions"] = 40  # the table is a buffer, not a weight: the state still loads
    short = tmp / "short_positions.pt"
    torch.save(state, short)
    fits = [f"eval.checkpoint={short}", "eval.max_len=38", "data.max_source_len=40", "eval.limit=2"]
    assert main(["eval", *args, *fits, f"eval.out_dir={tmp / 'short_ok'}"]) == 0
    too_long = {"eval.max_len=39": ("eval.max_len=39 needs 41 positions", "at most 38"),
                "data.max_source_len=41": ("data.max_source_len=41 needs 41 positions", "at most 40")}
    for override, (needs, fix) in too_long.items():
        words = ("known_words", "no_repeat_words")  # off: only the position table can refuse the lengths
        over = [*fits, override, *(f"eval.{w}=false" for w in words)]
        assert main(["eval", *args, *over, f"eval.out_dir={tmp / 'short'}"]) == 2
        err = capsys.readouterr().err
        assert needs in err and "has 40" in err and fix in err and "Traceback" not in err
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"The Mayor of Springfield opened 3 parks .\n")))
            assert main(["summarize", *args, *over]) == 2
        assert needs in capsys.readouterr().err
        cfg = load_config(args[1], [*args[2:], *over, f"bench.checkpoint={short}"])
        rt = runtime.setup(cfg.system, cfg.placement, "fp32")
        with pytest.raises(ConfigError, match=needs):
            decoding._model(cfg, rt)
        with pytest.raises(ConfigError, match=needs):
            decoding.file_row(cfg)
