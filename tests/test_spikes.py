"""Loss spikes: detected against the recent window, rolled back exactly, and a run that keeps spiking stops."""
import json
from pathlib import Path

import pytest
import torch

import summarizer.train.loop as train_mod
from summarizer.__main__ import main
from summarizer.config.schema import TrainConfig
from summarizer.train.losses import smoothed_nll
from summarizer.train.watch.spikes import limit, remember, skipped, too_many

ROOT = Path(__file__).resolve().parent.parent


def test_a_steps_loss_summed_over_the_ranks_leaves_the_steps_own_sum_alone(monkeypatch):
    """The loop's window sums each rank's local nll_sum over the ranks after this: an all-reduce into a view of it
    would make the logged loss world_size times too large."""
    from summarizer.runtime import Runtime
    from summarizer.train.watch import spikes
    monkeypatch.setattr(spikes.runtime, "all_reduce_sum", lambda value, rt: value.mul_(2))  # two ranks alike
    out = {"nll_sum": torch.tensor(6.0), "tokens": 4}
    assert spikes.step_loss(out, Runtime(torch.device("cpu"), torch.device("cpu"), "fp32")) == 3.0
    assert out["nll_sum"].item() == 6.0


def test_the_limit_is_mean_plus_k_std_of_a_full_window():
    cfg = TrainConfig(spike_factor=2.0, spike_window=4)
    progress: dict = {}
    for loss in (1.0, 3.0, 1.0):
        remember(progress, loss, cfg)
        assert limit(progress, cfg) is None  # not enough steps seen yet
    remember(progress, 3.0, cfg)
    assert limit(progress, cfg) == pytest.approx(2.0 + 2.0 * 1.0)
    remember(progress, 5.0, cfg)
    assert progress["loss_window"] == [3.0, 1.0, 3.0, 5.0]  # the last spike_window losses


def test_rollbacks_are_counted_within_the_window_and_skipped_batches_gathered():
    cfg = TrainConfig(spike_window=10, spike_max_rollbacks=2, skip_batches=[[0, 3]])
    assert too_many([{"step": 5}], 20, cfg) == []
    assert too_many([{"step": 5}, {"step": 12}], 20, cfg) == []  # step 5 is outside the last 10 steps
    assert too_many([{"step": 15}, {"step": 18}], 20, cfg) == [15, 18]
    manifest = {"spike_rollbacks": [{"step": 9, "batches": [[1, 4], [1, 5]]}]}
    assert skipped(manifest, cfg) == {(0, 3), (1, 4), (1, 5)}


class InjectedSpike:
    """The loss (and so the gradient) of one batch of the data, recognised by its content, made 1000 times
    larger: the batch the `at_call`-th training loss sees, or every batch from then on (`every`)."""

    def __init__(self, at_call: int, every: bool = False):
        self.at_call, self.every, self.calls, self.key = at_call, every, 0, None

    def __call__(self, out, tgt_out, src_ids, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at_call:
            self.key = src_ids.numpy().tobytes()
        loss, nll = smoothed_nll(out, tgt_out, src_ids, *args, **kwargs)
        hit = self.every and self.key is not None or src_ids.numpy().tobytes() == self.key
        return (loss * 1000, nll * 1000) if hit else (loss, nll)


def train_args(tiny_prepared, tmp_path, name: str, *extra: str) -> list[str]:
    return ["train", "--config", str(ROOT / "configs/tiny.yaml"), f"data.dir={tiny_prepared}",
            f"run.dir={tmp_path / name}", f"run.tensorboard_dir={tmp_path / 'tb'}", "data.num_workers=0",
            "data.lowercase=false", "data.vocab_size=150", f"run.name={name}",
            "train.max_steps=24", "train.log_every=1", "train.ckpt_every=5", "train.keep_last=10",
            "train.eval_every=100", "train.rouge_every=0", "train.select_by=loss", "train.sample_summaries=0", *extra]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r["split"] == "train"}


@pytest.mark.slow
def test_a_spike_rolls_back_and_the_run_ends_as_one_that_never_saw_the_batch(tiny_prepared, tmp_path, monkeypatch,
                                                                            capsys):
    spike = InjectedSpike(at_call=12)  # the batch of step 12: after the checkpoint of step 10
    monkeypatch.setattr(train_mod, "smoothed_nll", spike)
    watched = ["train.spike_factor=8", "train.spike_window=5"]
    assert main(train_args(tiny_prepared, tmp_path, "a", *watched)) == 0
    assert "rolled back to step 10" in capsys.readouterr().err
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    [record] = manifest["spike_rollbacks"]
    assert record["step"] == 12 and record["rolled_back_to"] == 10 and record["loss"] > record["threshold"]
    # A run told from the start to leave that batch out trains on exactly what the rolled-back run did.
    spike.at_call = -1
    skip = f"train.skip_batches={json.dumps(record['batches'])}"
    assert main(train_args(tiny_prepared, tmp_path, "b", skip)) == 0
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(a) == list(range(1, 25)) and a == b
    weights = [torch.load(tmp_path / run / "ckpt_00000024.pt", weights_only=False)["model"] for run in "ab"]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    # A resumed run keeps its record (and so keeps skipping the batch).
    assert main(train_args(tiny_prepared, tmp_path, "a", *watched, "train.max_steps=26")) == 0
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["spike_rollbacks"] == [record]


@pytest.mark.slow
def test_spikes_that_keep_coming_stop_the_run(tiny_prepared, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train_mod, "smoothed_nll", InjectedSpike(at_call=12, every=True))
    args = train_args(tiny_prepared, tmp_path, "c", "train.spike_factor=8", "train.spike_window=5",
                      "train.spike_max_rollbacks=2")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "2 rollbacks within train.spike_window=5 steps" in err and "Traceback" not in err
    assert len(json.loads((tmp_path / "c" / "manifest.json").read_text())["spike_rollbacks"]) == 1
