"""check_comm_hook on annotations written as strings (``from __future__ import annotations``).

torch compares the annotation objects themselves, so it refuses every hook of such a module; ours
resolves them, and where a name cannot be resolved reads the string.
"""

import pytest

from ddptrain.ddp.comm_hooks import check_comm_hook

SOURCE = """
from __future__ import annotations
import torch
from ddptrain.ddp import GradBucket as Bucket

def aliased(state, bucket: Bucket) -> torch.futures.Future[torch.Tensor]:
    pass

def unresolved(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    pass

def wrong_bucket(state, bucket: Nope) -> torch.futures.Future:
    pass

def wrong_return(state, bucket: dist.GradBucket) -> Nope:
    pass
"""


@pytest.fixture(scope="module")
def hooks():
    namespace = {}
    exec(compile(SOURCE, "string_annotations.py", "exec"), namespace)  # a module with string annotations
    return namespace


def test_resolvable_string_annotations_are_resolved(hooks):
    check_comm_hook(hooks["aliased"])  # "Bucket" is GradBucket once resolved, not by its name


def test_unresolvable_annotations_are_read_as_names(hooks):
    check_comm_hook(hooks["unresolved"])  # 'dist' is not defined there: "dist.GradBucket" is read
    with pytest.raises(ValueError, match="bucket annotation should be dist.GradBucket"):
        check_comm_hook(hooks["wrong_bucket"])
    with pytest.raises(ValueError, match="return annotation should be torch.futures.Future"):
        check_comm_hook(hooks["wrong_return"])
