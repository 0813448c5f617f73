"""A key-value store that outlives every rank: ``python -m ddptrain.store --port P``.

An elastic job (:mod:`ddptrain.comm.elastic`) keeps its membership in a store that must survive
the loss of any rank, rank 0 included. Normally rank 0 serves the store (``tcp://`` and
``env://``), so this process serves it instead: torch's ``TCPStore`` (the C++ server the gloo and
NCCL groups use) in a process of its own, on one host of the job, until it is stopped with
SIGINT or SIGTERM. The ranks reach it as clients at ``host:port``.

    python -m ddptrain.store --host 0.0.0.0 --port 29400

It prints one line, ``ddptrain store: serving on HOST:PORT``, once clients can connect
(``--port 0`` picks a free port; the line says which).
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import time
from datetime import timedelta

__all__ = ["serve", "main"]


def serve(host: str = "127.0.0.1", port: int = 0):
    """Start serving a store on ``host:port`` (0: a free port) in this process; the
    :class:`ddptrain.comm.store.Store` client of it and the port. The server runs on a C++ thread
    as long as the returned store is referenced."""
    import torch.distributed as tdist

    from .comm.store import Store

    # Bound here, not by torch: torch's server alone listens on every interface, and this keeps a
    # store asked for on 127.0.0.1 on loopback (--host 0.0.0.0 asks for every interface).
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(1024)
    port = listener.getsockname()[1]
    c10d = tdist.TCPStore(
        host,
        port,
        None,
        True,
        timedelta(seconds=60),
        wait_for_workers=False,
        master_listen_fd=listener.fileno(),
    )
    store = Store(c10d, f"tcp store {host}:{port}")
    store._listener = listener  # the C++ server uses this socket: keep it open as long as the store
    return store, port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddptrain.store", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=29400, help="port to listen on (0: a free one)")
    args = parser.parse_args(argv)

    class _Stop(Exception):
        pass

    def on_signal(_signum, _frame):
        raise _Stop

    try:
        store, port = serve(args.host, args.port)
    except OSError as exc:
        print(
            f"ddptrain store: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}. "
            "Pick a free port (--port 0 chooses one) or stop the process that holds it.",
            file=sys.stderr,
        )
        return 1
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    print(f"ddptrain store: serving on {args.host}:{port}", flush=True)
    try:
        while True:
            time.sleep(3600)  # the server runs on its own thread; a stop signal ends the sleep
    except _Stop:
        pass
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
