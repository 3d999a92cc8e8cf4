import pytest
import torch
import torch.nn.functional as F

from summarizer.model.dropout import Dropout, dropout_multiplier


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multiplier_has_rate_p_and_the_inverted_scale(dtype):
    torch.manual_seed(0)
    m = dropout_multiplier(torch.Size([400, 500]), 0.1, dtype)
    assert m.dtype == dtype and m.shape == (400, 500)
    values = set(m.unique().float().tolist())
    assert values == {0.0, torch.tensor(1 / 0.9, dtype=dtype).item()}
    drop_rate = (m == 0).float().mean().item()
    assert abs(drop_rate - 0.1) < 0.003  # 200k draws: 4 standard deviations is 0.0027


def test_masks_follow_torch_seed_and_differ_between_calls():
    torch.manual_seed(3)
    a = dropout_multiplier(torch.Size([1000]), 0.3, torch.float32)
    b = dropout_multiplier(torch.Size([1000]), 0.3, torch.float32)
    torch.manual_seed(3)
    assert torch.equal(a, dropout_multiplier(torch.Size([1000]), 0.3, torch.float32))
    assert not torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_dropout_forward_and_backward_apply_one_mask(dtype):
    torch.manual_seed(0)
    # no zeros in x, so y != 0 marks the kept elements (some torch releases' bf16 randn returns exact zeros)
    x = (torch.rand(64, 33) + 0.5).to(dtype).requires_grad_()
    y = Dropout(0.25).train()(x)
    kept = y != 0
    scale = torch.tensor(1 / 0.75, dtype=dtype)
    assert torch.equal(y[kept], x.detach()[kept] * scale)
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(x.grad, torch.where(kept, g * scale, torch.zeros_like(g)))


def test_eval_zero_p_and_slow_path():
    x = torch.randn(8, 8)
    assert Dropout(0.5).eval()(x) is x
    assert Dropout(0.0).train()(x) is x
    torch.manual_seed(1)
    slow = Dropout(0.5, fast=False).train()(x)
    torch.manual_seed(1)
    assert torch.equal(slow, F.dropout(x, 0.5, training=True))
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        Dropout(1.0)


def test_under_torch_compile_it_is_torchs_dropout_in_one_graph():
    """numpy's generator cannot be traced: every fast dropout of a compiled layer broke its graph in two (and
    warned about the cached bit pattern); compiled, it is F.dropout, which the compiler fuses."""
    drop = Dropout(0.25).train()
    compiled = torch.compile(drop, backend="eager", fullgraph=True)  # fullgraph: a graph break is an error
    torch.manual_seed(0)
    y = compiled(torch.ones(64, 64))
    assert set(y.unique().tolist()) == {0.0, torch.tensor(4 / 3).item()} and 0.15 < (y == 0).float().mean() < 0.35
