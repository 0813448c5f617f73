"""Key-value store and rendezvous: how processes find each other.

``rendezvous(init_method, rank, world_size, timeout)`` turns ``env://``, ``tcp://host:port`` or
``file:///path`` into a :class:`Store` shared by all ranks, and only returns once every rank has
arrived — or raises :class:`RendezvousError`/:class:`CommTimeoutError` saying which init method,
which world size, and how many ranks did arrive.

The stores themselves are torch's C++ ``TCPStore``/``FileStore`` (the same ones the gloo and NCCL
process groups need to exchange addresses); :class:`Store` gives them a small, documented
interface with timeouts in seconds, which the rest of ddptrain uses.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as tdist

from .. import envvars
from .types import CommTimeoutError, RendezvousError, as_timedelta

DEFAULT_INIT_TIMEOUT = timedelta(minutes=30)


class Store:
    """A key-value store shared by every rank of a job.

    Values are bytes (``str`` is encoded as UTF-8). ``get`` and ``wait`` block until the keys
    exist, at most ``timeout`` seconds (default: the store's own timeout).
    """

    def __init__(self, c10d_store: tdist.Store, description: str = "store"):
        self.c10d = c10d_store
        self.description = description

    def set(self, key: str, value: str | bytes) -> None:
        self.c10d.set(key, value.encode() if isinstance(value, str) else value)

    def get(self, key: str, timeout: float | timedelta | None = None) -> bytes:
        self.wait([key], timeout)
        return self.c10d.get(key)

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (created at 0) and return the new value."""
        return int(self.c10d.add(key, int(amount)))

    def check(self, keys: Iterable[str]) -> bool:
        """True if every key exists, without waiting."""
        return bool(self.c10d.check(list(keys)))

    def delete(self, key: str) -> bool:
        return bool(self.c10d.delete_key(key))

    def wait(self, keys: Iterable[str], timeout: float | timedelta | None = None) -> None:
        keys = list(keys)
        td = as_timedelta(timeout)
        try:
            if td is None:
                self.c10d.wait(keys)
            else:
                self.c10d.wait(keys, td)
        except RuntimeError as exc:  # torch raises DistStoreError (a RuntimeError) on timeout
            if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                missing = [k for k in keys if not self.c10d.check([k])]
                raise CommTimeoutError(
                    f"waited {td.total_seconds() if td else self.c10d.timeout.total_seconds():g} s on "
                    f"{self.description} for keys {missing}; the ranks that should set them did not"
                ) from exc
            raise

    def prefixed(self, prefix: str) -> Store:
        """A view of this store whose keys all start with ``prefix/`` (used per subgroup)."""
        return Store(tdist.PrefixStore(prefix + "/", self.c10d), f"{self.description}[{prefix}]")


def connect(address: str, timeout_s: float = 60.0) -> Store:
    """A client of the store served at ``address``, ``HOST:PORT`` (``python -m ddptrain.store``
    prints it); ``timeout_s`` bounds the connection and every wait on the store."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise RendezvousError(
            f"store address {address!r} must look like HOST:PORT (python -m ddptrain.store prints it)"
        )
    return Store(tdist.TCPStore(host, int(port), None, False, timedelta(seconds=timeout_s)), f"tcp store {address}")


@dataclass
class RendezvousInfo:
    """What a rendezvous settled: who we are and where the store lives."""

    store: Store
    rank: int
    world_size: int
    init_method: str
    master_addr: str | None = None


def _env_int(name: str, given: int, init_method: str) -> int:
    if given is not None and given >= 0:
        return given
    value = os.environ.get(name)
    if value is None:
        raise RendezvousError(
            f"init_method={init_method!r} needs {name} in the environment (or pass "
            f"{name.lower()}= to init_process_group); it is not set. Launch with `torchrun`, "
            "`python -m ddptrain`, or set MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK yourself."
        )
    try:
        return int(value)
    except ValueError:
        raise RendezvousError(f"{name}={value!r} is not an integer (init_method={init_method!r})") from None


def _check_rank(rank: int, world_size: int, init_method: str) -> None:
    if world_size < 1:
        raise RendezvousError(f"world_size must be at least 1, got {world_size} (init_method={init_method!r})")
    if not 0 <= rank < world_size:
        raise RendezvousError(
            f"rank {rank} is out of range for world_size {world_size}: ranks run from 0 to "
            f"{world_size - 1} (init_method={init_method!r}). Check RANK/WORLD_SIZE or the rank= argument."
        )


def is_loopback(host: str) -> bool:
    try:
        return all(info[4][0].startswith("127.") or info[4][0] == "::1" for info in socket.getaddrinfo(host, None))
    except socket.gaierror:
        return False


def _listen_socket(host: str, port: int, init_method: str) -> socket.socket:
    """Rank 0's listening socket, bound to ``host``'s address only (not every interface).

    torch's TCPStore alone listens on all interfaces; handing it a socket bound here keeps a
    local job's store on loopback. ``DDPTRAIN_STORE_BIND_ALL=1`` listens everywhere on purpose.
    """
    bind_host = "" if envvars.get_flag("DDPTRAIN_STORE_BIND_ALL") else host
    family = socket.AF_INET6 if ":" in host and bind_host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bind_host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == 98:  # EADDRINUSE
            raise RendezvousError(
                f"rank 0 cannot listen on {host}:{port} for init_method={init_method!r}: the port is "
                f"already in use (another job, or a previous run still alive). Pick a free port "
                f"(MASTER_PORT) or stop the process using it (`ss -ltnp | grep {port}`)."
            ) from exc
        raise RendezvousError(
            f"rank 0 cannot listen on {host}:{port} for init_method={init_method!r}: {exc}. "
            "MASTER_ADDR must be an address of the machine running rank 0."
        ) from exc
    sock.listen(1024)
    return sock


def _tcp_store(
    host: str, port: int, rank: int, world_size: int, timeout: timedelta, init_method: str, serve: bool = True
) -> Store:
    is_server = serve and rank == 0
    listener = _listen_socket(host, port, init_method) if is_server else None
    try:
        c10d = tdist.TCPStore(
            host,
            port,
            world_size,
            is_server,
            timeout,
            wait_for_workers=False,
            master_listen_fd=None if listener is None else listener.fileno(),
        )
    except Exception as exc:  # DistNetworkError / RuntimeError: translate what users can act on
        text = str(exc)
        if rank == 0 and ("address already in use" in text.lower() or "EADDRINUSE" in text):
            raise RendezvousError(
                f"rank 0 cannot listen on {host}:{port} for init_method={init_method!r}: the port is "
                f"already in use (another job, or a previous run still alive). Pick a free port "
                f"(MASTER_PORT) or stop the process using it (`ss -ltnp | grep {port}`)."
            ) from exc
        if "timed out" in text.lower() or "timeout" in text.lower():
            raise CommTimeoutError(
                f"rank {rank} could not reach the rendezvous store at {host}:{port} within "
                f"{timeout.total_seconds():g} s (init_method={init_method!r}, world_size={world_size}): "
                "rank 0 never started listening there. Check that rank 0 is running and that "
                "MASTER_ADDR/MASTER_PORT agree on every rank."
            ) from exc
        raise RendezvousError(
            f"could not open the TCP store at {host}:{port} (init_method={init_method!r}, rank {rank}): {text}"
        ) from exc
    store = Store(c10d, f"tcp store {host}:{port}")
    store._listener = listener  # the C++ server uses this socket; keep it open as long as the store
    return store


def _file_store(path: str, world_size: int, init_method: str) -> Store:
    directory = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(directory):
        raise RendezvousError(
            f"init_method={init_method!r}: directory {directory!r} does not exist; the shared file "
            "must live in an existing directory that every rank can write (e.g. a shared filesystem)."
        )
    if not os.access(directory, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise RendezvousError(
            f"init_method={init_method!r}: {path!r} is not writable by this process; every rank "
            "must be able to create and lock that file. Choose a writable path."
        )
    try:  # os.access trusts root; only creating the file proves torch's FileStore can (else it retries 300 s)
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o644))
    except OSError as exc:
        raise RendezvousError(
            f"init_method={init_method!r}: cannot create {path!r} ({exc.strerror}); every rank must be "
            "able to create and lock that file. Choose a path on a writable filesystem."
        ) from exc
    try:
        return Store(tdist.FileStore(path, world_size), f"file store {path}")
    except Exception as exc:
        raise RendezvousError(f"init_method={init_method!r}: could not open the file store: {exc}") from exc


_AGENT_STORE_JOINS = itertools.count()
"""How many times this process joined torchrun's agent store (each join gets keys of its own)."""


def rendezvous(
    init_method: str | None, rank: int = -1, world_size: int = -1, timeout: float | timedelta | None = None
) -> RendezvousInfo:
    """Meet the other ranks and return the shared store once all ``world_size`` have arrived.

    Args:
        init_method: ``env://`` (default), ``tcp://host:port`` or ``file:///path``.
        rank, world_size: this process' rank and the job size; ``-1`` reads ``RANK``/``WORLD_SIZE``
            (``env://`` only; other methods need them given, or set in the environment).
        timeout: how long to wait for every rank (seconds or timedelta; default 30 min).

    Raises:
        RendezvousError: bad URL, missing variable, port in use, unwritable file.
        CommTimeoutError: not every rank arrived in time (says how many did).
    """
    init_method = init_method or "env://"
    timeout = as_timedelta(timeout, DEFAULT_INIT_TIMEOUT)
    url = urllib.parse.urlparse(init_method)
    master_addr = None
    if url.scheme == "env":
        world_size = _env_int("WORLD_SIZE", world_size, init_method)
        rank = _env_int("RANK", rank, init_method)
        _check_rank(rank, world_size, init_method)
        master_addr = os.environ.get("MASTER_ADDR")
        port = os.environ.get("MASTER_PORT")
        if not master_addr or not port:
            missing = [n for n, v in (("MASTER_ADDR", master_addr), ("MASTER_PORT", port)) if not v]
            raise RendezvousError(
                f"init_method='env://' needs {' and '.join(missing)} in the environment: the address "
                "and a free port of the machine running rank 0 (e.g. MASTER_ADDR=127.0.0.1 "
                "MASTER_PORT=29500), or use a launcher (`torchrun`, `python -m ddptrain`)."
            )
        try:
            port_num = int(port)
        except ValueError:
            raise RendezvousError(f"MASTER_PORT={port!r} is not a port number") from None
        # Under torchrun the agent already serves a store at MASTER_ADDR:MASTER_PORT: every rank
        # joins it as a client, in a namespace of its own per run and restart.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        store = _tcp_store(master_addr, port_num, rank, world_size, timeout, init_method, serve=not agent_store)
        if agent_store:
            run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
            namespace = f"ddptrain/{run}/restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            # The agent's store outlives a group: a second group in the same processes (Trainer.test
            # after fit) must not read the first one's keys. Every rank creates its groups in the same order.
            again = next(_AGENT_STORE_JOINS)
            store = store.prefixed(namespace + (f"/join{again}" if again else ""))
    elif url.scheme == "tcp":
        if not url.hostname or not url.port:
            raise RendezvousError(f"init_method={init_method!r} must look like tcp://HOST:PORT")
        world_size = _env_int("WORLD_SIZE", world_size, init_method)
        rank = _env_int("RANK", rank, init_method)
        _check_rank(rank, world_size, init_method)
        master_addr = url.hostname
        store = _tcp_store(url.hostname, url.port, rank, world_size, timeout, init_method)
    elif url.scheme == "file":
        path = urllib.parse.unquote(url.path)
        if not path:
            raise RendezvousError(f"init_method={init_method!r} must look like file:///absolute/path")
        world_size = _env_int("WORLD_SIZE", world_size, init_method)
        rank = _env_int("RANK", rank, init_method)
        _check_rank(rank, world_size, init_method)
        store = _file_store(path, world_size, init_method)
        store.c10d.set_timeout(timeout)
    else:
        raise RendezvousError(f"unknown init_method {init_method!r}: use env://, tcp://HOST:PORT or file:///PATH")
    store.c10d.set_timeout(timeout)
    wait_for_all_ranks(store, rank, world_size, timeout, f"init_method={init_method!r}")
    return RendezvousInfo(store, rank, world_size, init_method, master_addr)


def wait_for_all_ranks(
    store: Store, rank: int, world_size: int, timeout: timedelta, what: str, key: str = "ddptrain/rendezvous"
) -> None:
    """Count this rank in under ``key`` and wait until ``world_size`` ranks have; explain a timeout."""
    store.set(f"{key}/rank{rank}", b"1")
    arrived = store.add(f"{key}/arrived", 1)
    deadline = time.monotonic() + timeout.total_seconds()
    delay = 0.001
    while arrived < world_size:
        if time.monotonic() >= deadline:
            missing = [r for r in range(world_size) if not store.check([f"{key}/rank{r}"])]
            raise CommTimeoutError(
                f"rendezvous timed out after {timeout.total_seconds():g} s ({what}): expected world "
                f"size {world_size}, {arrived} rank(s) arrived; missing rank(s) {missing}. Start every "
                "rank with the same init method and world size, or raise the timeout."
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
        arrived = store.add(f"{key}/arrived", 0)
