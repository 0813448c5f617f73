"""Training over a slow link: every_step against local SGD and DiLoCo, 4 ranks on 2 "hosts".

Two network namespaces joined by a veth pair stand for two hosts; each runs torchrun with 2 ranks
of ``python -m ddptrain recipe=mnist_fast`` (gloo). Both ends of the veth pair are shaped with
``tc qdisc ... tbf rate 20mbit burst 32kbit latency 400ms``, so every byte between the hosts
crosses a 20 Mbit/s link each way; the ranks of one host talk over its loopback, unshaped, as on
real machines. Each setting trains the same samples (``--epochs``), evaluating every
``--eval-every`` steps, and the script reports:

- ``time to X%``: training seconds (evaluations left out: the ``time/train_s`` each evaluation
  records) until the test accuracy first reaches ``--target``; the anchor is ``every_step``;
- ``final acc``: the test accuracy after the same number of samples;
- ``MB sent/rank``: the payload this rank handed to communication (``comm/bytes_sent`` of
  ``metrics.json``), and ``MB on link``: what crossed the veth link from host A, both ways
  (the kernel's byte counters: headers and retransmissions included);
- ``ms/step``: training seconds per step, outer steps included (``time/train_s`` / steps).

Checkpoints are off in every run (a local-sync checkpoint gathers every rank's copy; that is not
the step time compared here). First, unless ``--no-doctor``, ``python -m ddptrain.doctor`` measures
``every_step`` on the same link; the script then trains the option it recommends too (if not
already in the list) and prints each option's predicted ms/step next to the measured one.

MNIST is found as a run finds it: ``data.root`` or ``$DDPTRAIN_DATA_SOURCES`` (set it to the directory
holding ``MNIST/raw``), no download.

Needs root and iproute2 (``ip netns``, ``tc``). Run it alone on the machine: it measures time.

    .venv/bin/python scripts/bench_slow_link.py                    # every_step, local_sgd H=16, diloco H=16
    .venv/bin/python scripts/bench_slow_link.py --syncs diloco --sync-every 4 16 64 --no-doctor
    .venv/bin/python scripts/bench_slow_link.py --syncs diloco --set dist.outer_momentum=0.5 seed=1 --no-doctor

Measured figures go to benchmarks/README.md with the command and the date.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ddptrain.doctor.diagnose import recommended_local_sync  # noqa: E402

TAG = 77  # namespace, device and address names: ddptb77a/b, vb77a/b, 10.233.77.1/2


def sh(*cmd: str, check: bool = True) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=60).stdout


class TwoHosts:
    """Two namespaces A and B joined by a veth pair, each end limited to ``rate`` (tbf)."""

    def __init__(self, rate: str):
        self.ns = (f"ddptb{TAG}a", f"ddptb{TAG}b")
        self.dev = (f"vb{TAG}a", f"vb{TAG}b")
        self.addr = (f"10.233.{TAG}.1", f"10.233.{TAG}.2")
        self.rate = rate

    def __enter__(self) -> TwoHosts:
        self.__exit__()
        sh("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
        for ns, dev, addr in zip(self.ns, self.dev, self.addr):
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            tbf = ("tbf", "rate", self.rate, "burst", "32kbit", "latency", "400ms")
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *tbf)
        return self

    def __exit__(self, *exc) -> None:
        for ns in self.ns:
            sh("ip", "netns", "del", ns, check=False)

    def link_bytes(self) -> int:
        """Bytes host A's end of the link sent plus received so far."""
        stats = Path("/sys/class/net") / self.dev[0] / "statistics"
        out = sh("ip", "netns", "exec", self.ns[0], "cat", str(stats / "tx_bytes"), str(stats / "rx_bytes"))
        return sum(int(x) for x in out.split())


COMMON = [
    "recipe=mnist_fast",
    "trainer.progress=false",
    "trainer.checkpoint.every_epochs=0",  # a local-sync checkpoint gathers every rank's copy: not
    "trainer.checkpoint.at_end=false",  # part of the step time compared here
    "dist.threads_per_worker=1",  # 4 ranks on this machine's cores, whatever each host thinks
    "data.download=false",
]


def launch(hosts: TwoHosts, module: str, overrides: list[str], out: Path, timeout: float) -> None:
    """``python -m module overrides`` under torchrun, 2 ranks on each host; raises if a host fails."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("MASTER_ADDR", None)
    procs = []
    for node, (ns, dev) in enumerate(zip(hosts.ns, hosts.dev)):
        cmd = ["ip", "netns", "exec", ns, torchrun, "--nnodes", "2", "--node-rank", str(node)]
        cmd += ["--nproc-per-node", "2", "--master-addr", hosts.addr[0], "--master-port", "29577"]
        cmd += ["-m", module, *COMMON, *overrides, f"trainer.output_dir={out}"]
        log = open(out.parent / f"{out.name}.host{node}.log", "w")  # noqa: SIM115 (closed with the process)
        procs.append((subprocess.Popen(cmd, env=dict(env, GLOO_SOCKET_IFNAME=dev), stdout=log, stderr=log), log))
    for proc, log in procs:
        code = proc.wait(timeout=timeout)
        log.close()
        if code:
            raise SystemExit(f"{module} {' '.join(overrides)}: host exited {code}; see {log.name}")


def train(hosts: TwoHosts, sync: str, every: int, args, out: Path) -> dict:
    """One run of the recipe on both hosts; its figures."""
    overrides = [
        f"dist.sync={sync}",
        f"dist.sync_every={every}",
        f"trainer.epochs={args.epochs}",
        f"trainer.eval_every_steps={args.eval_every}",
        "trainer.eval_every_epochs=0",
        "trainer.log_every_steps=10",
        "trainer.num_sanity_val_steps=0",
        *args.set,
    ]
    before, started = hosts.link_bytes(), time.perf_counter()
    launch(hosts, "ddptrain", overrides, out, args.timeout)
    wall = time.perf_counter() - started
    final = json.loads((out / "metrics.json").read_text())
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    evals = [
        (int(r["step"]), float(r["eval/accuracy"]), float(r["time/train_s"])) for r in rows if r.get("eval/accuracy")
    ]
    reached = next(((step, t) for step, acc, t in evals if acc >= args.target), None)
    return {
        "sync": label(sync, every),
        "time_to_target_s": None if reached is None else reached[1],
        "step_at_target": None if reached is None else reached[0],
        "final_accuracy": final["eval/accuracy"],
        "mb_sent_per_rank": final["comm/bytes_sent"] / 1e6,
        "mb_on_link": (hosts.link_bytes() - before) / 1e6,
        "ms_per_step": 1000 * final["time/train_s"] / final["step"],
        "train_s": final["time/train_s"],
        "wall_s": wall,
        "evals": evals,
    }


def label(sync: str, every: int) -> str:
    return sync if sync == "every_step" else f"{sync} H={every}"


def diagnose(hosts: TwoHosts, args, out: Path) -> dict:
    """``python -m ddptrain.doctor`` at every_step on the same link: its measured step and the
    option it recommends, with that option's predicted step."""
    launch(hosts, "ddptrain.doctor", ["doctor.steps=20", *args.set], out, args.timeout)
    report = json.loads((out / "doctor.json").read_text())
    cause = next((c for c in report["causes"] if c["cause"] == "slow_network"), None)
    if cause is None:
        raise SystemExit(f"the doctor did not name slow_network on this link: {report['causes']}; see {out}")
    options = cause["sync_options"]
    return {"step_s": report["step_s"], "options": options, "recommended": recommended_local_sync(options)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--syncs", nargs="+", default=["every_step", "local_sgd", "diloco"])
    parser.add_argument("--sync-every", nargs="+", type=int, default=[16], help="H for local_sgd/diloco")
    parser.add_argument("--epochs", type=int, default=4, help="recipe=mnist_fast's own length (4)")
    parser.add_argument("--eval-every", type=int, default=47, help="steps between evaluations (235 per epoch)")
    parser.add_argument("--target", type=float, default=0.985)
    parser.add_argument("--rate", default="20mbit")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", type=Path, default=Path("/tmp/ddptrain-bench-slow-link"))
    parser.add_argument("--no-doctor", action="store_true", help="skip the doctor's prediction check")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="more overrides for every run")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root: it creates network namespaces and shapes their link with tc")
    args.out.mkdir(parents=True, exist_ok=True)
    results, doctor = [], None
    with TwoHosts(args.rate) as hosts:

        def run(sync: str, every: int) -> None:
            result = train(hosts, sync, every, args, args.out / f"{sync}-{every}")
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "evals"}), flush=True)

        if not args.no_doctor:
            doctor = diagnose(hosts, args, args.out / "doctor")
            print(json.dumps(doctor), flush=True)
        for sync in args.syncs:
            for every in [1] if sync == "every_step" else args.sync_every:
                run(sync, every)
        if doctor and not any(r["sync"] == label("diloco", doctor["recommended"]["sync_every"]) for r in results):
            run("diloco", doctor["recommended"]["sync_every"])  # the advice, measured
    anchor = next((r["time_to_target_s"] for r in results if r["sync"] == "every_step"), None)
    print(f"\n{args.epochs} epoch(s) of recipe=mnist_fast, 4 ranks on 2 hosts, link {args.rate} each way")
    columns = ("vs every_step", "final acc", "MB sent/rank", "MB on link", "ms/step")
    print(f"| setting | time to {args.target:.1%} (s) | " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        t = r["time_to_target_s"]
        ratio = f"{anchor / t:.2f}x sooner" if t and anchor else "-"
        shown = "not reached" if t is None else f"{t:.0f} (step {r['step_at_target']})"
        print(
            f"| {r['sync']} | {shown} | {ratio} | {r['final_accuracy']:.2%} | {r['mb_sent_per_rank']:.1f} "
            f"| {r['mb_on_link']:.1f} | {r['ms_per_step']:.0f} |"
        )
    if doctor:
        measured = {r["sync"]: r["ms_per_step"] for r in results}
        print(f"\nthe doctor at every_step on this link: step {1000 * doctor['step_s']:.0f} ms (median of its window)")
        print("| option | predicted ms/step | measured ms/step | predicted / measured |")
        print("|---|---|---|---|")
        for o in doctor["options"]:
            name = label(o["sync"], o["sync_every"])
            predicted, got = 1000 * o["predicted_step_s"], measured.get(name)
            mark = " (recommended)" if o == doctor["recommended"] else ""
            shown = "-" if got is None else f"{got:.0f} | {predicted / got:.2f}"
            print(f"| {name}{mark} | {predicted:.0f} | {shown} |")
    (args.out / "results.json").write_text(json.dumps({"runs": results, "doctor": doctor}, indent=2))


if __name__ == "__main__":
    main()
