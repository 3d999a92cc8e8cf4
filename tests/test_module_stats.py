"""Per-module statistics: every parameter in a named group, the numbers right, and in a run's records."""
import json
import math

import torch

from summarizer import runtime
from summarizer.config.schema import Config, ModelConfig
from summarizer.model.transformer import Seq2Seq
from summarizer.train.loop import train_step
from summarizer.train.watch.module_stats import ModuleStats, activation_rms, group_of


def tiny_model() -> Seq2Seq:
    torch.manual_seed(0)
    return Seq2Seq(ModelConfig(d_model=16, n_heads=2, encoder_layers=2, decoder_layers=2, ffn_dim=32, dropout=0.0),
                   50)


def batch() -> dict:
    torch.manual_seed(1)
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 6))
    return {"src_ids": src, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:], "n_src": 21, "n_tgt": 15}


def test_every_parameter_has_a_named_group():
    groups = {group_of(name) for name, _ in tiny_model().named_parameters()}
    assert groups == {"embedding", "encoder.0", "encoder.1", "decoder.0", "decoder.1", "decoder.0.cross",
                      "decoder.1.cross", "copy", "final_norms"}


def test_a_model_split_across_devices_has_the_groups_of_one_on_a_single_device():
    from summarizer.runtime.placement import PlacedSeq2Seq
    model, cpu = tiny_model(), torch.device("cpu")
    expected = {group: len(params) for group, params in ModuleStats(model).groups.items()}
    placed = PlacedSeq2Seq(model, cpu, cpu)
    assert {group: len(params) for group, params in ModuleStats(placed).groups.items()} == expected


def test_gradient_update_and_weight_norms_are_those_of_the_step():
    model, cfg = tiny_model(), Config()
    cfg.train.clip_norm, cfg.train.precision = 0.0, "fp32"
    rt = runtime.setup(cfg.system, cfg.placement, "fp32")
    stats = ModuleStats(model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # the update is -lr * gradient, exactly
    out = train_step(model, optimizer, runtime.make_scaler(rt), [batch()], rt, cfg.train, stats)
    logged = out["modules"]
    for group in stats.groups:
        names = [n for n, _ in model.named_parameters() if group_of(n) == group]
        w_before = math.sqrt(sum(float(before[n].pow(2).sum()) for n in names))
        w_after = math.sqrt(sum(float(p.detach().pow(2).sum()) for n, p in model.named_parameters() if n in names))
        assert math.isclose(logged[f"weight_norm/{group}"], w_after, rel_tol=1e-5)
        assert math.isclose(logged[f"update_ratio/{group}"], 0.1 * logged[f"grad_norm/{group}"] / w_before,
                            rel_tol=1e-4)
    # The groups' gradient norms make up the global one the step clips by.
    total = math.sqrt(sum(logged[f"grad_norm/{g}"] ** 2 for g in stats.groups))
    assert math.isclose(total, float(out["grad_norm"]), rel_tol=1e-5)
    # Steps that are not logged read nothing.
    assert train_step(model, optimizer, runtime.make_scaler(rt), [batch()], rt, cfg.train)["modules"] == {}


def test_activation_rms_is_that_of_each_block_output():
    model, b = tiny_model().eval(), batch()
    with torch.no_grad(), activation_rms(model) as rms:
        model(b["src_ids"], b["tgt_in"])
    emb = [model.embedding(b["src_ids"]), model.embedding(b["tgt_in"])]  # the embedding serves both sides
    expected = math.sqrt(sum(float(e.pow(2).sum()) for e in emb) / sum(e.numel() for e in emb))
    assert math.isclose(rms["act_rms/embedding"], expected, rel_tol=1e-5)
    assert set(rms) == {"act_rms/embedding", "act_rms/encoder.0", "act_rms/encoder.1", "act_rms/decoder.0",
                        "act_rms/decoder.1"}
    assert not model.embedding._forward_hooks  # hooks removed
    with activation_rms(model, enabled=False) as off:
        model(b["src_ids"], b["tgt_in"])
    assert off == {}


def test_a_run_logs_them_to_metrics_and_tensorboard(trained_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tmp, _ = trained_run
    records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    valid = [r for r in records if r["split"] == "valid"]
    assert train and all(r["grad_norm/encoder.0"] > 0 and 0 < r["update_ratio/decoder.0.cross"] < 1
                         and r["weight_norm/copy"] > 0 for r in train)
    assert valid and all(r["act_rms/decoder.0"] > 0 for r in valid)
    events = EventAccumulator(str(next((tmp / "tb").glob("*/events.*")).parent)).Reload()
    assert {"train/grad_norm/embedding", "train/update_ratio/final_norms", "valid/act_rms/encoder.0",
            "train/mfu", "train/pad_flops_share"} <= set(events.Tags()["scalars"])
