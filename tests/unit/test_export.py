"""``python -m ddptrain.export``: a finished run's weights, bare (no ``module.``), in a file that
the recipe's model loads with ``strict=True`` and that reproduces ``ddptrain.load_model``."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import ddptrain
from ddptrain.config import Config
from ddptrain.export import bare_weights, main
from ddptrain.loading import find_checkpoint
from ddptrain.trainer.checkpoint import load_checkpoint, save_checkpoint

from .trainer.test_loading import DropoutTrainer, _fit

READ = {"torch": lambda path: torch.load(path, weights_only=True), "safetensors": load_file}
SUFFIX = {"torch": "pt", "safetensors": "safetensors"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished run: a step checkpoint per epoch and the best by eval/loss; read-only for the tests."""
    directory = tmp_path_factory.mktemp("run")
    fitted = _fit(directory, epochs=3, checkpoint={"monitor": "eval/loss", "save_top_k": 1})
    return directory, fitted.val_dataloader().tensors[0]


def _copy(run, tmp_path):
    """A copy of the run to export into (the default output is inside the run directory)."""
    return shutil.copytree(run[0], tmp_path / "run")


def _recipe_model(checkpoint):
    """The recipe's network, freshly built from the run's config, without ddptrain's loading."""
    return DropoutTrainer(Config.from_dict(checkpoint["config"])).configure_model()


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_export_loads_strictly_into_the_recipes_model_and_matches_load_model(run, tmp_path, capsys, fmt):
    directory, x = _copy(run, tmp_path), run[1]
    assert main([str(directory), "--format", fmt]) == 0
    out = directory / "export" / f"model.{SUFFIX[fmt]}"
    source = find_checkpoint(directory, "latest")
    checkpoint = load_checkpoint(source)
    assert capsys.readouterr().out == f"exported weights to {out} from {source} (step {checkpoint['step']})\n"
    assert not any(k.startswith("module.") for k in checkpoint["model"])  # the checkpoint's entry is already bare
    umask = os.umask(0)
    os.umask(umask)
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~umask)  # readable by others, as the umask says
    weights = READ[fmt](out)
    assert weights.keys() == checkpoint["model"].keys()
    model = _recipe_model(checkpoint)
    model.load_state_dict(weights, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), ddptrain.load_model(directory)(x), rtol=0, atol=0)
    if fmt == "safetensors":
        with safe_open(out, "pt") as f:
            assert f.metadata() == {
                "step": str(checkpoint["step"]),
                "source_checkpoint": str(source),
                "trainer_class": checkpoint["trainer_class"],
                "ema": "false",
            }


def test_which_best_exports_the_best_checkpoint(run, tmp_path):
    directory, x = run
    out = tmp_path / "best.pt"
    assert main([str(directory), "--which", "best", "--format", "torch", "--out", str(out)]) == 0
    best, latest = find_checkpoint(directory, "best"), find_checkpoint(directory, "latest")
    weights = torch.load(out, weights_only=True)
    for name, value in load_checkpoint(best)["model"].items():
        assert torch.equal(weights[name], value), name
    assert any(not torch.equal(weights[n], v) for n, v in load_checkpoint(latest)["model"].items())
    model = _recipe_model(load_checkpoint(best))
    model.load_state_dict(weights, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), ddptrain.load_model(directory, which="best")(x), rtol=0, atol=0)


def test_ema_of_a_run_without_ema_is_refused_clearly(run, tmp_path, capsys):
    out = tmp_path / "model.pt"
    assert main([str(run[0]), "--ema", "--format", "torch", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ddptrain: error: ") and "holds no EMA weights" in err and "trainer.ema.decay" in err
    assert not out.exists()


def _rewritten(run, tmp_path, **entries):
    """A run directory whose one checkpoint is the run's latest with ``entries`` replaced."""
    checkpoint = load_checkpoint(find_checkpoint(run[0], "latest"))
    checkpoint.update(entries)
    directory = tmp_path / "edited"
    save_checkpoint(directory / "checkpoints" / "step_000000099.pt", checkpoint)
    return directory, checkpoint


def test_ema_exports_the_checkpoints_ema_weights(run, tmp_path, capsys):
    trained = load_checkpoint(find_checkpoint(run[0], "latest"))["model"]
    average = {k: v + 1 for k, v in trained.items()}
    directory, _ = _rewritten(run, tmp_path, ema={"decay": 0.9, "updates": 3, "weights": average})
    assert main([str(directory), "--ema", "--format", "safetensors"]) == 0
    out = directory / "export" / "model-ema.safetensors"
    assert capsys.readouterr().out.startswith(f"exported EMA weights to {out} from ")
    weights = load_file(out)
    assert weights.keys() == average.keys() and all(torch.equal(weights[k], average[k]) for k in average)
    with safe_open(out, "pt") as f:
        assert f.metadata()["ema"] == "true"
    assert main([str(directory), "--format", "torch"]) == 0  # without --ema: the trained weights
    weights = torch.load(directory / "export" / "model.pt", weights_only=True)
    assert all(torch.equal(weights[k], trained[k]) for k in trained)


def test_a_ddp_prefix_is_stripped_and_only_a_prefix_every_key_has(run, tmp_path):
    trained = load_checkpoint(find_checkpoint(run[0], "latest"))["model"]
    directory, checkpoint = _rewritten(run, tmp_path, model={f"module.{k}": v for k, v in trained.items()})
    assert main([str(directory), "--format", "torch"]) == 0
    weights = torch.load(directory / "export" / "model.pt", weights_only=True)
    _recipe_model(checkpoint).load_state_dict(weights, strict=True)
    mixed = {"module.weight": torch.ones(1), "bias": torch.zeros(1)}  # not a DDP state dict: left alone
    assert bare_weights(mixed) == mixed


def test_tied_weights_are_written_as_safetensors(tmp_path):
    tied = torch.arange(6.0).reshape(2, 3)
    checkpoint = {"format_version": 1, "step": 5, "epoch": 1, "world_size": 1, "optimizer": {}, "sampler": {}}
    checkpoint.update(rng=[], model={"embed.weight": tied, "head.weight": tied, "view": tied.t()})
    save_checkpoint(tmp_path / "checkpoints" / "step_000000005.pt", checkpoint)
    assert main([str(tmp_path / "checkpoints"), "--format", "safetensors"]) == 0
    weights = load_file(tmp_path / "export" / "model.safetensors")  # the run directory above checkpoints/
    assert torch.equal(weights["head.weight"], tied) and torch.equal(weights["view"], tied.t())


def test_a_missing_run_or_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere"), "--format", "torch"]) == 2
    assert capsys.readouterr().err == (
        f"ddptrain: error: {tmp_path / 'nowhere'}: no such file or directory "
        "(pass a run directory or a checkpoint file)\n"
    )
    assert main([str(tmp_path), "--format", "torch"]) == 2
    assert capsys.readouterr().err.startswith("ddptrain: error: ")
    assert not (tmp_path / "export").exists()


def test_without_safetensors_the_format_is_refused_naming_the_extra(run, tmp_path):
    out = tmp_path / "model.safetensors"
    code = (
        "import sys; sys.modules['safetensors'] = None; from ddptrain.export import main; "
        f"sys.exit(main([{str(run[0])!r}, '--format', 'safetensors', '--out', {str(out)!r}]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert done.stderr.startswith("ddptrain: error: --format safetensors needs the safetensors package")
    assert "pip install 'ddptrain[export]'" in done.stderr and "--format torch" in done.stderr
    assert not out.exists()
