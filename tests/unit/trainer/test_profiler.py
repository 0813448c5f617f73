"""``trainer.profiler.enabled=true``: a Chrome-trace JSON file per rank under <output_dir>/profile, with
the scheduled steps and the Trainer's phase names (what TensorBoard's plugin and Perfetto read)."""

import json

import pytest

from ddptrain import ConfigError
from ddptrain.config import Config
from ddptrain.preflight import validate

from .test_trainer import TinyTrainer, _config


def _events(path):
    trace = json.loads(path.read_text())  # valid JSON, Chrome's trace format: {"traceEvents": [...]}
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    assert all("ph" in e for e in events) and all("ts" in e for e in events if e["ph"] == "X")
    return [e for e in events if e.get("ph") == "X"]


@pytest.mark.parametrize(("wait", "warmup", "active"), [(1, 1, 3), (0, 2, 2)])
def test_profile_writes_a_chrome_trace_of_the_scheduled_steps(tmp_path, wait, warmup, active):
    config = _config(tmp_path, epochs=2, profiler={"enabled": True, "wait": wait, "warmup": warmup, "active": active})
    TinyTrainer(config).fit()  # 8 steps
    traces = sorted((tmp_path / "profile").glob("*.pt.trace.json"))
    assert [p.name.split(".")[0] for p in traces] == ["rank0"]
    spans = _events(traces[0])
    names = [e["name"] for e in spans]
    recorded = sorted({n for n in names if n.startswith("ProfilerStep#")}, key=lambda n: int(n.split("#")[1]))
    assert recorded == [f"ProfilerStep#{wait + warmup + i}" for i in range(active)]  # exactly the active steps
    assert names.count("ddptrain/forward_backward") == active and names.count("ddptrain/optimizer_step") == active
    assert any(n.startswith("aten::") for n in names)  # the operators inside them


def test_no_profile_no_trace_and_the_schedule_is_checked(tmp_path):
    TinyTrainer(_config(tmp_path, epochs=1)).fit()
    assert not (tmp_path / "profile").exists()
    with pytest.raises(ConfigError, match="trainer.profiler.active=0 must be at least 1"):
        validate(Config.from_dict({"trainer": {"profiler": {"enabled": True, "active": 0}}}), 2)
