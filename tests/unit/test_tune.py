"""The tuners. The learning-rate range test: its rates reach the optimizer step by step, its
suggestion is Lightning's (numpy's gradient of the smoothed loss), its plot has the right axes.
The batch-size search: each trial runs the batch it names."""

import math

import numpy as np
import pytest
import torch

from ddptrain import Config
from ddptrain.config import ConfigError, LrFindConfig
from ddptrain.launch.failures import WorkerFailedError
from ddptrain.testing import run_threaded
from ddptrain.tune.lr_find import LRFinder, plot, rates, smoothed, suggest
from tests.unit.trainer.test_lightning_flags import Task

pytestmark = pytest.mark.timeout(120)


def test_the_suggestion_is_the_steepest_descent_of_the_smoothed_loss_as_numpy_computes_it():
    rng = np.random.default_rng(0)
    lrs = list(np.geomspace(1e-6, 1.0, 60))
    raw = list(2.0 - np.tanh(np.linspace(-3, 3, 60)) + rng.normal(0, 0.05, 60))
    curve = smoothed(raw)
    expected, average = [], 0.0
    for i, value in enumerate(raw):
        average = 0.98 * average + 0.02 * value
        expected.append(average / (1 - 0.98 ** (i + 1)))
    assert curve == pytest.approx(expected, rel=1e-12)
    index = int(np.argmin(np.gradient(np.array(curve[10:-1])))) + 10
    assert suggest(lrs, curve) == lrs[index]
    assert suggest(lrs[:11], curve[:11]) is None  # too few points once the first 10 are left out
    cliff = [1.0 - 0.01 * i for i in range(30)] + [-5.0]  # the last point falls most: it is left out
    assert suggest(lrs[:31], cliff) == lrs[10]
    lowest = int(np.argmin(np.array(curve[10:-1]))) + 10
    assert suggest(lrs, curve, "minimum") == lrs[lowest] / 10
    assert suggest(lrs[:31], cliff, "minimum") == lrs[29] / 10  # the cliff's last point is left out here too
    with_nan = curve[:30] + [math.nan] + curve[31:]
    assert math.isfinite(suggest(lrs, with_nan))
    for seed in range(40):  # random walks: the steepest point is sometimes an end of the range
        walk = list(np.cumsum(np.random.default_rng(seed).normal(0, 1, 16)))
        assert suggest(lrs[:16], walk) == lrs[int(np.argmin(np.gradient(np.array(walk[10:-1])))) + 10], seed


def test_the_plot_closes_its_figure(tmp_path):
    import matplotlib.pyplot as plt

    before = set(plt.get_fignums())
    plot([1e-3, 1e-2, 1e-1], [2.0, 1.0, 1.5], 1e-2, tmp_path / "lr.png")
    assert set(plt.get_fignums()) == before  # a sweep of many runs does not pile up open figures


class RateProbe(Task):
    """Records the rate of every step; its schedule halves the rate at every epoch end."""

    def configure_optimizers(self, model):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}

    def optimizer_step(self):
        self.rates = getattr(self, "rates", []) + [[g["lr"] for g in self.optimizer.param_groups]]
        super().optimizer_step()


def _range_test(rank, world_size, out, threshold, max_lr=10.0):
    finder = LRFinder(LrFindConfig(min_lr=1e-4, max_lr=max_lr, num_training=20, early_stop_threshold=threshold))
    config = Config.from_dict(
        {
            "data": {"global_batch_size": 24},
            "trainer": {"epochs": 5, "max_steps": 20, "log_every_steps": 1, "progress": False, "output_dir": str(out)},
        }
    )
    task = RateProbe(config, callbacks=[finder])
    final = task.fit()
    return task.rates, finder.losses, final


def test_every_step_trains_at_its_rate_of_the_range_despite_the_schedule(tmp_path):
    stepped, losses, final = run_threaded(_range_test, 2, tmp_path, None, timeout_s=100)[0]
    expected = rates(LrFindConfig(min_lr=1e-4, max_lr=10.0, num_training=20))
    assert [r[0] for r in stepped] == pytest.approx(expected, rel=1e-12)  # the epoch-end halving overridden too
    assert len(losses) == 20 and final["lr_find"]["steps"] == 20
    assert (tmp_path / "lr_find.json").exists() and (tmp_path / "lr_find.png").exists()


def test_the_range_test_stops_once_the_loss_diverges(tmp_path):
    stepped, losses, final = run_threaded(_range_test, 2, tmp_path, 1.5, 1e4, timeout_s=100)[0]
    curve = smoothed(losses)
    over = [not math.isfinite(v) or v > 1.5 * min(curve[: i + 1]) for i, v in enumerate(curve)]
    first_over = over.index(True)
    # the vote cast at that step's end rides in the next step's reduction: one more step, then every rank stops
    assert len(losses) == len(stepped) == first_over + 2 < 20 and final["stopped_early"]


def test_the_plot_is_loss_against_a_log_learning_rate_with_the_suggestion_marked(tmp_path):
    lrs, losses = [1e-4, 1e-3, 1e-2, 1e-1], [2.0, 1.5, 0.5, 3.0]
    figure = plot(lrs, losses, 1e-2, tmp_path / "lr.png")
    (axes,) = figure.axes
    assert axes.get_xscale() == "log" and axes.get_xlabel() == "learning rate"
    assert axes.get_ylabel() == "training loss (smoothed)"
    curve, marker = axes.get_lines()
    assert list(curve.get_xdata()) == lrs and list(marker.get_xdata()) == [1e-2] and list(marker.get_ydata()) == [0.5]
    assert (tmp_path / "lr.png").read_bytes()[:4] == b"\x89PNG"


def test_a_batch_size_trial_runs_the_per_rank_batch_it_names_as_a_fast_dev_run():
    from ddptrain.preflight import per_rank_batch_size
    from ddptrain.tune.batch_size import trial_config

    config = Config.from_dict({"dist": {"world_size": 3}, "trainer": {"grad_accum_steps": 2, "epochs": 7}})
    trial = trial_config(config, 16, steps=3)
    assert per_rank_batch_size(trial, 3) == 16 and trial.data.eval_batch_size == 16
    assert trial.data.global_batch_size == 16 * 3 * 2 and trial.trainer.fast_dev_run == 3
    assert trial.trainer.model_summary is False and trial.trainer.progress == "false"  # one line a trial


class Trials:
    """``search``'s ``run``: a trial's peak memory is ``mb_per_sample`` times its per-rank batch,
    or it fails as a rank out of memory does from ``fails_from`` on. Records what each trial ran."""

    def __init__(self, mb_per_sample, fails_from=None):
        self.mb_per_sample, self.fails_from, self.ran = mb_per_sample, fails_from, []

    def __call__(self, trial):
        per_rank = trial.data.eval_batch_size
        self.ran.append((per_rank, trial.trainer.fast_dev_run))
        if self.fails_from is not None and per_rank >= self.fails_from:
            raise WorkerFailedError(1, "rank 1 failed: CUDA out of memory\nTraceback (most recent call last): ...")
        return {"memory/peak_rss_mb": self.mb_per_sample * per_rank}


def _search(trials, max_memory_gb, device="cpu"):
    from ddptrain.tune.batch_size import search

    said = []
    config = Config.from_dict({"dist": {"world_size": 2}, "trainer": {"device": device}})
    return search(config, trials, max_memory_gb, max_trials=8, say=said.append), said


def test_the_batch_size_search_doubles_while_the_peak_is_within_the_limit():
    trials = Trials(mb_per_sample=128)  # per-rank 8 peaks at exactly 1 GiB: it fits
    fits, said = _search(trials, max_memory_gb=1)
    assert fits == 8 and trials.ran == [(1, 3), (2, 3), (4, 3), (8, 3), (16, 3)]  # three steps a trial
    assert said[3].startswith("  per-rank batch     8: peak 1024 MB (")
    assert said[4].startswith("  per-rank batch    16: peak 2048 MB > 1024 MB (")


def test_a_trial_that_fails_ends_the_search_and_says_the_first_line_of_why():
    fits, said = _search(Trials(mb_per_sample=1, fails_from=4), max_memory_gb=None, device="cuda")
    assert fits == 2 and said[-1].startswith("  per-rank batch     4: failed: rank 1 failed: CUDA out of memory (")
    assert _search(Trials(mb_per_sample=1, fails_from=1), max_memory_gb=None, device="cuda")[0] is None
    unlimited, said = _search(Trials(mb_per_sample=1), max_memory_gb=None, device="cuda")
    assert unlimited == 2**7 and len(said) == 8  # max_trials


def test_the_batch_size_search_on_cpu_refuses_to_run_without_a_limit():
    with pytest.raises(ConfigError, match="on CPU give a memory limit, --max-memory-gb G"):
        _search(Trials(mb_per_sample=1), max_memory_gb=None)
