"""torchft under the same chaos as ``scripts/bench_elastic_training.py``, measured from outside.

Needs torchft (pytorch/torchft), which is kept out of the project's ``.venv`` (it may pull another
torch). Make a separate venv once, then run this file with it:

    python3.11 -m venv /tmp/tfv && /tmp/tfv/bin/pip install torch==2.14.1 torchvision==0.29.1 torchft
    /tmp/tfv/bin/python scripts/bench_torchft.py --replicas 3 --kills 3 [--every 10] [--json out.json]

The scenario: a torchft lighthouse (``torchft.coordination.LighthouseServer`` in a child process,
``min_replicas=1``; join timeout (default 10000 ms, as torchft's examples), heartbeat timeout
(5000 ms) and quorum tick (100 ms) are options, printed with the results) and ``--replicas`` replica
groups of one process each (this same file with ``--worker``). Each trains ``recipes.mnist.Net`` on
real MNIST (the idx files under ``--data``: by default ``MNIST/raw`` in the first directory of
DDPTRAIN_DATA_SOURCES) on CPU with one thread, as torchft's
``train_ddp.py`` does: a torchft ``Manager`` over ``ProcessGroupGloo``, torchft's
``DistributedDataParallel`` (``--ddp pure``: its ``PureDistributedDataParallel``, one all-reduce per
gradient and no comm hook), its ``Optimizer`` wrapper around SGD (lr 0.01, momentum 0.5, as
recipes/mnist), ``PGTransport`` for healing, and torchft's ``DistributedSampler`` giving each
replica group its own shard; batch 64 per group. Each worker prints one line per step attempt:
``TFSTEP <time.time()> <replica> <incarnation> <step> <committed 0/1> <participants> <participated 0/1>``.

After ``--warmup`` committed steps, every ``--every`` seconds this script SIGKILLs replica group
``--victim`` (default 1, not 0), waits ``--restart-delay`` seconds and starts it again (as
torchelastic would), ``--kills`` times. Then it lets the job run ``--tail-steps`` more steps, stops
every replica at the same step (a stop file holds the step), and, unless ``--no-reference``, runs
the same job for the same number of steps with no kill.

Per kill (all times from the workers' own ``time.time()`` stamps, compared with the kill's):

* kill -> survivors' next commit: the first step a survivor commits in a quorum formed after the
  kill (fewer participants than replicas, or a restarted survivor process);
* steps lost: the survivors' step attempts whose ``should_commit()`` was False (max over survivors);
  their batches are discarded, not redone;
* survivors crashed, and committed steps rolled back: when every survivor dies, nobody is left to
  heal from and the job starts again from step 0 (step at the kill - (lowest step committed after
  it - 1));
* samples skipped: torchft trains the victim's shard not at all while it is away, so (distinct
  steps the survivors committed from the kill until the victim's gradient is in a committed step
  again) x batch; the survivors' discarded batches are (steps lost) x batch x survivors;
* restart -> first commit of the restarted replica (it imports torch, loads MNIST, joins a quorum,
  heals from a peer), and kill -> the first committed step the restarted replica's gradient is part of
  (torchft's async quorum lets a healing replica commit a step without contributing to it).

At the end: whether every replica's final parameters hash the same, and whether they equal the
uninterrupted run's. torchft's end state depends on who was present at each step (missing shards,
discarded steps, the restarted group's sampler starting its shard again), so equality with the
uninterrupted run is not expected; equality between the replicas is. Any worker that dies without
being killed (e.g. torchft issues #295/#304, ``assert fut._fut`` in torchft/ddp.py's comm hook) is
recorded with its log tail and restarted.

Medians and maxima are printed because the machine is noisy. The whole run ends within
``--timeout`` seconds; every child runs in its own process group and is killed on the way out.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the first of DDPTRAIN_DATA_SOURCES, as ddptrain looks for MNIST; else this repository's CI layout
DATA_SOURCES = os.environ.get("DDPTRAIN_DATA_SOURCES", str(REPO.parent / "shared" / "data"))
MNIST_RAW = Path(DATA_SOURCES.split(":")[0]) / "MNIST" / "raw"
MEAN, STD = 0.1307, 0.3081  # recipes/mnist.py's normalisation


# --------------------------------------------------------------------------- worker (one replica group)


def _read_idx(path: Path):
    """An idx file (gzip-compressed or not) as a uint8 tensor of its shape."""
    import torch

    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    ndim = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return torch.frombuffer(bytearray(raw[4 + 4 * ndim :]), dtype=torch.uint8).reshape(shape)


def _mnist_train(raw_dir: Path):
    from torch.utils.data import TensorDataset

    def find(stem: str) -> Path:
        for name in (stem, stem + ".gz"):
            if (raw_dir / name).exists():
                return raw_dir / name
        raise FileNotFoundError(f"{stem}(.gz) not in {raw_dir}")

    images = _read_idx(find("train-images-idx3-ubyte")).unsqueeze(1).float().div(255).sub(MEAN).div(STD)
    labels = _read_idx(find("train-labels-idx1-ubyte")).long()
    return TensorDataset(images, labels)


def worker(args: argparse.Namespace) -> int:
    from datetime import timedelta

    import torch
    import torch.nn.functional as F
    from torch.distributed import TCPStore
    from torch.utils.data import DataLoader
    from torchft import DistributedDataParallel, DistributedSampler, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.ddp import PureDistributedDataParallel

    sys.path.insert(0, str(REPO))
    from recipes.mnist import Net

    torch.set_num_threads(1)
    rid = args.worker
    torch.manual_seed(args.seed + rid)  # dropout differs per group; init_sync makes the weights equal
    dataset = _mnist_train(Path(args.data))
    # One shard per replica group, as train_ddp.py; a restarted group starts its shard again (the
    # example does not checkpoint its data loader).
    sampler = DistributedSampler(
        dataset, replica_rank=rid, num_replica_groups=args.replicas, group_rank=0, num_replicas=1, shuffle=True
    )
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, drop_last=True)

    model = Net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        sgd.load_state_dict(state["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": sgd.state_dict()}

    # A replica group of one process still needs its own TCPStore (torchelastic would provide it).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))  # train_ddp.py's settings from here on
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"bench_{rid}",
        timeout=timedelta(seconds=30),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu")),
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
    )
    if args.ddp == "torchft":
        ddp = DistributedDataParallel(manager, model)  # as train_ddp.py
    else:
        ddp = PureDistributedDataParallel(manager, model)  # one all-reduce per gradient, no comm hook
    optimizer = Optimizer(manager, sgd)
    stop_file = Path(args.stop_file)
    stop_at = None
    epoch = 0
    print(f"TFSTART {time.time():.6f} {rid} {args.incarnation}", flush=True)
    while True:
        sampler.set_epoch(epoch)
        for images, labels in loader:
            optimizer.zero_grad()  # torchft: starts this step's quorum
            loss = F.nll_loss(ddp(images), labels)
            loss.backward()  # torchft: the gradients' all-reduce in the comm hook
            # What torchft's Optimizer.step() does, spelled out to see the verdict: step the
            # optimizer only if every replica in the quorum says the step is good.
            committed = manager.should_commit()
            if committed:
                sgd.step()
            step = manager.current_step()
            print(
                f"TFSTEP {time.time():.6f} {rid} {args.incarnation} {step} {int(committed)} "
                f"{manager.num_participants()} {int(manager.is_participating())}",
                flush=True,
            )
            if stop_at is None and stop_file.exists():
                stop_at = int(stop_file.read_text() or 0) or None
            if stop_at is not None and step >= stop_at:
                flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                sha = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
                print(f"TFHASH {rid} {step} {sha}", flush=True)
                manager.shutdown(wait=False)
                os._exit(0)  # torchft's threads can keep a normal exit waiting
        epoch += 1


# --------------------------------------------------------------------------- the orchestrator


class Replica:
    """One replica group's current process, its log files and parsed lines."""

    def __init__(self, rid: int, work: Path, base: list[str]):
        self.rid, self.work, self.base = rid, work, base
        self.incarnation = -1
        self.proc: subprocess.Popen | None = None
        self.logs: list[Path] = []

    def start(self) -> float:
        self.incarnation += 1
        log = self.work / f"replica{self.rid}-{self.incarnation}.log"
        self.logs.append(log)
        cmd = [*self.base, "--worker", str(self.rid), "--incarnation", str(self.incarnation)]
        with open(log, "w") as out:
            started = time.time()
            # Own session = own process group, so a kill takes everything the worker started.
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return started

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)

    def steps(self) -> list[tuple[float, int, int, int, bool, int, bool]]:
        """(time, replica, incarnation, step, committed, participants, participated) of every TFSTEP line."""
        rows = []
        for log in self.logs:
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith("TFSTEP "):
                    t, r, inc, step, ok, n, took_part = line.split()[1:8]
                    rows.append((float(t), int(r), int(inc), int(step), ok == "1", int(n), took_part == "1"))
        return rows

    def hash(self) -> str | None:
        text = self.logs[-1].read_text(errors="replace") if self.logs else ""
        found = [line.split()[3] for line in text.splitlines() if line.startswith("TFHASH ")]
        return found[-1] if found else None

    def tail(self, n: int = 15, last_only: bool = False) -> str:
        return "\n".join(
            f"  {log.name}: {line}"
            for log in (self.logs[-1:] if last_only else self.logs)
            for line in log.read_text(errors="replace").splitlines()[-n:]
        )


class Job:
    """A lighthouse and the replica groups, with a deadline; crashed workers are recorded and restarted."""

    def __init__(self, args: argparse.Namespace, work: Path, deadline: float):
        self.args, self.work, self.deadline = args, work, deadline
        work.mkdir(parents=True, exist_ok=True)
        self.stop_file = work / "stop"
        self.replicas: list[Replica] = []
        # The lighthouse in its own process: it logs every quorum request to stderr.
        port = _free_port()
        code = (
            "import time; from torchft.coordination import LighthouseServer; "
            f"s = LighthouseServer(bind='127.0.0.1:{port}', min_replicas=1, join_timeout_ms={args.join_timeout_ms}, "
            f"quorum_tick_ms={args.quorum_tick_ms}, heartbeat_timeout_ms={args.heartbeat_timeout_ms}); "
            "print('LIGHTHOUSE', s.address(), flush=True); time.sleep(10**6)"
        )
        self.lighthouse_log = work / "lighthouse.log"
        with open(self.lighthouse_log, "w") as out:
            self.lighthouse = subprocess.Popen(
                [sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self.wait_for("the lighthouse", lambda: "LIGHTHOUSE " in self.lighthouse_log.read_text(), 60)
        except BaseException:
            self.close()
            raise
        address = self.lighthouse_log.read_text().split("LIGHTHOUSE ")[1].split()[0]
        base = [sys.executable, __file__, "--replicas", str(args.replicas), "--batch", str(args.batch)]
        base += ["--seed", str(args.seed), "--data", args.data, "--lighthouse", address, "--ddp", args.ddp]
        base += ["--stop-file", str(self.stop_file)]
        self.replicas = [Replica(r, work, base) for r in range(args.replicas)]
        self.crashes: list[dict] = []
        self.expected_down: set[int] = set()

    def all_steps(self) -> list[tuple[float, int, int, int, bool, int, bool]]:
        return sorted(row for r in self.replicas for row in r.steps())

    def check(self) -> None:
        """Raise past the deadline; record and restart a worker that died without being killed."""
        if time.time() > self.deadline:
            raise TimeoutError(f"the run passed its --timeout of {self.args.timeout} s")
        for r in self.replicas:
            if r.rid in self.expected_down or r.proc is None or r.proc.poll() is None:
                continue
            if r.proc.returncode == 0 and r.hash() is not None:
                continue  # finished
            self.crashes.append(
                {"replica": r.rid, "incarnation": r.incarnation, "time": time.time(), "returncode": r.proc.returncode}
            )
            rc, log = r.proc.returncode, r.tail(6, last_only=True)
            print(f"!! replica {r.rid} (incarnation {r.incarnation}) died unkilled, rc {rc}; restarted. Log:\n{log}")
            r.start()

    def wait_for(self, what: str, predicate, timeout: float) -> None:
        until = min(time.time() + timeout, self.deadline)
        while not predicate():
            self.check()
            if time.time() > until:
                raise TimeoutError(f"waited {timeout:.0f} s for {what}")
            time.sleep(0.1)

    def finish(self, stop_at: int) -> None:
        self.stop_file.write_text(str(stop_at))
        self.wait_for(
            f"every replica to stop at step {stop_at}", lambda: all(r.hash() is not None for r in self.replicas), 180
        )

    def close(self) -> None:
        for r in self.replicas:
            r.kill()
        if self.lighthouse.poll() is None:
            os.killpg(self.lighthouse.pid, signal.SIGKILL)
            self.lighthouse.wait(timeout=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _committed(rows) -> int:
    """The highest committed step in rows (0 if none)."""
    return max((row[3] for row in rows if row[4]), default=0)


def chaos(args: argparse.Namespace, job: Job) -> tuple[list[dict], int]:
    """Start, kill and restart as the module docstring says; (the kills, the final step)."""
    n = args.replicas
    for r in job.replicas:
        r.start()
    job.wait_for(
        f"all replicas to commit step {args.warmup}",
        lambda: all(_committed(r.steps()) >= args.warmup for r in job.replicas),
        240,
    )
    victim = job.replicas[args.victim]
    kills = []
    for k in range(args.kills):
        if k:
            job.wait_for("the next kill", lambda: time.time() >= kills[-1]["kill_time"] + args.every, args.every + 5)
        job.expected_down.add(victim.rid)
        # steps of the current processes only: after a crash, the older ones' steps are gone
        current = [row for row in job.all_steps() if row[2] == job.replicas[row[1]].incarnation]
        last_step = _committed([row for row in current if row[1] == victim.rid])
        job_step = _committed(current)
        incarnations = {r.rid: r.incarnation for r in job.replicas}
        killed = time.time()
        victim.kill()
        print(f"SIGKILL replica {victim.rid} at its step {last_step}", flush=True)
        time.sleep(args.restart_delay)
        restarted = victim.start()
        job.expected_down.discard(victim.rid)
        kills.append(
            {
                "victim": victim.rid,
                "kill_time": killed,
                "restart_time": restarted,
                "victim_step": last_step,
                "job_step": job_step,
                "incarnations": incarnations,
            }
        )
        # The restarted replica must be back (all replicas in a step) before the next kill.
        job.wait_for(
            "the restarted replica to take part in a committed step",
            lambda since=restarted: any(row[0] > since and row[4] and row[5] == n for row in job.all_steps()),
            120,
        )
    stop_at = _committed(job.all_steps()) + args.tail_steps
    job.finish(stop_at)
    return kills, stop_at


def measure(job: Job, kills: list[dict]) -> list[dict]:
    n = job.args.replicas
    rows = job.all_steps()
    results = []
    for i, kill in enumerate(kills):
        v, tk, tr = kill["victim"], kill["kill_time"], kill["restart_time"]
        until = kills[i + 1]["kill_time"] if i + 1 < len(kills) else float("inf")
        window = [row for row in rows if tk < row[0] < until]
        survivors = [row for row in window if row[1] != v]
        # the survivors' first commit in a quorum without the victim, or (if a survivor crashed and
        # was restarted) by a new incarnation: a step committed after the kill by an old quorum
        # that still counted the victim is not it
        inc = kill["incarnations"]
        after = [row for row in window if row[5] < n or row[2] > inc[row[1]]]
        first = next((row for row in after if row[1] != v and row[4]), None)
        # committed steps whose progress is gone: all of them when every survivor crashed and the
        # job started again from step 0 (nobody was left to heal from); the lowest step committed
        # after the kill (by a quorum formed after it) tells
        lowest = min((row[3] for row in after if row[4]), default=None)
        rolled_back = None if lowest is None else max(0, kill["job_step"] - (lowest - 1))
        crashed = [c for c in job.crashes if tk < c["time"] < until and c["replica"] != v]
        lost = max((sum(1 for row in survivors if row[1] == s and not row[4]) for s in range(n) if s != v), default=0)
        back = next((row for row in window if row[1] == v and row[0] > tr and row[4]), None)
        # the steps the survivors committed until the victim's gradient was in a committed step
        # again: its shard's samples were not trained in them (each step number counted once)
        joined = next((row[0] for row in window if row[1] == v and row[0] > tr and row[4] and row[6]), until)
        absent = len({row[3] for row in survivors if row[0] < joined and row[4]})
        results.append(
            {
                "victim": v,
                "victim_step_at_kill": kill["victim_step"],
                "kill_to_survivor_commit_s": None if first is None else first[0] - tk,
                "steps_lost": lost,
                "survivors_crashed": len(crashed),
                "committed_steps_rolled_back": rolled_back,
                "steps_without_victim": absent,
                "samples_skipped_victim_shard": absent * job.args.batch,
                "samples_discarded_survivors": lost * job.args.batch * (n - 1),
                "restart_to_restarted_commit_s": None if back is None else back[0] - tr,
                "kill_to_victim_in_commit_s": None if joined == until else joined - tk,
            }
        )
    return results


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)


def report(args, results: list[dict], summary: dict) -> None:
    cols = [
        ("kill_to_survivor_commit_s", "kill -> survivors' next commit (s)"),
        ("steps_lost", "steps lost (failed commits)"),
        ("survivors_crashed", "survivors crashed"),
        ("committed_steps_rolled_back", "committed steps rolled back"),
        ("steps_without_victim", "steps without the victim"),
        ("samples_skipped_victim_shard", "victim's samples skipped"),
        ("samples_discarded_survivors", "survivors' samples discarded"),
        ("restart_to_restarted_commit_s", "restart -> its first commit (s)"),
        ("kill_to_victim_in_commit_s", "kill -> victim's gradient in a commit again (s)"),
    ]
    print("\n| kill | " + " | ".join(title for _, title in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for i, row in enumerate(results):
        print(f"| {i + 1} | " + " | ".join(_fmt(row[key]) for key, _ in cols) + " |")
    for name, fn in (("median", statistics.median), ("max", max)):
        cells = []
        for key, _ in cols:
            values = [row[key] for row in results if row[key] is not None]
            cells.append(_fmt(fn(values)) if values else "-")
        print(f"| **{name}** | " + " | ".join(cells) + " |")
    print(
        f"\nsamples: victim's = (distinct steps the survivors committed from the kill until the victim's gradient"
        f" was in a committed step again) x batch {args.batch}; survivors' = (steps lost) x batch"
        f" x {args.replicas - 1} survivors"
    )
    for key, value in summary.items():
        print(f"{key}: {value}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--every", type=float, default=10.0, help="seconds between kills")
    parser.add_argument("--victim", type=int, default=1, help="replica group to kill")
    parser.add_argument("--warmup", type=int, default=30, help="committed steps before the first kill")
    parser.add_argument("--tail-steps", type=int, default=20, help="steps after the last recovery")
    parser.add_argument("--restart-delay", type=float, default=1.0, help="seconds between a kill and the restart")
    parser.add_argument("--batch", type=int, default=64, help="batch per replica group")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--join-timeout-ms", type=int, default=10000, help="lighthouse (torchft's examples: 10000)")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5000, help="lighthouse (torchft's default)")
    parser.add_argument("--quorum-tick-ms", type=int, default=100, help="lighthouse (torchft's default)")
    parser.add_argument(
        "--ddp",
        choices=["torchft", "pure"],
        default="torchft",
        help="torchft.DistributedDataParallel (as train_ddp.py) or torchft.ddp.PureDistributedDataParallel",
    )
    parser.add_argument("--no-reference", action="store_true", help="skip the uninterrupted run")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the whole run may take")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--data", default=str(MNIST_RAW), help="directory of the MNIST idx files")
    # internal: how the orchestrator starts a replica group
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--incarnation", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    parser.add_argument("--stop-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        import torchft  # noqa: F401
    except ImportError:
        print(
            "bench_torchft.py needs torchft, kept out of the project's .venv. Install it in its own venv:\n"
            "  python3.11 -m venv /tmp/tfv && /tmp/tfv/bin/pip install torch==2.14.1 torchvision==0.29.1 torchft\n"
            "then run: /tmp/tfv/bin/python scripts/bench_torchft.py",
            file=sys.stderr,
        )
        return 2
    if args.worker is not None:
        return worker(args)
    if not 0 <= args.victim < args.replicas:
        parser.error("--victim must be a replica id below --replicas")

    from importlib.metadata import version

    deadline = time.time() + args.timeout
    # SIGTERM ends the run like Ctrl-C: through the finally blocks that kill the workers.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    work = Path(tempfile.mkdtemp(prefix="bench-torchft-"))
    settings = (
        f"min_replicas=1, join_timeout_ms={args.join_timeout_ms}, heartbeat_timeout_ms={args.heartbeat_timeout_ms},"
        f" quorum_tick_ms={args.quorum_tick_ms}"
    )
    print(f"torchft {version('torchft')}, torch {version('torch')}; logs in {work}; lighthouse: {settings}")
    job = Job(args, work / "chaos", deadline)
    try:
        kills, stop_at = chaos(args, job)
    except (TimeoutError, KeyboardInterrupt, subprocess.TimeoutExpired) as e:
        print(f"\nFAILED: {e!r}; last lines of each replica's logs:")
        for r in job.replicas:
            print(r.tail())
        return 1
    finally:
        job.close()
    results = measure(job, kills)
    hashes = {r.rid: r.hash() for r in job.replicas}
    summary = {
        "lighthouse": settings,
        "final step": stop_at,
        "crashes (workers that died unkilled)": job.crashes or "none",
        "final params equal across replicas": len(set(hashes.values())) == 1,
        "final params sha256": hashes,
    }
    if not args.no_reference:
        ref = Job(args, work / "reference", deadline)
        try:
            for r in ref.replicas:
                r.start()
            ref.finish(stop_at)
            ref_hash = ref.replicas[0].hash()
            same = "equal" if ref_hash == hashes[0] else "different"
            summary["uninterrupted run, same steps"] = f"{same} (its sha256 {ref_hash[:12]}...)"
        except (TimeoutError, subprocess.TimeoutExpired) as e:
            summary["uninterrupted run, same steps"] = f"failed: {e!r}"
            for r in ref.replicas:
                print(r.tail())
        finally:
            ref.close()
    report(args, results, summary)
    if args.json:
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "kills": results, **summary}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
