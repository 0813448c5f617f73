"""trainer.precision from the command line. bf16-mixed on CPU trains through the CLI in
tests/e2e/test_cli.py::test_smoke_run_mnist[mnist_fast] (the recipe's precision): its smoke check
passes with parameters identical on every rank."""

import pytest

from tests.conftest import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_16_mixed_on_cpu_is_a_short_error(tmp_path):
    proc = run_cli("recipe=mnist", "trainer.precision=16-mixed", cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "trainer.precision=16-mixed needs trainer.device=cuda" in proc.stderr
