"""gloo and NCCL through torch's own C++ process groups (``torch._C._distributed_c10d``).

We construct ``ProcessGroupGloo``/``ProcessGroupNCCL`` objects directly on our store instead of
calling ``torch.distributed.init_process_group``: that keeps torch's global default group free
for user code that initialises ``torch.distributed`` itself, and it adds no Python layer to the
hot path (the 1 MiB+ all-reduce goes straight to the C++ backend). :class:`TorchProcessGroup`
also adapts a group that user code created through ``torch.distributed`` (``from_torch``).
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as tdist
from torch._C import _distributed_c10d as c10d

from ..forensics import explain_group
from ..process_group import ProcessGroup, check_list_len, check_same_shape
from ..store import Store, is_loopback
from ..types import CommError, CommTimeoutError, ReduceOp, Work, check_avg_dtype, to_reduce_op

_ABORT_SLICE_S = 0.05  # how soon a wait on an abortable group notices abort()


class _Aborted(CommError):
    """A wait ended by :meth:`TorchProcessGroup.abort`."""


_C10D_OPS = {
    ReduceOp.SUM: c10d.ReduceOp.SUM,
    ReduceOp.PRODUCT: c10d.ReduceOp.PRODUCT,
    ReduceOp.MAX: c10d.ReduceOp.MAX,
    ReduceOp.MIN: c10d.ReduceOp.MIN,
    ReduceOp.AVG: c10d.ReduceOp.AVG,
}


class TorchWork(Work):
    """Wraps a c10d ``Work`` and turns its failures into errors that name the operation."""

    def __init__(self, op_name: str, outputs, c10d_work, group: TorchProcessGroup, seq: int = 0):
        super().__init__(op_name, outputs)
        self._work = c10d_work
        self._group = group
        self._seq = seq
        self._waited = False
        self._wait_lock = threading.Lock()

    def _wait(self, timeout: timedelta | None) -> None:
        # gloo's send/recv works count completions: a second wait() on the same work would block
        # for a message that never comes. Wait on the backend once; later calls return at once.
        with self._wait_lock:
            if self._waited:
                return
            try:
                if self._group.abortable:
                    self._wait_in_slices(timeout)
                elif timeout is None:
                    self._work.wait()
                else:
                    self._work.wait(timeout)
            except _Aborted:
                raise
            except RuntimeError as exc:
                raise self._group.translate_error(self.op_name, exc, self._seq, wait_timeout=timeout) from exc
            except BaseException:  # a signal stopped the wait (Ctrl-C, a launcher's SIGTERM): the work is left
                self._group._failed = True  # running, perhaps stuck on a dead peer; destroy() must not join it
                raise
            self._waited = True

    def _wait_in_slices(self, timeout: timedelta | None) -> None:
        """Wait ``_ABORT_SLICE_S`` at a time, so that :meth:`TorchProcessGroup.abort` from another
        thread ends the wait. A slice that ends before the work did raises torch's "Operation timed
        out!" and leaves the work running; a work that ended with an error is raised as it is.

        A work can complete between its slice timing out and the check after: then it succeeded or
        failed on its own, and the slice's "timed out" is not its outcome (taking it for one failed
        a rank whose collective had succeeded everywhere, and the others waited on it in the next)."""
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        while True:
            if self._group.abort_reason is not None:
                raise self._group.aborted_error(self.op_name)
            left = _ABORT_SLICE_S if deadline is None else min(_ABORT_SLICE_S, deadline - time.monotonic())
            try:
                self._work.wait(timedelta(seconds=max(left, 0.001)))
                return
            except RuntimeError:
                if self._work.is_completed():
                    if self._work.is_success():
                        return
                    raise
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    def is_completed(self) -> bool:
        # gloo leaves some works (reduce_scatter) "not completed" after a successful wait()
        return self._waited or self._work.is_completed()

    def exception(self):
        return self._work.exception() if self._work.is_completed() else None

    def get_future(self) -> torch.futures.Future:
        def finish(fut):
            fut.wait()
            self._finalize()
            return self.outputs

        try:
            return self._work.get_future().then(finish)
        except RuntimeError:
            # gloo has no future for some operations (send, recv, reduce_scatter): wait on a thread.
            fut: torch.futures.Future = torch.futures.Future()

            def waiter():
                try:
                    self.wait()
                    fut.set_result(self.outputs)
                except BaseException as exc:  # noqa: BLE001 - deliver the failure to the future
                    fut.set_exception(exc)

            threading.Thread(target=waiter, daemon=True, name=f"ddptrain-{self.op_name}-future").start()
            return fut


class TorchProcessGroup(ProcessGroup):
    """A ddptrain group over a torch c10d backend object (gloo or NCCL)."""

    def __init__(
        self,
        pg,
        backend: str,
        rank: int,
        size: int,
        global_ranks: Sequence[int],
        timeout: timedelta,
        store: Store | None = None,
        master_addr: str | None = None,
        name: str = "world",
        native_avg: bool = False,
    ):
        # NCCL moves CUDA tensors only: its group lives on the device current at creation
        # (the trainer selects cuda:{local_rank} before it makes the group).
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        super().__init__(rank, size, global_ranks, timeout, name, device)
        self.pg = pg
        self.backend = backend
        self.store = store
        self.master_addr = master_addr
        self._native_avg = native_avg
        self._torch_group = None  # set when adapting a torch.distributed group
        self._collective_seq = 0  # same count on every rank: collectives are called in one order
        self._failed = False  # an operation failed: the backend may hold a stuck one
        self.abortable = False  # waits in slices that notice abort() (elastic jobs); a plain group blocks
        self.abort_reason: str | None = None
        _OWN_BACKENDS.add(self)

    def abort(self, reason: str) -> None:
        """End every wait on this group, now and later, with a ``CommError`` naming ``reason``
        (the members of an elastic job are agreeing on a new group). Works on a group made
        ``abortable`` before its operations started (gloo), and on NCCL's own abort."""
        self.abort_reason = reason
        self._failed = True
        if self.backend == "nccl" and hasattr(self.pg, "abort"):
            self.pg.abort()

    def aborted_error(self, op: str) -> CommError:
        """The error of ``op`` (waited on, or called) on this group after :meth:`abort`."""
        return _Aborted(f"{op} on group {self.name!r} was aborted: {self.abort_reason}")

    @classmethod
    def from_torch(cls, group=None) -> TorchProcessGroup:
        """Adapt a ``torch.distributed`` group (default: its world group) to our interface."""
        group = group or tdist.group.WORLD
        backend = str(tdist.get_backend(group))
        ranks = tdist.get_process_group_ranks(group)
        pg = cls(
            group,
            backend,
            group.rank(),
            group.size(),
            ranks,
            timeout=timedelta(minutes=30),
            name="torch.distributed",
            native_avg=(backend == "nccl"),
        )
        pg._torch_group = group
        return pg

    # -- plumbing ---------------------------------------------------------------------------
    def _missing_ranks(self, op: str, seq: int) -> str:
        """Ask the store which ranks reached collective #seq too; '' if the store can't tell.

        Every rank whose collective times out checks in under the same key; after a short grace
        period the ranks that did not are the ones that never arrived (stuck elsewhere or dead).
        """
        if self.store is None or not seq:
            return ""
        import time

        try:
            key = f"timeout/{seq}"
            self.store.set(f"{key}/rank{self._rank}", op)
            deadline = time.monotonic() + min(1.0, self.timeout.total_seconds())
            while time.monotonic() < deadline:
                if self.store.check([f"{key}/rank{r}" for r in range(self._size)]):
                    break
                time.sleep(0.05)
            missing = [self.global_ranks[r] for r in range(self._size) if not self.store.check([f"{key}/rank{r}"])]
        except Exception:  # noqa: BLE001 - the store may be gone with rank 0; then we cannot tell
            return ""
        if not missing:
            return " Every rank reached this collective; it may have called it with different arguments."
        return f" Rank(s) {missing} never arrived at this {op} (collective #{seq} of the group)."

    def translate_error(
        self, op: str, exc: BaseException, seq: int = 0, wait_timeout: timedelta | None = None
    ) -> CommError:
        self._failed = True
        text = str(exc)
        where = f"{op} on group {self.name!r} ({self.backend}, rank {self._rank} of {self._size})"
        low = text.lower()
        if wait_timeout is not None and ("timed out" in low or "timeout" in low):
            # the caller's own, shorter wait: peers may just be slower, so no store probe
            return CommTimeoutError(
                f"{where} did not complete within the {wait_timeout.total_seconds():g} s given to "
                f"wait(); the operation may still finish. Backend said: {text.splitlines()[0]}"
            )
        if "timed out" in low or "timeout" in low:
            missing, ledger = self._missing_ranks(op, seq), explain_group(self)
            if "diverged" in ledger:  # who checked in late follows from the divergence: the ledger says it better
                missing = ""
            return CommTimeoutError(
                f"{where} timed out after {self.timeout.total_seconds():g} s: some rank of "
                f"{self.global_ranks} did not join the operation (it may be stuck, dead, or calling "
                f"a different collective).{missing} Backend said: {text.splitlines()[0]}{ledger}"
            )
        if "connection closed by peer" in low or "connection reset" in low or "broken pipe" in low:
            return CommError(
                f"{where} failed: a peer closed its connection — a rank of {self.global_ranks} "
                f"probably exited or crashed. Backend said: {text.splitlines()[0]}{explain_group(self)}"
            )
        if "size" in low or "mismatch" in low or "length" in low:
            return CommError(
                f"{where} failed because ranks passed tensors of different sizes or dtypes; every "
                f"rank must pass the same shape and dtype. Backend said: {text.splitlines()[0]}"
                f"{explain_group(self)}"
            )
        return CommError(f"{where} failed: {text}")

    def _contiguous(self, tensor: torch.Tensor):
        """(tensor the backend may use, copy-back or None): backends read raw storage, so a
        non-contiguous view goes through a contiguous copy instead of corrupting its neighbours.
        A sparse tensor goes as it is (gloo all-reduces sparse COO tensors)."""
        if tensor.layout != torch.strided or tensor.is_contiguous():
            return tensor, None
        staged = tensor.contiguous()
        return staged, (lambda: tensor.copy_(staged))

    def _run(self, op_name: str, outputs, launch) -> Work:
        self.check_alive(op_name)
        if self.abort_reason is not None:
            raise self.aborted_error(op_name)
        seq = 0
        if op_name not in ("send", "recv"):
            self._collective_seq += 1
            seq = self._collective_seq
        try:
            work = launch()
        except RuntimeError as exc:
            raise self.translate_error(op_name, exc, seq) from exc
        return TorchWork(op_name, outputs, work, self, seq)

    def _reduce_op(self, op, tensor: torch.Tensor, op_name: str):
        """c10d op to run, plus whether a division by size must follow (AVG without native AVG)."""
        op = to_reduce_op(op)
        check_avg_dtype(op, tensor, op_name)
        if op is ReduceOp.AVG and not self._native_avg:
            return c10d.ReduceOp.SUM, True
        return _C10D_OPS[op], False

    # -- point to point ---------------------------------------------------------------------
    def _send(self, tensor, dst, tag=0):
        self._check_peer(dst, "send", "dst")
        buf, _ = self._contiguous(tensor)
        return self._run("send", [tensor], lambda: self.pg.send([buf], dst, tag))

    def _recv(self, tensor, src, tag=0):
        self._check_peer(src, "recv", "src")
        buf, back = self._contiguous(tensor)
        work = self._run("recv", [tensor], lambda: self.pg.recv([buf], src, tag))
        if back:
            work.add_post_processing(back)
        return work

    # -- collectives ------------------------------------------------------------------------
    def _broadcast(self, tensor, src):
        self._check_peer(src, "broadcast", "src")
        opts = c10d.BroadcastOptions()
        opts.rootRank = src
        buf, back = self._contiguous(tensor)
        work = self._run("broadcast", [tensor], lambda: self.pg.broadcast([buf], opts))
        if back:
            work.add_post_processing(back)
        return work

    def _all_reduce(self, tensor, op=ReduceOp.SUM):
        c_op, divide = self._reduce_op(op, tensor, "all_reduce")
        opts = c10d.AllreduceOptions()
        opts.reduceOp = c_op
        buf, back = self._contiguous(tensor)
        work = self._run("all_reduce", [tensor], lambda: self.pg.allreduce([buf], opts))
        if divide:
            work.add_post_processing(lambda: buf.div_(self._size))
        if back:
            work.add_post_processing(back)
        return work

    def _reduce(self, tensor, dst, op=ReduceOp.SUM):
        self._check_peer(dst, "reduce", "dst")
        c_op, divide = self._reduce_op(op, tensor, "reduce")
        opts = c10d.ReduceOptions()
        opts.reduceOp = c_op
        opts.rootRank = dst
        buf, back = self._contiguous(tensor)
        work = self._run("reduce", [tensor], lambda: self.pg.reduce([buf], opts))
        if divide and self._rank == dst:
            work.add_post_processing(lambda: buf.div_(self._size))
        if back and self._rank == dst:
            work.add_post_processing(back)
        return work

    def _all_gather(self, tensor_list, tensor):
        check_list_len("all_gather", "tensor_list", tensor_list, self._size)
        check_same_shape("all_gather", "tensor_list", tensor, tensor_list)
        return self._run(
            "all_gather", tensor_list, lambda: self.pg.allgather([list(tensor_list)], [tensor], c10d.AllgatherOptions())
        )

    def _gather(self, tensor, gather_list, dst):
        self._check_peer(dst, "gather", "dst")
        opts = c10d.GatherOptions()
        opts.rootRank = dst
        if self._rank == dst:
            check_list_len("gather", "gather_list", gather_list, self._size)
            check_same_shape("gather", "gather_list", tensor, gather_list)
            outputs = [list(gather_list)]
        else:
            outputs = []
        return self._run("gather", gather_list or [], lambda: self.pg.gather(outputs, [tensor], opts))

    def _scatter(self, tensor, scatter_list, src):
        self._check_peer(src, "scatter", "src")
        opts = c10d.ScatterOptions()
        opts.rootRank = src
        if self._rank == src:
            check_list_len("scatter", "scatter_list", scatter_list, self._size)
            check_same_shape("scatter", "scatter_list", tensor, scatter_list)
            inputs = [list(scatter_list)]
        else:
            inputs = []
        return self._run("scatter", [tensor], lambda: self.pg.scatter([tensor], inputs, opts))

    def _reduce_scatter(self, output, input_list, op=ReduceOp.SUM):
        check_list_len("reduce_scatter", "input_list", input_list, self._size)
        check_same_shape("reduce_scatter", "input_list", output, input_list)
        c_op, divide = self._reduce_op(op, output, "reduce_scatter")
        opts = c10d.ReduceScatterOptions()
        opts.reduceOp = c_op
        work = self._run("reduce_scatter", [output], lambda: self.pg.reduce_scatter([output], [list(input_list)], opts))
        if divide:
            work.add_post_processing(lambda: output.div_(self._size))
        return work

    def _all_to_all(self, output_list, input_list):
        check_list_len("all_to_all", "output_list", output_list, self._size)
        check_list_len("all_to_all", "input_list", input_list, self._size)
        dtype = input_list[0].dtype
        if any(t.dtype != dtype for t in list(input_list) + list(output_list)):
            raise ValueError("all_to_all: every input and output tensor must have the same dtype")
        # gloo implements only the flat variant: pack, exchange with split sizes, unpack.
        send = torch.cat([t.reshape(-1) for t in input_list])
        recv = torch.empty(sum(t.numel() for t in output_list), dtype=dtype, device=send.device)
        in_splits = [t.numel() for t in input_list]
        out_splits = [t.numel() for t in output_list]
        work = self._run(
            "all_to_all",
            output_list,
            lambda: self.pg.alltoall_base(recv, send, out_splits, in_splits, c10d.AllToAllOptions()),
        )

        def unpack():
            for out, chunk in zip(output_list, torch.split(recv, out_splits)):
                out.copy_(chunk.view_as(out))

        work.add_post_processing(unpack)
        return work

    def _barrier(self):
        return self._run("barrier", [], lambda: self.pg.barrier(c10d.BarrierOptions()))

    # -- groups -----------------------------------------------------------------------------
    def _new_subgroup(self, ranks, name, timeout):
        if self._torch_group is not None:  # groups of torch.distributed are made by torch.distributed
            global_ranks = [self.global_ranks[r] for r in ranks]
            tg = tdist.new_group(global_ranks, timeout=timeout)
            if self._rank not in ranks:
                return None
            return TorchProcessGroup.from_torch(tg)
        if self._rank not in ranks:
            return None
        sub_store = self.store.prefixed(name)
        sub_rank = list(ranks).index(self._rank)
        global_ranks = [self.global_ranks[r] for r in ranks]
        maker = make_gloo_group if self.backend == "gloo" else make_nccl_group
        args = (sub_store, sub_rank, len(ranks), timeout)
        group = maker(*args, self.master_addr) if self.backend == "gloo" else maker(*args)
        group.global_ranks = global_ranks
        group.name = name
        return group

    def destroy(self):
        if not self._destroyed and self._torch_group is None:
            try:
                self.pg.shutdown()
            except Exception:  # noqa: BLE001 - best effort; older torch lacks shutdown on gloo
                pass
            self._release_backend()
        super().destroy()

    def _release_backend(self) -> None:
        """Drop our reference to the C++ backend, so that it is destroyed now, while Python runs.

        gloo's worker threads destroy each finished work themselves, a moment after ``wait()``
        returns, and that releases the work's tensors, which takes the GIL. A process that exits
        at once (the end of a training run) can be finalizing Python by then: the thread that
        asks for the GIL is ended in C++ code, and the process dies of SIGABRT ("terminate called
        without an active exception") after a run that succeeded. Destroying the backend joins
        those threads first (torch releases the GIL for it). Not after a failed operation: a
        thread may be stuck on a dead peer, and joining it would hang the exit.
        """
        _OWN_BACKENDS.discard(self)
        if not self._failed and self._torch_group is None:
            self.pg = None


# Groups whose C++ backend we created and still hold: a program that ends without
# destroy_process_group() gets its gloo threads joined at exit all the same (before Python
# finalizes; see ``_release_backend``). NCCL's backends are left to torch's own teardown.
_OWN_BACKENDS: weakref.WeakSet[TorchProcessGroup] = weakref.WeakSet()


@atexit.register
def _release_gloo_backends_at_exit() -> None:
    for group in list(_OWN_BACKENDS):
        if group.backend == "gloo":
            group._release_backend()


def _gloo_device(master_addr: str | None):
    import os

    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    if iface:
        return c10d.ProcessGroupGloo.create_device(interface=iface.split(",")[0])
    if master_addr and is_loopback(master_addr):
        # Everyone is on this machine: talk over loopback, whatever the hostname resolves to.
        return c10d.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    if master_addr:
        # Use the local address that routes to rank 0: the machine's hostname may resolve to an
        # address the peers cannot reach (containers, network namespaces, several NICs).
        import socket

        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((master_addr, 9))  # UDP connect sends nothing; it only picks a route
                return c10d.ProcessGroupGloo.create_device(hostname=probe.getsockname()[0])
        except OSError:
            pass
    return c10d.ProcessGroupGloo.create_default_device()


def make_gloo_group(
    store: Store, rank: int, size: int, timeout: timedelta, master_addr: str | None = None
) -> TorchProcessGroup:
    opts = c10d.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [_gloo_device(master_addr)]
    pg = c10d.ProcessGroupGloo(store.c10d, rank, size, opts)
    return TorchProcessGroup(pg, "gloo", rank, size, list(range(size)), timeout, store, master_addr)


def make_nccl_group(store: Store, rank: int, size: int, timeout: timedelta) -> TorchProcessGroup:
    if not torch.cuda.is_available():
        raise CommError(
            "backend 'nccl' needs CUDA GPUs, and torch.cuda.is_available() is False on "
            "this machine; use backend 'gloo' for CPU tensors."
        )
    if not tdist.is_nccl_available():
        raise CommError("this torch build has no NCCL; use backend 'gloo' (or install a CUDA build of torch)")
    opts = c10d.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    pg = c10d.ProcessGroupNCCL(store.c10d, rank, size, opts)
    return TorchProcessGroup(pg, "nccl", rank, size, list(range(size)), timeout, store, native_avg=True)
