"""The DDP unit tests run ranks as threads of one process (``ddptrain.testing.run_threaded``)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """One intra-op thread per op: the ranks already are the parallelism, and torch's pool on top
    of them only contends (on a loaded 2-core machine a tiny reference run took 15 s instead of 0.3 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
