"""What a fit reports (ddptrain/trainer/metrics.py): reductions over ranks, exact means without
the sampler's padding, the logging window, final metrics with the checksum, the smoke check."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddptrain import comm as dist
from ddptrain.config import DataConfig
from ddptrain.data import DistributedSampler
from ddptrain.testing import run_threaded
from ddptrain.trainer.metrics import (
    ExactMean,
    SmokeCheckError,
    SmokeProbe,
    TrainingMetrics,
    parameters_digest,
    reduce_sum,
    smoke_check,
)


def test_reduce_sum_over_three_ranks():
    def body(rank, world_size):
        return reduce_sum(dist.get_process_group(), [rank, 1.5, 10**rank])

    assert run_threaded(body, 3, timeout_s=60) == [[3.0, 4.5, 111.0]] * 3


def test_exact_mean_leaves_the_padding_out():
    # 10 samples on 3 ranks: 4 positions each, the last two of ranks 1 and 2 repeat samples 0 and 1.
    def body(rank, world_size):
        sampler = DistributedSampler(10, world_size, rank, shuffle=False)
        mean = ExactMean(sampler.padding_mask())
        indices = torch.tensor(sampler.epoch_indices(), dtype=torch.float64)
        for batch in indices.split(3):  # batches of 3 then 1: positions must carry over
            mean.add({"index": batch, "square": batch**2}, len(batch))
        return mean.reduce(dist.get_process_group())

    results = run_threaded(body, 3, timeout_s=60)
    assert results == [results[0]] * 3
    assert results[0] == {"eval/index": 4.5, "eval/square": 28.5, "eval/samples": 10}  # not (45 + 0 + 1) / 12


def test_exact_mean_wants_one_value_per_sample():
    with pytest.raises(ValueError, match=r"2 value\(s\) for metric 'loss' on a batch of 3.*reduction='none'"):
        ExactMean(torch.zeros(3, dtype=torch.bool)).add({"loss": torch.ones(2)}, 3)


def test_logging_window_is_reduced_over_ranks_and_steps():
    def body(rank, world_size):
        metrics = TrainingMetrics(dist.get_process_group())
        for loss in (1.0 + rank, 3.0 + rank):  # two steps of 4 samples, mean loss 2 + rank
            metrics.window.add(loss, 4, comm_wait_s=0.5 * rank)
        scalars = metrics.reduce_window(step=2, lr=0.1)
        return scalars, metrics.loss_history, metrics.window.steps

    for rank, (scalars, history, left) in enumerate(run_threaded(body, 2, timeout_s=60)):
        assert scalars["train/loss"] == 2.5 and scalars["train/lr"] == 0.1  # (2 + 3) / 2 over both ranks
        assert scalars["train/samples_per_s"] > 0 and scalars["train/comm_wait_s"] == 0.5 * rank  # this rank's
        assert history == [(2, 2.5)] and left == 0


def test_metrics_state_round_trips_and_old_checkpoints_load():
    metrics = TrainingMetrics()
    metrics.loss_history, metrics.last_eval, metrics.smoke_probe_start = [(5, 1.5)], {"eval/loss": 0.5}, (0, 2.0)
    restored = TrainingMetrics()
    restored.load_state_dict({"step": 7, **metrics.state_dict()})
    assert restored.loss_history == [(5, 1.5)] and restored.last_eval == {"eval/loss": 0.5}
    assert restored.last_eval_step == 7 and restored.smoke_probe_start == (0, 2.0)
    older = TrainingMetrics()
    older.load_state_dict({"step": 7})  # a checkpoint written before these entries existed
    assert (older.loss_history, older.last_eval, older.last_eval_step, older.smoke_probe_start) == ([], {}, -1, None)


def test_parameters_digest_sees_one_changed_element_and_names():
    model = nn.Linear(3, 2)
    digest = parameters_digest(model)
    assert parameters_digest(model) == digest and len(digest) == 64
    with torch.no_grad():
        model.bias[1] = torch.nextafter(model.bias[1], torch.tensor(1.0))
    assert parameters_digest(model) != digest
    renamed = nn.Sequential(model)  # the same tensors under other names
    assert parameters_digest(renamed) != parameters_digest(model)


def test_final_metrics_say_whether_the_ranks_agree():
    def body(rank, world_size, differ):
        model = nn.Linear(2, 1)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(1.0 + (rank if differ else 0))
        metrics = TrainingMetrics(dist.get_process_group())
        metrics.loss_history = [(1, 2.0), (2, 1.0)]
        return metrics.final(model, step=2, epoch=1, fit_s=0.1)

    agree = run_threaded(body, 2, False, timeout_s=60)
    assert agree[0] == agree[1]
    assert agree[0]["params_agree"] and (agree[0]["step"], agree[0]["epoch"], agree[0]["world_size"]) == (2, 1, 2)
    assert (agree[0]["train/loss_first"], agree[0]["train/loss_last"]) == (2.0, 1.0)
    differ = run_threaded(body, 2, True, timeout_s=60)
    assert not differ[0]["params_agree"] and differ[0]["params_sha256"] == differ[1]["params_sha256"]  # rank 0's


def test_smoke_probe_measures_fixed_samples_without_drawing_random_numbers():
    data = TensorDataset(torch.arange(10.0).reshape(10, 1), torch.zeros(10))
    model = nn.Sequential(nn.Linear(1, 1), nn.Dropout(0.5)).train()

    def loss(module, batch):
        torch.rand(1)  # a loss that draws must not move the training stream either
        return module(batch[0]).sum() / len(batch[0])

    probe = SmokeProbe.first_samples(
        data, DataConfig(global_batch_size=4, eval_batch_size=3), loss, torch.device("cpu")
    )
    assert probe.num_samples == 4 and [len(b[0]) for b in probe.batches] == [3, 1]
    torch.manual_seed(0)
    expected_next = torch.rand(1)
    torch.manual_seed(0)
    first = probe.measure(model)
    assert torch.equal(torch.rand(1), expected_next) and model.training  # as if nothing had run
    assert probe.measure(model) == first  # eval mode: dropout off, the same number every time
    with torch.no_grad():
        expected = model[0](torch.arange(4.0).reshape(4, 1)).mean().item()
    assert first == pytest.approx(expected)


def test_smoke_check_wants_a_one_percent_fall_and_agreeing_ranks():
    def check(before, after, agree=True):
        return smoke_check(params_agree=agree, before=(0, before), after=(40, after), num_samples=128, world_size=2)

    assert check(2.3, 0.5) == "smoke check passed: loss 2.3000 -> 0.5000, parameters identical on 2 rank(s)"
    assert check(-1.0, -1.02).startswith("smoke check passed")  # a fall of a negative loss
    for before, after in ((2.3, 2.3), (2.3, 2.29), (2.3, 2.5), (-1.0, -0.99), (0.0, 0.0)):
        with pytest.raises(SmokeCheckError, match="the training loss did not fall") as info:
            check(before, after)
        assert "at step 0 ->" in str(info.value) and "same 128 training sample(s)" in str(info.value)
    with pytest.raises(SmokeCheckError) as info:
        check(2.3, 2.3, agree=False)
    assert "parameters differ between ranks" in str(info.value) and "did not fall" in str(info.value)
