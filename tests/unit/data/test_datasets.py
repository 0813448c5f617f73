"""Datasets: finding MNIST-style files offline, validating them, and the synthetic task."""

import ast
import dataclasses
import gzip
import os
import subprocess
import sys
import urllib.error
from pathlib import Path

import pytest
import torch

import ddptrain.data.datasets as ds
from ddptrain.data import (
    DATASET_NAMES,
    DatasetCorruptError,
    DatasetNotFoundError,
    SyntheticClassification,
    build_dataset,
    fashion_mnist,
    mnist,
    prepare_dataset_files,
    resolve_data_root,
)

REPO = Path(__file__).resolve().parents[3]
DEBIAN_FASHION = Path("/usr/share/datasets/fashion-mnist")
GZ_NAMES = [
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
]
MNIST_TRAIN_LABEL_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]


def snapshot(directory):
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(directory).iterdir())


@pytest.fixture
def no_sources(monkeypatch, tmp_path):
    """Hide every built-in source so that only what a test provides is found."""
    monkeypatch.delenv(ds.DATA_SOURCES_ENV, raising=False)
    monkeypatch.delenv(ds.DATA_ROOT_ENV, raising=False)
    monkeypatch.setattr(ds, "_FASHION_MNIST", dataclasses.replace(ds._FASHION_MNIST, system_dir=None))


@pytest.fixture(scope="session")
def mnist_raw(mnist_root):
    """The four uncompressed MNIST files, as ddptrain's loader installed them (a read-only source here)."""
    return mnist_root / "MNIST" / "raw"


@pytest.fixture(scope="module")
def mnist_loaded(tmp_path_factory, mnist_raw):
    """Load both MNIST splits once into a fresh root, from the files of ``mnist_raw`` as the only source."""
    root = tmp_path_factory.mktemp("data")
    before = snapshot(mnist_raw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ds.DATA_SOURCES_ENV, os.pathsep.join(["/nonexistent", str(mnist_raw)]))
        train = mnist(root, train=True)
        test = mnist(root, train=False)
    return root, train, test, before, mnist_raw


def test_mnist_lengths_labels_and_transform(mnist_loaded):
    root, train, test, *_ = mnist_loaded
    assert (len(train), len(test)) == (60000, 10000)
    assert torch.bincount(train.targets, minlength=10).tolist() == MNIST_TRAIN_LABEL_COUNTS
    image, label = train[0]
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32
    assert label == 5  # the well-known first training digit
    # Normalize((0.1307,), (0.3081,)): background pixels map to -0.1307 / 0.3081.
    assert image.min().item() == pytest.approx(-0.1307 / 0.3081, abs=1e-4)


def test_mnist_source_untouched_and_cache_written(mnist_loaded):
    root, _, _, before, source = mnist_loaded
    assert snapshot(source) == before
    raw = root / "MNIST" / "raw"
    assert sorted(p.name for p in raw.iterdir()) == sorted(n[:-3] for n in GZ_NAMES)  # no temp files left
    assert all(p.stat().st_mode & 0o444 == 0o444 for p in raw.iterdir())  # a shared cache: readable by all


def test_mnist_cache_is_used_without_sources(mnist_loaded, no_sources):
    root = mnist_loaded[0]
    assert len(mnist(root, train=False)) == 10000


def test_data_root_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv(ds.DATA_ROOT_ENV, raising=False)
    assert resolve_data_root() == Path("data")
    monkeypatch.setenv(ds.DATA_ROOT_ENV, str(tmp_path))
    assert resolve_data_root() == tmp_path
    assert resolve_data_root(tmp_path / "x") == tmp_path / "x"


def test_missing_offline_error_says_what_to_do(no_sources, tmp_path):
    with pytest.raises(DatasetNotFoundError) as info:
        mnist(tmp_path / "root", train=True)
    message = str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    for name in GZ_NAMES + [str(tmp_path / "root" / "MNIST" / "raw"), "DDPTRAIN_DATA_SOURCES", "DDPTRAIN_DATA"]:
        assert name in message
    assert not (tmp_path / "root").exists()  # nothing created on failure


def test_failed_download_is_reported(no_sources, monkeypatch, tmp_path):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(ds, "_torchvision_download", offline)
    expected = r"(?s)the download failed \(.*no network.*\).*train-images-idx3-ubyte\.gz"
    with pytest.raises(DatasetNotFoundError, match=expected):
        mnist(tmp_path, train=True, download=True)


def test_fashion_missing_error_names_apt_package(no_sources, tmp_path):
    with pytest.raises(DatasetNotFoundError, match="apt-get install dataset-fashion-mnist"):
        fashion_mnist(tmp_path)


def source_with(tmp_path, raw, replace):
    """A source folder linking to the MNIST files in ``raw``, with some replaced by bytes (``.gz`` names)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in GZ_NAMES:
        if name in replace:
            (src / name).write_bytes(replace[name])
        else:
            (src / name[:-3]).symlink_to(raw / name[:-3])
    return src


def test_truncated_gz_gives_clear_error(no_sources, monkeypatch, tmp_path, mnist_raw):
    good = gzip.compress((mnist_raw / "t10k-images-idx3-ubyte").read_bytes(), compresslevel=1)
    src = source_with(tmp_path, mnist_raw, {"t10k-images-idx3-ubyte.gz": good[: len(good) // 2]})
    monkeypatch.setenv(ds.DATA_SOURCES_ENV, str(src))
    with pytest.raises(DatasetCorruptError, match=r"t10k-images-idx3-ubyte\.gz is truncated or corrupt"):
        mnist(tmp_path / "root", train=True)
    left = sorted(p.name for p in (tmp_path / "root" / "MNIST" / "raw").iterdir())
    assert "t10k-images-idx3-ubyte" not in left and not any(n.endswith(".tmp") for n in left)


def test_truncated_uncompressed_source_gives_clear_error(no_sources, monkeypatch, tmp_path, mnist_raw):
    images = (mnist_raw / "t10k-images-idx3-ubyte").read_bytes()
    src = source_with(tmp_path, mnist_raw, {})
    (src / "t10k-images-idx3-ubyte").unlink()
    (src / "t10k-images-idx3-ubyte").write_bytes(images[:-784])  # one image short, header intact
    monkeypatch.setenv(ds.DATA_SOURCES_ENV, str(src))
    with pytest.raises(DatasetCorruptError, match=r"holds 7839232 bytes of IDX data, expected 7840016 .*truncated"):
        mnist(tmp_path / "root", train=False)
    assert not (tmp_path / "root" / "MNIST" / "raw" / "t10k-images-idx3-ubyte").exists()


def test_truncated_file_in_the_cache_says_how_to_rebuild_it(no_sources, tmp_path, mnist_raw):
    raw = tmp_path / "root" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in GZ_NAMES:
        (raw / name[:-3]).symlink_to(mnist_raw / name[:-3])
    (raw / "train-labels-idx1-ubyte").unlink()
    (raw / "train-labels-idx1-ubyte").write_bytes((mnist_raw / "train-labels-idx1-ubyte").read_bytes()[:-10])
    expected = r"(?s)train-labels-idx1-ubyte holds 59998 bytes.*Delete .*train-labels-idx1-ubyte to have it rebuilt"
    with pytest.raises(DatasetCorruptError, match=expected):
        mnist(tmp_path / "root", train=False)


def test_wrong_item_count_gives_clear_error(no_sources, monkeypatch, tmp_path, mnist_raw):
    labels = (mnist_raw / "t10k-labels-idx1-ubyte").read_bytes()
    short = labels[:4] + (9999).to_bytes(4, "big") + labels[8:-1]
    src = source_with(tmp_path, mnist_raw, {"t10k-labels-idx1-ubyte.gz": gzip.compress(short)})
    monkeypatch.setenv(ds.DATA_SOURCES_ENV, str(src))
    with pytest.raises(DatasetCorruptError, match="declares 9999 labels, expected 10000"):
        mnist(tmp_path / "root", train=False)


def test_garbage_gz_gives_clear_error(no_sources, monkeypatch, tmp_path, mnist_raw):
    src = source_with(tmp_path, mnist_raw, {"train-labels-idx1-ubyte.gz": b"not a gzip file at all"})
    monkeypatch.setenv(ds.DATA_SOURCES_ENV, str(src))
    with pytest.raises(DatasetCorruptError, match="train-labels-idx1-ubyte.gz is truncated or corrupt"):
        mnist(tmp_path / "root")


def test_mnist_files_are_not_taken_for_fashion(no_sources, monkeypatch, tmp_path, mnist_raw):
    monkeypatch.setenv(ds.DATA_SOURCES_ENV, str(mnist_raw))
    with pytest.raises(DatasetNotFoundError, match=r"(?s)Skipped, another dataset: .*not Fashion-MNIST's"):
        fashion_mnist(tmp_path, train=False)


@pytest.mark.skipif(
    not all((DEBIAN_FASHION / n).is_file() for n in GZ_NAMES),
    reason=f"Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist puts it in {DEBIAN_FASHION})",
)
def test_fashion_mnist_from_debian_package(monkeypatch, tmp_path):
    monkeypatch.delenv(ds.DATA_SOURCES_ENV, raising=False)
    test = fashion_mnist(tmp_path, train=False)
    assert len(test) == 10000
    assert torch.bincount(test.targets, minlength=10).tolist() == [1000] * 10
    assert test[0][0].shape == (1, 28, 28)
    assert (tmp_path / "FashionMNIST" / "raw" / "t10k-images-idx3-ubyte").is_file()


def test_synthetic_is_deterministic_and_split():
    a = SyntheticClassification(256, seed=3)
    b = SyntheticClassification(256, seed=3)
    c = SyntheticClassification(256, seed=3, train=False)
    assert torch.equal(a.data, b.data) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.data, c.data)
    x, y = a[7]
    assert x.shape == (1, 28, 28) and isinstance(y, int) and 0 <= y < 10
    assert len(set(a.targets.tolist())) == 10


def test_synthetic_is_learnable():
    torch.manual_seed(0)
    train = SyntheticClassification(512, input_shape=(16,), num_classes=4, seed=1)
    test = SyntheticClassification(512, input_shape=(16,), num_classes=4, seed=1, train=False)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss_fn = torch.nn.CrossEntropyLoss()
    first = loss_fn(model(train.data), train.targets).item()
    for _ in range(100):
        optimizer.zero_grad()
        loss = loss_fn(model(train.data), train.targets)
        loss.backward()
        optimizer.step()
    assert loss.item() < first / 2
    accuracy = (model(test.data).argmax(1) == test.targets).float().mean().item()
    assert accuracy > 0.8  # the same rule holds on the test split


def test_build_dataset_dispatch(mnist_loaded):
    synthetic = build_dataset("synthetic", train=False, num_samples=32, input_shape=(3,), num_classes=2)
    assert len(synthetic) == 32 and synthetic[0][0].shape == (3,)
    assert len(build_dataset("synthetic")) == 10000
    assert len(build_dataset("mnist", mnist_loaded[0], train=False)) == 10000
    with pytest.raises(ValueError, match="mnist, fashion_mnist, synthetic"):
        build_dataset("cifar10")
    assert DATASET_NAMES == ("mnist", "fashion_mnist", "synthetic")


def test_preparing_the_files_installs_and_checks_them_without_loading_through_torchvision(tmp_path, mnist_raw):
    # What the launcher runs before any worker starts: it must leave a cache build_dataset then
    # loads, and must not pay torchvision's import (which brings torch._dynamo) nor the 60000 images.
    script = (
        "import sys; from ddptrain.data import prepare_dataset_files as p\n"
        "for train in (True, False): p('mnist', sys.argv[1], train=train)\n"
        "p('synthetic', sys.argv[1])\n"
        "print(sorted(m for m in ('torchvision', 'torch._dynamo') if m in sys.modules))\n"
    )
    env = {**os.environ, ds.DATA_SOURCES_ENV: str(mnist_raw), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    raw = tmp_path / "MNIST" / "raw"
    assert sorted(p.name for p in raw.iterdir()) == sorted(n[:-3] for n in GZ_NAMES)
    assert len(build_dataset("mnist", tmp_path, train=True)) == 60000


def test_preparing_the_files_refuses_what_loading_would_refuse(no_sources, tmp_path, mnist_raw):
    with pytest.raises(DatasetNotFoundError, match="train-images-idx3-ubyte.gz"):
        prepare_dataset_files("mnist", tmp_path / "empty")
    for folder in ("MNIST", "FashionMNIST"):  # MNIST's files in both datasets' cache folders
        raw = tmp_path / "root" / folder / "raw"
        raw.mkdir(parents=True)
        for path in mnist_raw.iterdir():
            (raw / path.name).write_bytes(path.read_bytes())
    with pytest.raises(DatasetCorruptError, match="labels per class .* are not Fashion-MNIST's"):
        prepare_dataset_files("fashion_mnist", tmp_path / "root", train=True)
    prepare_dataset_files("mnist", tmp_path / "root", train=False)
    labels = tmp_path / "root" / "MNIST" / "raw" / "t10k-labels-idx1-ubyte"
    labels.write_bytes(labels.read_bytes()[:-1])
    with pytest.raises(DatasetCorruptError, match="holds 10007 bytes of IDX data, expected 10008"):
        prepare_dataset_files("mnist", tmp_path / "root", train=False)
    with pytest.raises(ValueError, match="unknown dataset 'cifar10'; known datasets are mnist, fashion_mnist"):
        prepare_dataset_files("cifar10")


def test_data_package_does_not_import_comm_or_torch_distributed():
    # The data package needs only (rank, world_size) integers. The one exception, made inside the
    # function and nowhere else: a sampler given no rank asks the current process group, as torch's does.
    for path in (REPO / "ddptrain" / "data").glob("*.py"):
        tree = ast.parse(path.read_text())
        allowed = {
            id(n)
            for f in ast.walk(tree)
            if isinstance(f, ast.FunctionDef) and f.name == "_current_group"
            for n in ast.walk(f)
        }
        for node in ast.walk(tree):
            if id(node) in allowed:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [
                    "ddptrain.comm" if node.level and (node.module or "").startswith("comm") else node.module or ""
                ]
                names += [f"{node.module}.{a.name}" for a in node.names if node.level == 2 and not node.module]
            else:
                continue
            for name in names:
                assert not name.startswith(("ddptrain.comm", "torch.distributed", "None.comm")), (
                    f"{path.name} imports {name}"
                )
