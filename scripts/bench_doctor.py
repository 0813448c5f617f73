"""ddptrain doctor, measured: its overhead, its scaling prediction, and its advice applied.

    .venv/bin/python scripts/bench_doctor.py                 # everything (needs root for the slow link)
    .venv/bin/python scripts/bench_doctor.py --no-slow-link  # loopback only

1. Overhead: the same 2-rank run (tutorial Net, synthetic data, batch 32 per rank) with the doctor
   off and on, in rounds that alternate which goes first; each run's median step interval over the
   doctor's 30-step window (its last step, which also sweeps the link, left out); the figure is the
   median over rounds of on/off. (On this 2-core VM a run lands in a fast or a slow state, 5.3 or
   7.8 ms a step, whatever the doctor does: few rounds give ratios from 0.7 to 1.5.)
2. Scaling: a doctored run at 2 ranks predicts 2, 3 and 4 ranks on this host (``doctor.hosts=1``)
   and, with ``doctor.link_gbps=0.025``, 2 ranks over the 50 Mbit/s loopback (tbf on ``lo`` limits
   both directions together: a full-duplex link of 25 Mbit/s); each is then measured (the slow
   link in a private network namespace with a rate-limited loopback, as the tests do).
3. Advice: each injected cause is diagnosed, the advice of its first cause applied, and the step
   measured again, against the step the doctor predicted (medians of 5 runs each, before and after taking turns).

Prints Markdown tables. The injected tasks are ``tests/doctor/tasks.py``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import ddptrain  # noqa: E402
from tests.doctor.tasks import DoctorTask, build_model, doctor_config  # noqa: E402

SCALING_MODEL = {"kind": "mlp", "layers": 4, "width": 256}
SCALING_BATCH_PER_RANK = 32
SCALING_STEPS = 30
SCALING_REPEATS = 7  # launches per world size; the table gives their median (the VM swings 15% between launches)
SLOW_LINK = (
    "ip link set lo up && ip link set lo mtu 1500 && "
    "tc qdisc add dev lo root tbf rate 50mbit burst 32kbit latency 400ms"
)


class StepClock(ddptrain.Callback):
    """The wall time between consecutive ``on_train_batch_end`` calls, per step number."""

    def __init__(self):
        self.last, self.intervals = None, {}

    def on_fit_start(self, trainer):
        self.last = time.perf_counter()

    def on_train_batch_end(self, trainer, loss):
        now = time.perf_counter()
        self.intervals[trainer.state.step] = now - self.last
        self.last = time.perf_counter()


def _fit(root: Path, name: str, doctor: bool = True, clock=None, num_workers: int = 0, **kwargs) -> dict | None:
    """One fit of ``DoctorTask``; rank 0's doctor report on every rank."""
    from ddptrain.comm.objects import broadcast_object

    out = root / name
    config = doctor_config(out, **kwargs)
    config.trainer.doctor = doctor
    config.data.num_workers = num_workers
    trainer = DoctorTask(config, callbacks=[clock] if clock else [])
    trainer.fit()
    path = out / "doctor.json"
    mine = json.loads(path.read_text()) if doctor and trainer.is_main else None
    return broadcast_object(trainer.process_group, mine, 0)


def overhead_body(rank, world_size, root, rounds):
    """Per round, the median step of the doctor's window with the doctor off and on (the order
    alternating between rounds, so drift hits both alike); this rank's figures."""
    root, steps, warmup = Path(root), 30, 3
    window = range(warmup + 1, warmup + steps)  # the last one also sweeps the link
    off, on = [], []
    for r in range(rounds):
        order = ((False, off), (True, on)) if r % 2 == 0 else ((True, on), (False, off))
        for doctor, into in order:
            clock = StepClock()
            _fit(root, f"overhead{r}{doctor}", doctor, clock, model={"kind": "net"}, batch=32 * world_size, steps=steps)
            into.append(statistics.median(clock.intervals[s] for s in window))
    ratios = [b / a for a, b in zip(off, on)]
    return {"off_s": statistics.median(off), "on_s": statistics.median(on), "ratio": statistics.median(ratios)}


def scaling_body(rank, world_size, root):
    """The measured step at this world size (and, at 2, the predictions)."""
    root = Path(root)
    kw = dict(model=SCALING_MODEL, batch=SCALING_BATCH_PER_RANK * world_size, steps=SCALING_STEPS)
    loop = _fit(root, f"scaling{world_size}", world_sizes=[2, 3, 4], hosts=1, **kw)
    # tbf on lo limits both directions together: a full-duplex link of half its rate
    slow = _fit(root, f"scaling{world_size}slow", world_sizes=[2], link_gbps=0.025, **kw) if world_size == 2 else None
    return {"report": loop, "slow_link_report": slow}


# Autotune needs a job where the layout matters. Over loopback on CPU ranks it hardly does: the
# all-reduces take the cores backward needs, so nothing overlaps and fewer, bigger buckets win. Over
# the 50 Mbit/s loopback the link, not the cores, is the limit: the tutorial Net with 512 samples per
# rank computes ~70 ms and sends 87 kB (~30 ms); fc1's gradient (64 kB, ready first) can go out
# while the convolutions' backward runs, which only a bucket smaller than the model allows.
AUTOTUNE_TASKS = {
    "loopback": dict(model={"kind": "mlp", "layers": 100, "width": 128}, batch=16),
    "slow link": dict(model={"kind": "net"}, batch=1024, samples=1024 * 80),
}


def autotune_body(rank, world_size, root, task, repeats=3):
    """The doctor's median step at each size ``auto`` tries and at the default 25 MB, then with
    ``auto`` (measured after its trial): each the median of ``repeats`` runs, settings taking turns."""
    from ddptrain.doctor.autotune import BucketAutotune, candidate_caps

    root, runs, kw = Path(root), {}, dict(AUTOTUNE_TASKS[task], steps=10)
    model = build_model(kw["model"])
    caps = sorted({*candidate_caps(sum(p.numel() * p.element_size() for p in model.parameters())), 25.0})
    trial = len(caps) * (1 + BucketAutotune().steps_per_cap) + 2
    for r in range(repeats):
        for cap in caps:
            fixed = _fit(root, f"cap{cap}-{r}", dist={"bucket_cap_mb": cap}, **kw)
            runs.setdefault(str(cap), []).append(fixed["step_s"])
        auto = _fit(root, f"auto-{r}", dist={"bucket_cap_mb": "auto"}, warmup_steps=trial, **kw)
        runs.setdefault("auto", []).append(auto["step_s"])
        runs.setdefault("auto_chose_mb", []).append(auto["job"]["bucket_cap_mb"])
    out = {k: statistics.median(v) for k, v in runs.items() if k != "auto_chose_mb"}
    out["auto_chose_mb"] = runs["auto_chose_mb"]
    return out


ADVICE_CASES = {
    "data_loading": dict(model={"kind": "net", "sleep_s": 0.005}),
    "straggler": dict(model={"kind": "net", "slow_rank": 1, "slow_s": 0.4}),
    "small_buckets": dict(model={"kind": "mlp", "layers": 100, "width": 128}, dist={"bucket_cap_mb": 0.05}, batch=16),
    "find_unused_overhead": dict(
        model={"kind": "mlp", "layers": 200, "width": 8}, dist={"find_unused_parameters": True}, batch=8
    ),
    "cpu_oversubscribed": dict(model={"kind": "net"}, dist={"threads_per_worker": 4}, batch=256),
}


def _applied(case: dict, cause: dict) -> tuple[dict, str]:
    """``case`` with the first cause's advice applied (the config key it names), and what changed."""
    case = json.loads(json.dumps(case))
    dist, model, advice = case.setdefault("dist", {}), case["model"], cause["advice"]
    if cause["cause"] == "data_loading":
        case["num_workers"] = int(re.search(r"data\.num_workers=(\d+)", advice).group(1))
        # the workers start together and each queues 2 batches (prefetch_factor): the first
        # 2 * workers batches come in waves, not at the loader's steady rate the prediction is for
        case["warmup_steps"] = 2 * case["num_workers"]
        return case, f"data.num_workers={case['num_workers']} (warm-up {case['warmup_steps']} steps)"
    if cause["cause"] == "straggler":
        model["slow_s"] = 0.0
        return case, "the slow rank's sleep removed"
    if cause["cause"] in ("small_buckets", "no_overlap"):
        dist["bucket_cap_mb"] = float(re.search(r"dist\.bucket_cap_mb=([\d.]+) ", advice + " ").group(1))
        return case, f"dist.bucket_cap_mb={dist['bucket_cap_mb']:g}"
    if cause["cause"] == "find_unused_overhead":
        dist["find_unused_parameters"] = False
        return case, "dist.find_unused_parameters=false"
    if cause["cause"] == "cpu_oversubscribed":
        dist["threads_per_worker"] = int(re.search(r"dist\.threads_per_worker=(\d+)", advice).group(1))
        return case, f"dist.threads_per_worker={dist['threads_per_worker']}"
    return case, "nothing (no advice to apply)"


# over the 50 Mbit/s loopback: one bucket for the tutorial Net (see AUTOTUNE_TASKS)
ADVICE_SLOW_CASES = {"no_overlap": dict(model={"kind": "net"}, batch=1024, samples=1024 * 20)}


def advice_body(rank, world_size, root, slow_link=False, repeats=5, only=None):
    """Per injected cause (``only``: those named): the diagnosis, then the step measured with its
    advice applied; each the median of ``repeats`` runs, before and after taking turns (the
    diagnosis: the first run's). On this VM a run of the tutorial Net lands in a fast or a slow
    state whatever it does: medians of 3 still swung by 20%."""
    root, rows = Path(root), []
    for name, case in (ADVICE_SLOW_CASES if slow_link else ADVICE_CASES).items():
        if only and name not in only:
            continue
        case = {"batch": 64, "steps": 20, **case}
        befores = [_fit(root, f"advice_{name}_0", **case)]
        first = befores[0]["causes"][0]
        fixed, applied = _applied(case, first)
        afters = []
        for r in range(repeats):
            if r:
                befores.append(_fit(root, f"advice_{name}_{r}", **case))
            afters.append(_fit(root, f"advice_{name}_fixed_{r}", **fixed)["step_s"])
        rows.append(
            {
                "injected": name,
                "step_s": statistics.median(b["step_s"] for b in befores),
                "first": first,
                "predicted_s": statistics.median(b["causes"][0]["predicted_step_s"] for b in befores),
                "applied": applied,
                "after_s": statistics.median(afters),
            }
        )
    return rows


def _run(body, world_size, *args, backend="gloo"):
    from ddptrain.testing import run_distributed

    return run_distributed(body, world_size, *args, backend=backend, timeout_s=900, threads_per_worker=1)


def _in_slow_link(code: str, backend: str) -> str | None:
    """Run ``code`` (Python; ``repo`` is the checkout's path) in a private network namespace whose
    loopback runs at 50 Mbit/s; the text after its line ``RESULT `` (None: no unshare/tc here)."""
    if not (shutil.which("unshare") and shutil.which("tc")) or subprocess.run(["unshare", "-n", "true"]).returncode:
        return None
    repo = str(Path(__file__).resolve().parents[1])
    code = f"import json,sys; repo = {repo!r}; sys.path.insert(0, repo); " + code
    command = f"{SLOW_LINK} && exec {sys.executable} -c {json.dumps(code)}"
    env = {**os.environ, "OMPI_MCA_btl": "self,tcp"}
    done = subprocess.run(["unshare", "-n", "bash", "-c", command], capture_output=True, text=True, env=env)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
        return None
    return lines[0][len("RESULT ") :]


def _run_over_slow_link(body: str, out: Path, backend: str, *args):
    """``_run(body, 2, out, *args)``'s rank-0 result, run over the 50 Mbit/s loopback (None: cannot)."""
    code = (
        f"import scripts.bench_doctor as b; r = b._run(b.{body}, 2, {str(out)!r}, *{args!r}, "
        f"backend={backend!r})[0]; print('RESULT ' + json.dumps(r))"
    )
    text = _in_slow_link(code, backend)
    return None if text is None else json.loads(text)


def _slow_link_measured(root: Path, backend: str) -> float | None:
    """Step time of the scaling task at 2 ranks over the 50 Mbit/s loopback (None: no unshare/tc)."""
    result = _run_over_slow_link("scaling_body", root / "slow", backend)
    return None if result is None else result["report"]["step_s"]


def _ms(x):
    return f"{x * 1e3:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "mpi"])
    parser.add_argument("--rounds", type=int, default=40, help="overhead: off/on rounds")
    parser.add_argument("--no-slow-link", action="store_true")
    parser.add_argument("--only", choices=["overhead", "scaling", "advice", "autotune"], default=None)
    parser.add_argument("--cases", nargs="+", default=None, help="advice: only these injected causes")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_doctor_"))
    started = time.time()
    print(f"ddptrain doctor benchmark, backend {args.backend}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}\n")
    if args.only in (None, "overhead"):
        _print_overhead(_run(overhead_body, 2, str(root), args.rounds, backend=args.backend))
    if args.only in (None, "scaling"):
        _print_scaling(root, args)
    if args.only in (None, "advice"):
        rows = _run(advice_body, 2, str(root), False, 5, args.cases, backend=args.backend)[0]
        slow = (
            None
            if args.no_slow_link or (args.cases and not set(args.cases) & set(ADVICE_SLOW_CASES))
            else _run_over_slow_link("advice_body", root / "advice-slow", args.backend, True)
        )
        _print_advice(rows + [{**row, "injected": row["injected"] + " (50 Mbit/s)"} for row in slow or []])
    if args.only in (None, "autotune"):
        _print_autotune("loopback", _run(autotune_body, 2, str(root / "tune"), "loopback", backend=args.backend)[0])
        slow = (
            None
            if args.no_slow_link
            else _run_over_slow_link("autotune_body", root / "tune-slow", args.backend, "slow link")
        )
        if slow is not None:
            _print_autotune("slow link", slow)
    print(f"took {time.time() - started:.0f} s")


def _print_overhead(per_rank) -> None:
    print("| rank | doctor off: step ms | doctor on: step ms | on / off (median of rounds) |\n|---|---|---|---|")
    for rank, r in enumerate(per_rank):
        print(f"| {rank} | {_ms(r['off_s'])} | {_ms(r['on_s'])} | {r['ratio']:.3f} |")
    print()


def _print_scaling(root: Path, args) -> None:
    """Predicted (from a 2-rank run) against measured step times; each the median of
    ``SCALING_REPEATS`` launches, the world sizes taking turns (drift hits all alike)."""
    runs: dict[int, list[dict]] = {2: [], 3: [], 4: []}
    for r in range(SCALING_REPEATS):
        for p in runs:
            runs[p].append(_run(scaling_body, p, str(root / f"s{p}-{r}"), backend=args.backend)[0])
    predicted = {
        p: statistics.median(
            next(s["predicted_step_s"] for s in run["report"]["scaling"] if s["world_size"] == p) for run in runs[2]
        )
        for p in runs
    }
    measured = {p: statistics.median(run["report"]["step_s"] for run in runs[p]) for p in runs}
    print("| ranks, link | predicted step ms (from the 2-rank run) | measured step ms | measured / predicted |")
    print("|---|---|---|---|")
    for p in runs:
        print(f"| {p}, loopback | {_ms(predicted[p])} | {_ms(measured[p])} | {measured[p] / predicted[p]:.3f} |")
    slow_pred = statistics.median(run["slow_link_report"]["scaling"][0]["predicted_step_s"] for run in runs[2])
    slow = None if args.no_slow_link else _slow_link_measured(root, args.backend)
    if slow is not None:
        print(f"| 2, 50 Mbit/s loopback | {_ms(slow_pred)} | {_ms(slow)} | {slow / slow_pred:.3f} |")
    print()


def _print_autotune(task: str, r) -> None:
    caps = sorted((k for k in r if k not in ("auto", "auto_chose_mb")), key=float)
    best = min(caps, key=lambda k: r[k])
    print(f"{task}: `{AUTOTUNE_TASKS[task]}`\n")
    print("| dist.bucket_cap_mb | " + " | ".join(f"{float(c):g}" for c in caps) + " | auto |")
    print("|---|" + "---|" * (len(caps) + 1))
    auto = f"{_ms(r['auto'])} (chose {', '.join(f'{c:g}' for c in r['auto_chose_mb'])} MB)"
    print("| step ms | " + " | ".join(_ms(r[k]) for k in caps) + f" | {auto} |")
    print(f"\n25 MB / best ({float(best):g} MB) = {r['25.0'] / r[best]:.3f}; auto / best = {r['auto'] / r[best]:.3f}\n")


def _print_advice(rows) -> None:
    head = "| injected | first cause | advice applied | step ms | predicted ms | measured after ms | after / pred. |"
    print(head)
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['injected']} | {row['first']['cause']} | {row['applied']} | {_ms(row['step_s'])} | "
            f"{_ms(row['predicted_s'])} | {_ms(row['after_s'])} | {row['after_s'] / row['predicted_s']:.2f} |"
        )
    print()


if __name__ == "__main__":
    main()
