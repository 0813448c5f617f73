"""Rendezvous and store, in one process: safe bind address, clear timeouts, store operations."""

import socket
import subprocess

import pytest

from ddptrain.comm.store import rendezvous
from ddptrain.comm.types import CommTimeoutError, RendezvousError
from ddptrain.launch import find_free_port


def _listening(port):
    out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True).stdout
    return [line.split()[3] for line in out.splitlines() if line.strip()]


def test_store_listens_on_the_master_address_only():
    port = find_free_port()
    info = rendezvous(f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=5)
    try:
        addrs = _listening(port)
        assert addrs == [f"127.0.0.1:{port}"], addrs
    finally:
        del info


def test_store_operations():
    info = rendezvous(f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1, timeout=5)
    store = info.store
    store.set("k", "v")
    assert store.get("k") == b"v"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.check(["k"]) and not store.check(["missing"])
    with pytest.raises(CommTimeoutError, match=r"missing"):
        store.wait(["missing"], timeout=0.5)
    sub = store.prefixed("g1")
    sub.set("k", "inner")
    assert store.get("k") == b"v" and sub.get("k") == b"inner"


def test_a_rank_that_never_joins_times_out_with_the_count():
    port = find_free_port()
    with pytest.raises(CommTimeoutError) as err:
        rendezvous(f"tcp://127.0.0.1:{port}", rank=0, world_size=3, timeout=1.5)
    text = str(err.value)
    assert f"init_method='tcp://127.0.0.1:{port}'" in text
    assert "expected world size 3, 1 rank(s) arrived; missing rank(s) [1, 2]" in text


def test_port_in_use_is_named():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(RendezvousError, match=rf"cannot listen on 127.0.0.1:{port}.*already in use"):
            rendezvous(f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=2)


def test_rank_out_of_range_and_missing_env(monkeypatch):
    with pytest.raises(RendezvousError, match=r"rank 2 is out of range for world_size 2"):
        rendezvous("tcp://127.0.0.1:1", rank=2, world_size=2, timeout=1)
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RendezvousError, match=r"needs WORLD_SIZE in the environment"):
        rendezvous("env://", timeout=1)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RendezvousError, match=r"needs MASTER_ADDR and MASTER_PORT"):
        rendezvous("env://", timeout=1)


def test_file_init_in_a_missing_directory(tmp_path):
    with pytest.raises(RendezvousError, match=r"does not exist"):
        rendezvous(f"file://{tmp_path}/nope/store", rank=0, world_size=1, timeout=1)


def test_unknown_scheme():
    with pytest.raises(RendezvousError, match=r"use env://, tcp://HOST:PORT or file:///PATH"):
        rendezvous("udp://x:1", rank=0, world_size=1, timeout=1)
