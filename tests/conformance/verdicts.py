"""Run the DDP tests of torch's suite for one implementation and write each test's verdict as JSON.

``python -m tests.conformance.verdicts OUT.json [SUBSTRING ...]`` with ``DDPTRAIN_SUITE_DDP``
set (see :mod:`tests.conformance.torch_distributed_suite`); ``scripts/torch_ddp_suite.py`` calls it.
"""

from __future__ import annotations

import json
import sys
import unittest

from tests.conformance.torch_distributed_suite import TorchDistributedSuite, ddp_test_names


class _Verdicts(unittest.TestResult):
    def __init__(self):
        super().__init__()
        self.verdicts: dict[str, dict] = {}

    def _put(self, test, verdict, detail=""):
        self.verdicts[test._testMethodName] = {"verdict": verdict, "detail": detail}

    def addSuccess(self, test):
        self._put(test, "pass")

    def addFailure(self, test, err):
        self._put(test, "fail", self._exc_info_to_string(err, test)[-2000:])

    def addError(self, test, err):
        self._put(test, "error", self._exc_info_to_string(err, test)[-2000:])

    def addSkip(self, test, reason):
        self._put(test, "skip", reason)


def run(patterns: list[str]) -> dict[str, dict]:
    names = [n for n in ddp_test_names() if not patterns or any(p in n for p in patterns)]
    result = _Verdicts()
    unittest.TestSuite(TorchDistributedSuite(n) for n in names).run(result)
    return result.verdicts


if __name__ == "__main__":
    out, patterns = sys.argv[1], sys.argv[2:]
    with open(out, "w") as f:
        json.dump(run(patterns), f, indent=1)
