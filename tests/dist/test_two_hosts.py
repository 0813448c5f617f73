"""Two hosts on one machine: two network namespaces joined by a veth pair, one torchrun per host.

Needs root and `ip netns` (iproute2); skips with the reason otherwise. Only the namespaces' own
addresses (10.231.<n>.1/.2, made here and removed afterwards) and loopback are used.
"""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import BIN, PYTHON, cli_env

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINING = (  # the elastic job's, and its uninterrupted reference's
    "recipe=mnist",
    "trainer.world_size_invariant=true",
    "trainer.max_steps=600",
    "trainer.progress=false",
    "trainer.loggers.tensorboard=false",
    "trainer.eval_every_epochs=0",
    "trainer.limit_val_batches=1",
)


def _sh(*cmd, check=True):
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    tag = os.getpid() % 200 + 20
    a, b = f"ddpt{tag}a", f"ddpt{tag}b"
    addr_a, addr_b = f"10.231.{tag}.1", f"10.231.{tag}.2"
    try:
        _sh("ip", "netns", "add", a)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.strip()}")
    try:
        _sh("ip", "netns", "add", b)
        _sh("ip", "link", "add", f"v{tag}a", "type", "veth", "peer", "name", f"v{tag}b")
        for ns, dev, addr in ((a, f"v{tag}a", addr_a), (b, f"v{tag}b", addr_b)):
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield (a, addr_a), (b, addr_b)
    finally:
        _sh("ip", "netns", "del", a, check=False)
        _sh("ip", "netns", "del", b, check=False)


def test_two_node_torchrun_job_between_namespaces(two_hosts):
    (ns_a, addr_a), (ns_b, _addr_b) = two_hosts
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("MASTER_ADDR", None)
    procs = []
    for node, ns in ((0, ns_a), (1, ns_b)):
        cmd = [
            "ip",
            "netns",
            "exec",
            ns,
            torchrun,
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--nproc-per-node",
            "1",
            "--master-addr",
            addr_a,
            "--master-port",
            "29555",
            os.path.join(ROOT, "tests", "two_host_train.py"),
        ]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outputs.append(out)
        assert p.returncode == 0, out[-3000:]
    results = [re.search(r"RESULT .*", out).group(0) for out in outputs]
    digests = {re.search(r"digest=(\w+)", r).group(1) for r in results}
    assert len(digests) == 1, results  # both hosts end with identical parameters
    for r in results:
        assert "launcher=torchrun" in r and "world=2" in r
        first, last = float(re.search(r"first=([\d.]+)", r).group(1)), float(re.search(r"last=([\d.]+)", r).group(1))
        assert last < first, r  # training really happened
    assert {re.search(r"node=(\d)", r).group(1) for r in results} == {"0", "1"}


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.timeout(300)
def test_an_elastic_job_over_two_hosts_goes_on_when_one_hosts_worker_dies(two_hosts, mnist_root, tmp_path):
    """The store process in namespace A; one torchrun per namespace (--standalone: each restarts
    only its own workers), 2 workers each, joined by the store into a job of 4. One of B's workers
    is SIGKILLed: A's ranks go on in their processes, B's torchrun restarts its workers and they
    rejoin, and the run ends with the bits of an uninterrupted 1-rank run."""
    (ns_a, addr_a), (ns_b, _addr_b) = two_hosts
    elastic = (*TRAINING, "trainer.elastic=true", "dist.world_size=4", f"hydra.run.dir={tmp_path / 'run'}")
    reference = subprocess.run(
        [PYTHON, "-m", "ddptrain", *TRAINING, "dist.world_size=1", f"hydra.run.dir={tmp_path / 'ref'}"],
        cwd=ROOT,
        env=cli_env(DDPTRAIN_DATA=str(mnist_root)),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert reference.returncode == 0, (reference.stdout + reference.stderr)[-3000:]
    uninterrupted = json.loads((tmp_path / "ref" / "metrics.json").read_text())["params_sha256"]

    env = cli_env(DDPTRAIN_DATA=str(mnist_root), PYTHONPATH=ROOT)
    port = 29400 + os.getpid() % 500
    store = subprocess.Popen(
        ["ip", "netns", "exec", ns_a, PYTHON, "-m", "ddptrain.store", "--host", "0.0.0.0", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    hosts: dict[str, subprocess.Popen] = {}
    lines: dict[str, list[str]] = {ns_a: [], ns_b: []}
    try:
        assert "ddptrain store: serving on" in store.stdout.readline()
        torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
        torchrun += ["--monitor-interval", "0.1", "-m", "ddptrain", *elastic, f"dist.elastic_store={addr_a}:{port}"]
        for ns in (ns_a, ns_b):
            hosts[ns] = subprocess.Popen(
                ["ip", "netns", "exec", ns, *torchrun],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        readers = [threading.Thread(target=lambda ns=ns: lines[ns].extend(hosts[ns].stdout)) for ns in hosts]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + 180
        while not any(re.search(r"\]\[INFO\] step (2\d|[3-9]\d)/", line) for ns in lines for line in lines[ns]):
            assert time.monotonic() < deadline and all(h.poll() is None for h in hosts.values()), lines
            time.sleep(0.05)
        a_workers, b_workers = _children(hosts[ns_a].pid), _children(hosts[ns_b].pid)
        assert len(a_workers) == len(b_workers) == 2, (a_workers, b_workers)
        os.kill(b_workers[0], signal.SIGKILL)
        for ns, host in hosts.items():
            try:
                code = host.wait(timeout=max(1.0, deadline + 60 - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = "still running"
            assert code == 0, f"host {ns}: {code}\n" + "".join(lines[ns])[-6000:]
        for reader in readers:
            reader.join(timeout=10)
    finally:
        for process in [*hosts.values(), store]:
            process.kill()
            process.wait()
    output = "".join(lines[ns_a] + lines[ns_b])
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    changes = metrics["membership_changes"]
    left = {int(member.split("-")[-2]) for c in changes for member in c["left"]}  # ids: host-pid-suffix
    assert left and left <= set(b_workers), (changes, a_workers, b_workers)  # A's ranks never left
    assert sum(len(c["joined"]) for c in changes) >= len(left), changes  # B's restarted workers rejoined
    assert metrics["world_size"] == 4 and metrics["params_agree"], output[-4000:]
    assert metrics["params_sha256"] == uninterrupted, output[-4000:]


def _torchrun_on_two_hosts(hosts, disks, run, port, *overrides, succeed=True):
    """One torchrun per host, each with its own directory mounted at ``run`` (a disk of its own:
    ``ip netns exec`` gives each its own mount namespace); both outputs, once both have exited
    (with status 0 if ``succeed``)."""
    (ns_a, addr_a), (ns_b, _addr_b) = hosts
    torchrun = [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1"]
    torchrun += ["--master-addr", addr_a, "--master-port", str(port)]
    procs = []
    for node, ns in enumerate((ns_a, ns_b)):
        command = [*torchrun, "--node-rank", str(node), "-m", "ddptrain", *overrides, f"hydra.run.dir={run}"]
        script = f"mount --bind {shlex.quote(str(disks[node]))} {shlex.quote(str(run))} && exec {shlex.join(command)}"
        procs.append(
            subprocess.Popen(
                ["ip", "netns", "exec", ns, "sh", "-c", script],
                cwd=ROOT,
                env=cli_env(PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=150)[0])
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outputs):
        assert (p.returncode == 0) == succeed, out[-4000:]
    return outputs


def test_a_job_on_two_hosts_with_node_local_output_resumes_in_place(two_hosts, mnist_root, tmp_path):
    """trainer.output_dir on each host's own disk: only rank 0's host holds the checkpoints. The job
    stops at step 20 and resumes in place, rank 0 sending the checkpoint to the other host, and
    ends with the bits of an uninterrupted 1-rank run (world-size-invariant mode). The DCP format,
    which every rank writes into one directory, is refused there saying why."""
    training = (*TRAINING[:2], "trainer.max_steps=40", *TRAINING[3:], f"data.root={mnist_root}")
    reference = subprocess.run(
        [PYTHON, "-m", "ddptrain", *training, "dist.world_size=1", f"hydra.run.dir={tmp_path / 'ref'}"],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert reference.returncode == 0, (reference.stdout + reference.stderr)[-3000:]
    uninterrupted = json.loads((tmp_path / "ref" / "metrics.json").read_text())["params_sha256"]
    run, disks = tmp_path / "run", (tmp_path / "disk_a", tmp_path / "disk_b")
    for directory in (run, *disks):
        directory.mkdir()
    port = 29700 + os.getpid() % 200
    _torchrun_on_two_hosts(two_hosts, disks, run, port, *training, "trainer.stop_after_steps=20")
    assert [p.name for p in (disks[0] / "checkpoints").glob("step_*.pt")] == ["step_000000020.pt"]
    assert not list(disks[1].glob("checkpoints/step_*")) and not list(run.iterdir())  # B's disk: none; ours: none
    _torchrun_on_two_hosts(two_hosts, disks, run, port + 1, *training, f"trainer.resume={run}")
    metrics = json.loads((disks[0] / "metrics.json").read_text())
    assert metrics["step"] == 40 and metrics["params_agree"]
    assert metrics["params_sha256"] == uninterrupted
    assert (
        "is not on the file system of rank(s) [1] (node-local storage): rank 0 sends it"
        in (disks[0] / "train.log").read_text()
    )
    dcp = (*training, "trainer.max_steps=2", "trainer.checkpoint.format=dcp")
    outputs = _torchrun_on_two_hosts(two_hosts, disks, run, port + 2, *dcp, succeed=False)
    assert "rank(s) [1] do not see the directory" in outputs[0] and "do not share" in outputs[0], outputs[0][-3000:]
