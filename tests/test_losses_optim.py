import math

import pytest
import torch

from summarizer.config.schema import TrainConfig
from summarizer.model.transformer import DecoderOutput
from summarizer.train.losses import smoothed_nll
from summarizer.train.optim import build_optimizer, lr_factor


def test_nll_matches_cross_entropy_and_ignores_padding():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 10)
    target = torch.tensor([[5, 6, 3, 0], [1, 3, 0, 0]])
    loss, nll = smoothed_nll(DecoderOutput(logits, None, None), target, None, 0.0)
    ref = torch.nn.functional.cross_entropy(logits.view(-1, 10), target.view(-1), ignore_index=0, reduction="sum")
    assert torch.allclose(loss, ref) and torch.allclose(nll, ref)


def test_label_smoothing_matches_torch():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 12)
    target = torch.randint(1, 12, (3, 5))
    target[0, 3:] = 0
    loss, _ = smoothed_nll(DecoderOutput(logits, None, None), target, None, 0.1)
    ref = torch.nn.functional.cross_entropy(logits.view(-1, 12), target.view(-1), ignore_index=0,
                                            label_smoothing=0.1, reduction="sum")
    assert torch.allclose(loss, ref, atol=1e-5)


def test_copy_nll_equals_the_full_mixture_distribution():
    from summarizer.config.schema import ModelConfig
    from summarizer.model.transformer import Seq2Seq
    torch.manual_seed(0)
    model = Seq2Seq(ModelConfig(d_model=16, n_heads=2, encoder_layers=1, decoder_layers=1, ffn_dim=32,
                                dropout=0.0), 30)
    src, tgt_in = torch.randint(4, 30, (3, 6)), torch.randint(4, 30, (3, 4))
    src[0, 4:] = 0
    target = torch.cat([src[:, :3], torch.randint(4, 30, (3, 1))], dim=1)  # copyable and generated tokens
    target[2, 3] = 0
    out = model(src, tgt_in)
    full = model.log_probs(out, src)  # (B, T, V) mixture
    ref = -full.gather(-1, target.unsqueeze(-1)).squeeze(-1).masked_fill(target == 0, 0).sum()
    loss, nll = smoothed_nll(out, target, src, 0.0)
    assert torch.allclose(nll, ref, atol=1e-5) and torch.allclose(loss, ref, atol=1e-5)


@pytest.mark.parametrize("schedule", ["inverse_sqrt", "cosine", "linear", "constant"])
def test_schedules_warm_up_then_decay(schedule):
    cfg = TrainConfig(warmup_steps=10, max_steps=100, schedule=schedule)
    factors = [lr_factor(s, cfg) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(factors[:9], factors[1:10], strict=True))
    if schedule != "constant":
        assert factors[-1] < factors[10]
    if schedule == "inverse_sqrt":
        assert factors[39] == pytest.approx(math.sqrt(10 / 40))


def test_no_weight_decay_on_norms_biases_embedding():
    from summarizer.config.schema import ModelConfig
    from summarizer.model.transformer import Seq2Seq
    model = Seq2Seq(ModelConfig(d_model=16, n_heads=2, encoder_layers=1, decoder_layers=1, ffn_dim=32), 20)
    decay, no_decay = build_optimizer(model, TrainConfig(weight_decay=0.1)).param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"])
    assert any(p is model.embedding.weight for p in no_decay["params"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_vocab_stats_gradient_matches_autograd(dtype):
    from summarizer.train.losses import VocabStats
    torch.manual_seed(0)
    base = torch.randn(6, 11).to(dtype)
    target = torch.randint(0, 11, (6,))
    weights = torch.randn(3, 6)

    from summarizer.train.losses import vocab_stats_autograd

    def reference(x):
        return vocab_stats_autograd(x, target)

    grads, values = [], []
    for fn in (reference, lambda x: VocabStats.apply(x, target)):
        x = base.clone().requires_grad_()
        outs = fn(x)
        sum(w @ o for w, o in zip(weights, outs, strict=True)).backward()
        grads.append(x.grad.float())
        values.append(torch.stack(outs))
        assert x.grad.dtype == dtype and torch.equal(x.detach(), base)  # input untouched
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    assert torch.allclose(values[0], values[1], atol=1e-6)
    assert torch.allclose(grads[0], grads[1], atol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_vocab_stats_confident_target_gradient_is_not_lost_to_rounding(dtype):
    """Where the model is sure of the target (p ~ 1), its gradient g * (p - 1) is a small difference of two terms
    near g: formed in float32 and rounded once, it keeps its digits; rounded first (p to 16 bits), it is 0 or
    off by 2^-8 (fp16: 2^-11) of g, tens of times the answer."""
    from summarizer.train.losses import VocabStats
    logits = torch.full((4, 50), -4.0)
    target = torch.tensor([3, 7, 11, 49])
    logits[torch.arange(4), target] = torch.tensor([5.0, 6.0, 7.0, 8.0])
    x = logits.to(dtype).requires_grad_()
    lse, target_logit, _ = VocabStats.apply(x, target)
    (lse - target_logit).sum().backward()  # the plain NLL: its gradient is softmax - onehot
    exact = torch.softmax(logits.double(), -1) - torch.nn.functional.one_hot(target, 50).double()
    at_target = x.grad.double()[torch.arange(4), target]
    assert torch.allclose(at_target, exact[torch.arange(4), target], rtol=1e-2, atol=0)
    assert (at_target < 0).all() and (at_target > -0.01).all()


def test_vocab_stats_chunks_match_one_pass(monkeypatch):
    import summarizer.train.losses as losses
    torch.manual_seed(0)
    base, target = torch.randn(37, 13), torch.randint(0, 13, (37,))
    results = []
    for chunk in (1 << 20, 5 * 13):  # one chunk, then 5 rows per chunk (8 chunks, the last partial)
        monkeypatch.setattr(losses, "CHUNK_ELEMENTS", chunk)
        x = base.clone().requires_grad_()
        outs = losses.VocabStats.apply(x, target)
        sum(o.sum() * (i + 1) for i, o in enumerate(outs)).backward()
        results.append((torch.stack(outs), x.grad))
        assert torch.equal(x.detach(), base)  # float32 logits are not overwritten by the in-place backward
    assert torch.allclose(results[0][0], results[1][0], atol=1e-6)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-6)


def test_fused_adamw_is_used_and_matches_the_loop():
    from summarizer.config.schema import ModelConfig
    from summarizer.model.transformer import Seq2Seq
    params = {}
    for fused in (True, False):
        torch.manual_seed(0)
        model = Seq2Seq(ModelConfig(d_model=16, n_heads=2, encoder_layers=1, decoder_layers=1, ffn_dim=32), 20)
        opt = build_optimizer(model, TrainConfig(fused_optimizer=fused))
        assert opt.defaults["fused"] is (True if fused else None)
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            opt.step()
        params[fused] = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.allclose(params[True], params[False], atol=1e-6)
