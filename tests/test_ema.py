"""The weights' moving average: debiased from the first update, the same numbers as torch's AveragedModel with the
same update, no value read back from the device while training, and a count that survives a checkpoint."""
import itertools

import pytest
import torch
from torch.optim.swa_utils import AveragedModel

from summarizer.train.ema import MovingAverage, build_ema

D = 0.9


def _debiased(decay: float):
    """The update as AveragedModel's multi_avg_fn: what MovingAverage must equal, bit for bit."""
    @torch.no_grad()
    def update(averaged, current, num_averaged):
        t = int(num_averaged) + 1
        torch._foreach_lerp_(averaged, current, (1 - decay) / (1 - decay ** t))
    return update


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))


def _steps(model, n):
    for _ in range(n):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        yield model


def test_the_moving_average_is_debiased_from_the_first_step():
    """The t-th average is sum_i d**(t-i) (1 - d) w_i / (1 - d**t): nothing of what came before the first step,
    whose weights torch's own EMA keeps at d**t (for a fine-tuning, the pre-trained model)."""
    model = _model()
    ema, seen = MovingAverage(model, D), []
    for m in _steps(model, 5):
        seen.append(m[0].weight.detach().clone())
        ema.update_parameters(m)
    t = len(seen)
    expected = sum(D ** (t - i) * (1 - D) * w for i, w in enumerate(seen, start=1)) / (1 - D ** t)
    assert torch.allclose(ema.module[0].weight, expected, atol=1e-6)


def test_it_equals_averaged_model_with_the_same_update_bit_for_bit():
    model = _model()
    ours, torchs = MovingAverage(model, D), AveragedModel(model, multi_avg_fn=_debiased(D))
    for m in _steps(model, 7):
        ours.update_parameters(m)
        torchs.update_parameters(m)
        assert ours.state_dict().keys() == torchs.state_dict().keys()
        assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), torchs.state_dict().values(),
                                                     strict=True))


def test_an_update_reads_nothing_back_from_the_device(monkeypatch):
    """On a GPU every value read on the host waits for the device: AveragedModel's own update reads its count
    twice; this one reads none."""
    model = _model()
    ema, reference = MovingAverage(model, D), AveragedModel(model, multi_avg_fn=_debiased(D))

    def read(*args, **kwargs):
        raise AssertionError("a value was read back from a tensor")

    with monkeypatch.context() as m:
        for name in ("__bool__", "__int__", "__float__", "__index__", "item", "tolist"):
            m.setattr(torch.Tensor, name, read)
        for step in _steps(model, 3):
            ema.update_parameters(step)
        with pytest.raises(AssertionError, match="read back"):
            reference.update_parameters(model)
    assert int(ema.n_averaged) == ema.count == 3


def test_a_restored_average_goes_on_from_its_count(capsys):
    model = _model()
    a, steps = MovingAverage(model, D), _steps(model, 4)
    for m in itertools.islice(steps, 2):
        a.update_parameters(m)
    b = build_ema(model, D, {"ema": a.state_dict()}, max_steps=1000)
    assert b.count == 2
    for m in steps:
        a.update_parameters(m)
        b.update_parameters(m)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert build_ema(model, 0.0, None, 1000) is None
    build_ema(model, 0.999, None, max_steps=100)
    assert "averages the weights over about 1000 steps, but this run has 100" in capsys.readouterr().err


def test_an_update_walks_no_module_after_a_models_first_and_follows_replaced_tensors(monkeypatch):
    """The lists an update takes are built at a model's first update (walking the modules costs a GPU step more
    host time than the update's kernels). A parameter whose data is replaced (as Module.to does) and a buffer
    assigned anew are still followed, bit for bit as AveragedModel does; another model gets lists of its own."""
    model = _model()
    model.register_buffer("table", torch.zeros(2))
    ours, torchs = MovingAverage(model, D), AveragedModel(model, multi_avg_fn=_debiased(D))
    ours.update_parameters(model)
    torchs.update_parameters(model)

    def walk(*args, **kwargs):
        raise AssertionError("an update walked the modules")

    with monkeypatch.context() as m:
        for name in ("parameters", "named_parameters", "buffers", "named_buffers", "modules", "named_modules"):
            m.setattr(torch.nn.Module, name, walk)
        model[0].weight.data = model[0].weight.data + 1
        model.table = torch.ones(2)
        ours.update_parameters(model)
    torchs.update_parameters(model)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), torchs.state_dict().values(),
                                                 strict=True))
    assert torch.equal(ours.module.table, torch.ones(2))
    other = _model()
    other.register_buffer("table", torch.full((2,), 5.0))
    ours.update_parameters(other)
    assert torch.equal(ours.module.table, other.table)
