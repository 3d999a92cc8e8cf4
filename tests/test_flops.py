"""The FLOP count from real lengths agrees with torch's own count of the matrix products."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from summarizer.config.schema import ModelConfig
from summarizer.model.attention import explicit_attention
from summarizer.model.transformer import Seq2Seq
from summarizer.train.watch.flops import batch_flops, forward_flops


@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize("b, s, t", [(2, 7, 5), (3, 12, 9), (1, 30, 4), (4, 5, 16)])
def test_forward_count_matches_flop_counter_mode(copy, b, s, t):
    cfg = ModelConfig(d_model=32, n_heads=4, encoder_layers=2, decoder_layers=3, ffn_dim=64, copy=copy, dropout=0.0)
    model = Seq2Seq(cfg, 50).eval()
    src, tgt = torch.randint(4, 50, (b, s)), torch.randint(4, 50, (b, t))
    with explicit_attention(), FlopCounterMode(display=False) as counter, torch.no_grad():
        model(src, tgt)
    measured = counter.get_total_flops()
    assert forward_flops(cfg, 50, [s] * b, [t] * b) == pytest.approx(measured, rel=0.01)


def test_padding_is_computed_but_is_not_model_work():
    cfg = ModelConfig(d_model=32, n_heads=4, encoder_layers=1, decoder_layers=1, ffn_dim=64)
    src = torch.tensor([[5, 6, 7, 8], [5, 6, 0, 0]])
    tgt = torch.tensor([[2, 5, 6], [2, 5, 0]])
    real, padded = batch_flops(cfg, 50, {"src_ids": src, "tgt_in": tgt})
    assert real == 3 * forward_flops(cfg, 50, [4, 2], [3, 2]) and padded == 3 * forward_flops(cfg, 50, [4, 4], [3, 3])
    assert 0 < real < padded
