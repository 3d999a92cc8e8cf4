
import pytest
import torch

from summarizer import runtime
from summarizer.config.schema import ModelConfig
from summarizer.model.transformer import Seq2Seq

FULL = {"activation": "gelu", "bias": True}  # the alternative the switches offer


def tiny_model(copy=True, vocab=50, **overrides):
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_heads=4, encoder_layers=2, decoder_layers=2, ffn_dim=64, dropout=0.0, copy=copy,
                      **overrides)
    return Seq2Seq(cfg, vocab).eval()


@pytest.mark.parametrize("copy", [False, True])
def test_shapes_tally_and_outputs_are_distributions(copy):
    model = tiny_model(copy)
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 5))
    memory = model.encode(src)
    assert memory.shape == (3, 7, 32)
    kv = model.start_decoding(memory, src, group=4).memory_kv  # per sentence, not per beam
    assert len(kv) == 2 and kv[0][0].shape == (3, 4, 7, 8)  # (B, H, S, D/H)
    out = model(src, tgt)
    assert out.logits.shape == (3, 5, 50)
    if copy:
        assert out.copy_attn.shape == (3, 5, 7) and out.gate.shape == (3, 5, 1)
    log_probs = model.decode(tgt, memory, src)
    assert log_probs.shape == (3, 5, 50) and log_probs.dtype == torch.float32
    assert torch.allclose(log_probs.exp().sum(-1), torch.ones(3, 5), atol=1e-5)


@pytest.mark.parametrize("copy", [False, True])
@pytest.mark.parametrize("variant", [{}, FULL])
def test_padding_does_not_change_real_positions(copy, variant):
    model = tiny_model(copy, **variant)
    src, tgt = torch.randint(4, 50, (2, 6)), torch.randint(4, 50, (2, 4))
    padded_src = torch.cat([src, torch.zeros(2, 5, dtype=torch.long)], dim=1)
    padded_tgt = torch.cat([tgt, torch.zeros(2, 3, dtype=torch.long)], dim=1)
    full = lambda s, t: model.decode(t, model.encode(s), s)  # noqa: E731
    ref = full(src, tgt)
    assert torch.allclose(full(padded_src, tgt), ref, atol=1e-5)
    assert torch.allclose(full(padded_src, padded_tgt)[:, :4], ref, atol=1e-5)


def test_decoder_is_causal():
    model = tiny_model()
    src, tgt = torch.randint(4, 50, (1, 6)), torch.randint(4, 50, (1, 5))
    changed = tgt.clone()
    changed[0, 3] = (tgt[0, 3] + 1) % 46 + 4
    a, b = model(src, tgt).logits, model(src, changed).logits
    assert torch.allclose(a[:, :3], b[:, :3], atol=1e-6)
    assert not torch.allclose(a[:, 3:], b[:, 3:])


@pytest.mark.parametrize("copy", [False, True])
@pytest.mark.parametrize("variant", [{}, FULL])
def test_kv_cached_decoding_equals_full_recomputation(copy, variant):
    model = tiny_model(copy, **variant)
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 6))
    memory = model.encode(src)
    state = model.start_decoding(memory, src)
    full = model.decode(tgt, memory, src)
    steps = [model.decode(tgt[:, i:i + 1], memory, src, state) for i in range(6)]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)
    keys = state.self_kv[0][0]
    Seq2Seq.reorder(state, torch.tensor([2, 0, 0]))
    assert torch.equal(state.self_kv[0][0][0], keys[2]) and torch.equal(state.self_kv[0][0][1], keys[0])


@pytest.mark.parametrize("copy", [False, True])
def test_beams_sharing_one_memory_equal_beams_with_copies_of_it(copy):
    """A group of rows per sentence queries that sentence's memory once, as if each row had its own copy."""
    model = tiny_model(copy)
    src, tgt = torch.randint(4, 50, (2, 7)), torch.randint(4, 50, (6, 4))  # 3 beams per sentence
    src[1, 5:] = 0
    memory = model.encode(src)
    shared = model.decode(tgt, memory, src, model.start_decoding(memory, src, group=3))
    rows = torch.arange(2).repeat_interleave(3)
    copied = model.decode(tgt, memory[rows], src[rows])
    assert torch.allclose(shared, copied, atol=1e-5)


def test_copy_puts_mass_on_source_tokens():
    model = tiny_model(copy=True)
    with torch.no_grad():
        model.copy_gate.bias.fill_(-20.0)  # gate -> 0: everything comes from copy attention
    src = torch.tensor([[7, 9, 11, 0]])
    probs = model.decode(torch.tensor([[2, 7]]), model.encode(src), src).exp()
    assert torch.allclose(probs[0, :, [7, 9, 11]].sum(-1), torch.ones(2), atol=1e-4)


def test_log_space_copy_mixture_equals_the_probability_space_one():
    """Correcting only the source's ids in log space gives log(g p_vocab + (1 - g) copy), repeated ids and
    padding included, for rows grouped by sentence (beams)."""
    from summarizer.bench.decoding_v1 import _log_probs as in_probability_space
    from summarizer.model.transformer import DecoderOutput
    torch.manual_seed(0)
    src = torch.tensor([[7, 9, 7, 11, 0], [5, 5, 5, 6, 8]])  # ids repeated, one padded position
    r, t, s, v = 6, 3, 5, 20  # 3 rows per sentence
    attn = torch.rand(r, t, s).masked_fill(torch.tensor([0, 0, 0, 0, 1], dtype=torch.bool), 0.0)
    out = DecoderOutput(torch.randn(r, t, v) * 3, attn / attn.sum(-1, keepdim=True), torch.rand(r, t, 1))
    expected = in_probability_space(out, src.repeat_interleave(3, dim=0))
    assert torch.allclose(Seq2Seq.log_probs(out, src, group=3), expected, atol=1e-5)


@pytest.mark.parametrize("variant", [{}, FULL])
def test_gradients_reach_every_parameter(variant):
    model = tiny_model(**variant).train()
    src, tgt = torch.randint(4, 50, (2, 5)), torch.randint(4, 50, (2, 4))
    out = model(src, tgt)
    (out.logits.float().mean() + out.copy_attn.mean() + out.gate.mean()).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


def test_lean_variant_drops_every_bias_but_the_gate_and_uses_relu():
    names = {n for n, _ in tiny_model().named_parameters()}
    assert {n for n in names if n.endswith("bias")} == {"copy_gate.bias"}
    assert {n for n, _ in tiny_model(**FULL).named_parameters()} > names  # model.bias=true keeps them
    ffn = tiny_model().encoder_layers[0].ffn
    assert isinstance(ffn[1], torch.nn.ReLU) and isinstance(tiny_model(**FULL).encoder_layers[0].ffn[1], torch.nn.GELU)


@pytest.mark.parametrize("copy", [False, True])
def test_explicit_attention_computes_what_sdpa_does(copy):
    from summarizer.model.attention import explicit_attention
    model = tiny_model(copy)
    src, tgt = torch.randint(4, 50, (3, 9)), torch.randint(4, 50, (3, 6))
    src[0, 5:] = 0
    src[2, 2:] = 0
    tgt[1, 4:] = 0
    ref = model(src, tgt)
    with explicit_attention():
        out = model(src, tgt)
        memory = model.encode(src)
        state = model.start_decoding(memory, src)
        steps = [model.decode(tgt[:, i:i + 1], memory, src, state) for i in range(tgt.shape[1])]
    assert torch.allclose(out.logits, ref.logits, atol=1e-5)
    if copy:
        assert torch.allclose(out.copy_attn, ref.copy_attn, atol=1e-6)
    # incremental decoding through the explicit path equals the full SDPA pass
    assert torch.allclose(torch.cat(steps, dim=1), model.decode(tgt, model.encode(src), src), atol=1e-5)


def test_explicit_attention_survives_a_fully_masked_row():
    from summarizer.model.attention import attention_explicit
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    out = attention_explicit(q, k, v, torch.zeros(1, 1, 1, 5, dtype=torch.bool), False, 0.0)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("explicit", [False, True])
def test_torch_compile_sees_the_whole_model_as_one_graph_and_compiles_each_kind_of_layer_once(explicit):
    """The model traces whole without a graph break: the attention kernel's choice (a context, which torch.compile
    cannot read) is taken once at compile time (base.yaml's and gigaword.yaml's models used to compile as 13
    graphs). train.compile compiles its layers (regional compilation): one graph for every encoder layer, one for
    every decoder layer, and the compiled view computes what the model, left eager, does. Dropout on, as torch's
    kernel (the GPU's). Batches of another size and other lengths run the same compiled graphs: they are compiled
    with symbolic shapes from the first batch, not once for that batch's shape and again for the next, even where
    the first batch's sizes equal the model's (8 rows and a head size of 8, 32 positions and d_model 32, 4 target
    positions and 4 heads), which duck sizing would make one symbol, and the next batch a recompilation."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from summarizer.model.attention import explicit_attention
    torch.manual_seed(0)
    model = Seq2Seq(ModelConfig(d_model=32, n_heads=4, encoder_layers=2, decoder_layers=2, ffn_dim=64, dropout=0.1,
                                fast_dropout=False), 50)
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 5))
    with explicit_attention(explicit):
        assert torch._dynamo.explain(model.train())(src, tgt).graph_break_count == 0
        torch._dynamo.reset()
        counters.clear()
        model.eval()
        compiled = runtime.compile_model(model)
        for shape in ((8, 32, 4), (3, 7, 5), (5, 12, 8), (2, 9, 3)):
            src, tgt = torch.randint(4, 50, shape[:2]), torch.randint(4, 50, (shape[0], shape[2]))
            assert torch.allclose(compiled(src, tgt).logits, model(src, tgt).logits, atol=1e-5)
        assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
        assert runtime.unwrap(compiled) is model and not any(hasattr(m, "_orig_mod") for m in model.modules())
        assert compiled.state_dict().keys() != model.state_dict().keys()  # the view's own; checkpoints take model's
        assert set(compiled.parameters()) == set(model.parameters())
    torch._dynamo.reset()
