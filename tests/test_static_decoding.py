"""The static-shape search (summarizer/decode/static.py) returns what the eager search returns, with every rule
on, in both attention kernels (in float32: int8 layers scale activations per batch, and a static batch keeps its
finished rows); its step keeps one shape; `eval.shapes` picks it where it should.
Its CUDA graph path is run by the GPU test at the end (skipped without a GPU)."""
import contextlib
import dataclasses
import threading
from types import SimpleNamespace

import pytest
import torch

from summarizer import runtime
from summarizer.config.schema import EvalConfig, PlacementConfig, SystemConfig
from summarizer.decode.search import beam_search, decode_all, greedy, static_shapes
from summarizer.decode.static import Replayed, static_search
from summarizer.model.attention import explicit_attention
from summarizer.model.transformer import Seq2Seq
from summarizer.runtime import Runtime
from tests.decoding_models import padded, ragged_sources, settings, sharp_model, word_rules_model


def eager(model, src, s: EvalConfig, lexicon=None):
    return (greedy if s.beam_size == 1 else beam_search)(model, src, s, lexicon)


@pytest.fixture(scope="module")
def model():
    return sharp_model()


@pytest.fixture(scope="module")
def sources():
    return ragged_sources(7)


@pytest.mark.parametrize("beam, n, min_len, max_len", [(1, 0, 1, 12), (1, 2, 3, 12), (4, 0, 1, 12), (4, 3, 2, 6),
                                                        (6, 2, 1, 12), (3, 0, 0, 3)])
@pytest.mark.parametrize("kernel", ["explicit", "sdpa"])
def test_static_search_equals_the_eager_one(model, sources, beam, n, min_len, max_len, kernel):
    s = settings(beam_size=beam, no_repeat_ngram=n, min_len=min_len, max_len=max_len)
    with explicit_attention(kernel == "explicit"):
        expected = eager(model, sources, s)
        assert static_search(model, sources, s) == expected


@pytest.mark.parametrize("beam", [1, 4])
def test_a_model_placed_on_two_devices_searches_with_static_shapes_as_eagerly(model, sources, beam):
    """`eval.shapes=static` beside a `placement` split: the placed model takes the fixed-size cache's capacity
    as the model does (it was refused with a TypeError)."""
    from summarizer.runtime.placement import PlacedSeq2Seq
    cpu = torch.device("cpu")
    s = settings(beam_size=beam, max_len=8)
    assert static_search(PlacedSeq2Seq(model, cpu, cpu), sources, s) == eager(model, sources, s)


@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("known, repeats, truncate", [(True, True, 0), (False, True, 0), (True, False, 0),
                                                      (True, True, 40)])
def test_static_search_equals_the_eager_one_with_word_rules(tiny_prepared, beam, known, repeats, truncate):
    tokenizer, _, lex, m = word_rules_model(tiny_prepared)
    src = padded(tokenizer, ["the government of france said monday it would cut fuel taxes .",
                             "zorblatt corp shares fell sharply on friday after a profit warning .", "rain ."])
    s = settings(beam_size=beam, max_len=16, min_len=2, no_repeat_ngram=3, known_words=known,
                 no_repeat_words=repeats, truncate_bytes=truncate)
    with explicit_attention():
        assert static_search(m, src, s, lex) == eager(m, src, s, lex)


def test_auto_shapes_are_static_for_greedy_on_a_gpu_and_dynamic_otherwise():
    """auto: static where a CUDA graph replays greedy's whole step (faster on an H100), dynamic for beam search,
    on a CPU and for a model split across devices (whose step is not captured: docs/results.md); a set value holds
    on every device. Each branch, without a GPU: Runtime only names the devices."""
    cpu, cuda, cuda1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    for encoder, decoder, beam, expected in ((cpu, cpu, 1, False), (cpu, cpu, 4, False), (cuda, cuda, 1, True),
                                             (cuda, cuda, 4, False), (cpu, cuda, 1, False), (cuda, cpu, 1, False),
                                             (cuda, cuda1, 1, False)):
        rt = Runtime(encoder, decoder, "fp32")
        assert static_shapes(EvalConfig(shapes="auto", beam_size=beam), rt) is expected, (encoder, decoder, beam)
        assert [static_shapes(EvalConfig(shapes=v, beam_size=beam), rt) for v in ("static", "dynamic")] == \
            [True, False]


def test_decode_all_with_static_shapes_returns_the_same_outputs(model):
    torch.manual_seed(2)
    sources = [torch.randint(4, 40, (int(n),)).tolist() for n in torch.randint(2, 12, (23,))]
    rt = runtime.setup(SystemConfig(device="cpu"), PlacementConfig(), "fp32")  # the model's device on a GPU machine too
    for beam in (1, 3):
        s = settings(beam_size=beam, batch_tokens=60)
        assert decode_all(model, sources, dataclasses.replace(s, shapes="static"), rt) == \
            decode_all(model, sources, dataclasses.replace(s, shapes="dynamic"), rt)


@pytest.mark.slow
def test_eval_with_static_shapes_writes_the_same_predictions(trained_run):
    """A trained model (summaries of many lengths: finished sentences stay in the static batch), every rule on,
    the test split end to end, greedy and beam 4, in float32 (int8 scales activations per batch: a batch that
    keeps finished rows has other scales)."""
    from summarizer.__main__ import main
    tmp, args = trained_run
    for beam in (1, 4):
        predictions = {}
        for mode in ("static", "dynamic"):
            out = tmp / f"static_{mode}_{beam}"
            assert main(["eval", *args, f"eval.out_dir={out}", f"eval.shapes={mode}", "eval.quantize=none",
                         f"eval.beam_size={beam}"]) == 0
            predictions[mode] = (out / "predictions.txt").read_text().splitlines()
        assert predictions["static"] == predictions["dynamic"]
        assert len({len(p.split()) for p in predictions["static"]}) > 2


@pytest.mark.parametrize("beam", [1, 3])
def test_a_static_step_reads_nothing_back_and_updates_its_tensors_in_place(tiny_prepared, beam):
    """What a CUDA graph needs of `GreedyStep` and `BeamStep`, checked on the CPU: no value read back to the host
    inside a step (every rule on), and the state it carries (cache, prefixes, scores, the rules' tensors, what it
    keeps for the host) in the same tensors, of the same shapes, every step."""
    from torch.profiler import profile

    from summarizer.decode.rules import Rules
    from summarizer.decode.static import BeamStep, GreedyStep
    tokenizer, _, lex, m = word_rules_model(tiny_prepared)
    src = padded(tokenizer, ["the government of france said monday it would cut fuel taxes .", "rain ."])
    s = settings(beam_size=beam, max_len=10, min_len=2, no_repeat_ngram=2, known_words=True, no_repeat_words=True,
                 truncate_bytes=40)
    state = m.start_decoding(m.encode(src), src, group=beam, capacity=s.max_len + 1)
    rules = Rules(src, beam, s, lex, capacity=s.max_len + 1)
    step = GreedyStep(m, state, rules, s.max_len + 1) if beam == 1 else BeamStep(m, state, rules, s.max_len + 1, beam)
    kept = ("tokens", "prefixes", "step") + (("scores", "parents", "ranked", "top_scores", "top_parents", "before",
                                               "cuts") if beam > 1 else ("ended_at", "cut"))
    words = ("pieces", "length", "node", "f1", "h1", "finished", "used", "column")

    def carried():
        tensors = [getattr(step, n) for n in kept] + [rules.owed, rules.min_len] + \
            [getattr(rules.words, n) for n in words] + [k for k, _ in state.self_kv]
        return [(t.data_ptr(), tuple(t.shape)) for t in tensors]

    before = carried()
    with explicit_attention(), profile() as prof:
        outputs = {step.run().data_ptr() for _ in range(s.max_len + 1)}
    assert carried() == before and len(outputs) == 1
    reads = {e.key for e in prof.key_averages()} & {"aten::_local_scalar_dense", "aten::item", "aten::nonzero"}
    assert not reads
    assert int(step.step) == s.max_len + 1 and int(rules.words.column) == s.max_len + 1


class FakeGraphs:
    """torch.cuda's graph capture as `Replayed.run` calls it, on a CPU: each call of a step is logged as a warm-up
    (on the side stream), a capture (the step's code run inside `runtime.graph_capture`), a replay or an eager call;
    `fail` captures raise as a failed capture does."""

    def __init__(self, monkeypatch):
        self.log, self.capturing, self.fail = [], False, 0
        fake = self

        class Graph:
            def replay(self):
                fake.log.append("replay")

        @contextlib.contextmanager
        def graph(_graph, _device):
            fake.capturing = True
            try:
                yield
            finally:
                fake.capturing = False
            if fake.fail:
                fake.fail -= 1
                raise RuntimeError("operation not permitted when stream is capturing")

        def on_side_stream(_device, run):
            fake.log.append("warm-up")
            return run()

        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(runtime, "graph_capture", graph)
        monkeypatch.setattr(torch.cuda, "device", lambda _device: contextlib.nullcontext())
        monkeypatch.setattr(runtime, "on_side_stream", on_side_stream)
        monkeypatch.setattr(Replayed, "ready", threading.local())  # no capture in this process yet
        monkeypatch.setattr(Replayed, "warned", False)

    def step(self) -> Replayed:
        fake = self

        class Step(Replayed):
            def _run(self):
                if fake.capturing:
                    fake.log.append("capture")
                elif not fake.log or fake.log[-1] != "warm-up":
                    fake.log.append("eager")
                return self.step

        state = SimpleNamespace(src_ids=torch.zeros(2, 3, dtype=torch.long), memory=torch.zeros(2, 3, 4),
                                self_kv=[(torch.zeros(2, 1, 5, 4), torch.zeros(2, 1, 5, 4))])
        step = Step(None, state, None, capacity=4)
        step.graphs = True  # as on a GPU
        return step

    def calls(self, step: Replayed, n: int) -> list[str]:
        self.log.clear()
        for _ in range(n):
            step.run()
        return list(self.log)


def test_a_thread_warms_up_before_its_first_capture_only_and_falls_back_to_it_when_a_capture_fails(monkeypatch,
                                                                                                capsys):
    fake = FakeGraphs(monkeypatch)
    assert fake.calls(fake.step(), 4) == ["warm-up", "warm-up", "capture", "replay", "replay"]
    assert fake.calls(fake.step(), 2) == ["capture", "replay", "replay"]  # the thread's next batches
    other = []
    thread = threading.Thread(target=lambda: other.extend(fake.calls(fake.step(), 3)))
    thread.start()
    thread.join()
    assert other == ["warm-up", "warm-up", "capture", "replay"]  # each thread sets up its own
    fake.fail = 1  # a capture without warm-up fails: the step warms up and is captured after it
    assert fake.calls(fake.step(), 4) == ["capture", "warm-up", "warm-up", "capture", "replay", "replay"]
    assert fake.calls(fake.step(), 1) == ["capture", "replay"]
    fake.fail = 2  # a capture after warm-up fails too: eager from there on, said once
    assert fake.calls(fake.step(), 4) == ["capture", "warm-up", "warm-up", "capture", "eager", "eager"]
    assert "a decoding step could not be captured as a CUDA graph" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("beam", [4, 1])
def test_cuda_graph_replay_equals_the_eager_search_on_a_gpu(model, sources, beam):
    """On a GPU the static search captures its whole step as a CUDA graph and replays it: after two eager steps
    in a thread's first search, at the first step in the next."""
    m, src = Seq2Seq(model.cfg, 40).cuda().eval(), sources.cuda()
    m.load_state_dict(model.state_dict())
    captured = []
    original = Replayed.run

    def spy(self):
        out = original(self)
        captured.append(self.graph is not None)
        return out

    s = settings(beam_size=beam, no_repeat_ngram=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Replayed, "run", spy)
        mp.setattr(Replayed, "ready", threading.local())  # as in a new process
        assert static_search(m, src, s) == eager(m, src, s)
        assert captured[:2] == [False, False] and all(captured[2:]) and len(captured) > 3
        captured.clear()
        assert static_search(m, src, s) == eager(m, src, s)
        assert all(captured) and len(captured) > 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("beam", [1, 4])
def test_a_captured_step_with_every_word_rule_equals_the_eager_search_on_a_gpu(tiny_prepared, beam):
    tokenizer, _, lex, m = word_rules_model(tiny_prepared)
    src = padded(tokenizer, ["the government of france said monday it would cut fuel taxes .",
                             "zorblatt corp shares fell sharply on friday after a profit warning .", "rain ."])
    s = settings(beam_size=beam, max_len=16, min_len=2, no_repeat_ngram=3, known_words=True, no_repeat_words=True,
                 truncate_bytes=40)
    m, src = m.cuda(), src.cuda()
    assert static_search(m, src, s, lex) == eager(m, src, s, lex)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("beam", [1, 4])
def test_decoding_threads_on_a_gpu_capture_one_at_a_time_and_decode_what_one_thread_does(model, sources, beam):
    """eval.threads=2 with static shapes on a GPU: the batches' searches run in two threads, each capturing its
    step (one capture at a time in the process, as torch requires), and decode what the dynamic search does."""
    m = Seq2Seq(model.cfg, 40).cuda().eval()
    m.load_state_dict(model.state_dict())
    rt = Runtime(torch.device("cuda"), torch.device("cuda"), "fp32")
    ids = [row[row != 0].tolist() for row in sources]  # lengths 9, 6, 9, 4, 9, 2, 9: three batches of 18 tokens
    s = settings(beam_size=beam, shapes="static", threads=2, batch_tokens=18 * beam)
    captured, original = [], Replayed.run

    def spy(self):
        out = original(self)
        captured.append((self, self.graph is not None))  # the step itself: a freed one's id() can come again
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Replayed, "run", spy)
        static = decode_all(m, ids, s, rt)
    assert static == decode_all(m, ids, dataclasses.replace(s, shapes="dynamic", threads=1), rt)
    steps = {step for step, _ in captured}
    assert len(steps) == 3 and {step for step, replayed in captured if replayed} == steps  # every batch captured
