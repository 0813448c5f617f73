"""Two hosts on one machine: two network namespaces joined by a veth pair, one torchrun per host.

Needs root and `ip netns` (iproute2); skips with the reason otherwise. Only the namespaces' own
addresses (10.231.<n>.1/.2, made here and removed afterwards) and loopback are used.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
