"""ddptrain's bucket assignment against torch's, on the cases of torch's ComputeBucketAssignmentTest.

torch's ``dist._compute_bucket_assignment_by_size(tensors, limits)`` is private, but it is the
rule torch DDP buckets by; ours (:func:`ddptrain.ddp.assign_buckets`) takes the first limit as
``first_cap_bytes`` and the last as the cap. Both are asked here, live, on the same tensors.
"""

import pytest
import torch
import torch.distributed as tdist

from ddptrain.ddp import assign_buckets

F, D = torch.float, torch.double
CASES = {
    # name in torch's test: (tensors as (numel, dtype), limits in bytes)
    "single_limit_single_dtype": ([(100, F), (200, F), (100, F), (50, F)], [400]),
    "single_limit_multi_dtype": ([(50, F), (25, D)] * 3, [400]),
    "multi_limit_single_dtype": ([(10, F)] * 4, [40, 80]),
    "multi_limit_multi_dtype": ([(50, F), (25, D)] * 3, [200, 400]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_assignment_equals_torch_ddp(name):
    specs, limits = CASES[name]
    tensors = [torch.empty(n, dtype=dtype) for n, dtype in specs]
    theirs, _ = tdist._compute_bucket_assignment_by_size(tensors, limits)
    ours = assign_buckets(
        [t.numel() * t.element_size() for t in tensors],
        [(t.dtype, t.device) for t in tensors],
        limits[-1],
        first_cap_bytes=limits[0],
        reverse=False,
    )
    assert ours == [list(b) for b in theirs]
