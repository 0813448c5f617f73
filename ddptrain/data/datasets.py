"""Datasets: MNIST and Fashion-MNIST from local files, and a synthetic task.

MNIST-style datasets are torchvision's classes, but ddptrain finds their files itself, so that
offline machines and read-only shared copies work:

1. The data root is ``root`` if given, else ``$DDPTRAIN_DATA``, else ``./data``; torchvision
   reads the four uncompressed IDX files from ``<root>/<Folder>/raw/`` (``MNIST`` or
   ``FashionMNIST``). If they are all there, they are used.
2. Otherwise the four files (``.gz`` or uncompressed) are looked for in that folder, then in each
   directory of ``$DDPTRAIN_DATA_SOURCES`` (``os.pathsep``-separated; the files directly in it,
   or in ``<Folder>/raw/`` or ``<Folder>/``), then, for Fashion-MNIST, in Debian's
   ``/usr/share/datasets/fashion-mnist``. The first complete set is decompressed into
   ``<root>/<Folder>/raw/``; sources are never written to.
3. Otherwise ``download=True`` lets torchvision download them; failing that, a
   ``DatasetNotFoundError`` says what to put where.

Every file is checked before use (IDX header, item count, size), so a truncated or corrupt file
is refused with its name instead of failing later inside torchvision, and the label histogram
must be the dataset's: MNIST and Fashion-MNIST have the same file names, and a folder of one is
never taken for the other. torchvision's md5 check of the archives is not used: a recompressed
but identical archive fails it.
"""

from __future__ import annotations

import gzip
import os
import shutil
import struct
import tempfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Union

import torch
from torch.utils.data import Dataset

from .. import envvars
from ..errors import DATA_SOURCES_ENV, DatasetCorruptError, DatasetNotFoundError

__all__ = [
    "DatasetNotFoundError",
    "DatasetCorruptError",
    "resolve_data_root",
    "mnist",
    "fashion_mnist",
    "SyntheticClassification",
    "build_dataset",
    "prepare_dataset_files",
    "DATASET_NAMES",
]

PathLike = Union[str, os.PathLike]  # noqa: UP007 - a runtime alias, usable on Python 3.10

DATA_ROOT_ENV = "DDPTRAIN_DATA"


# The four IDX files of an MNIST-style dataset: name -> (magic number, item count, bytes per item).
# Magic 2051 (0x0803): unsigned bytes in 3 dimensions, a 16-byte header; 2049 (0x0801): 1 dimension, 8 bytes.
_FILES = {
    "train-images-idx3-ubyte": (2051, 60000, 28 * 28),
    "train-labels-idx1-ubyte": (2049, 60000, 1),
    "t10k-images-idx3-ubyte": (2051, 10000, 28 * 28),
    "t10k-labels-idx1-ubyte": (2049, 10000, 1),
}
_LABELS = 2049


@dataclass(frozen=True)
class _Spec:
    """What distinguishes MNIST from Fashion-MNIST for finding and loading its files."""

    name: str
    folder: str  # torchvision's class name, which is its folder under the root
    mean: float
    std: float
    label_counts: dict[int, tuple[int, ...]]  # per item count (60000: train, 10000: test)
    system_dir: str | None = None
    apt_package: str | None = None


_MNIST = _Spec(
    "MNIST",
    "MNIST",
    0.1307,
    0.3081,
    {
        60000: (5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949),
        10000: (980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009),
    },
)
_FASHION_MNIST = _Spec(
    "Fashion-MNIST",
    "FashionMNIST",
    0.2860,
    0.3530,
    {60000: (6000,) * 10, 10000: (1000,) * 10},
    system_dir="/usr/share/datasets/fashion-mnist",
    apt_package="dataset-fashion-mnist",
)


def resolve_data_root(root: PathLike | None = None) -> Path:
    """Return the data root: ``root``, else ``$DDPTRAIN_DATA``, else ``./data``."""
    if root is not None and str(root) != "":
        return Path(root).expanduser()
    from_env = envvars.get_str(DATA_ROOT_ENV)
    return Path(from_env).expanduser() if from_env else Path("data")


def mnist(
    root: PathLike | None = None,
    train: bool = True,
    download: bool = False,
    transform: Callable | None = None,
    target_transform: Callable | None = None,
) -> Dataset:
    """Return torchvision's MNIST, found locally as described in the module docstring.

    Args:
        root: Data root; ``None`` means ``$DDPTRAIN_DATA`` or ``./data``.
        train: The 60000-image training split, else the 10000-image test split.
        download: If no local copy is found, let torchvision download one.
        transform: Image transform; default ``ToTensor`` then ``Normalize((0.1307,),
            (0.3081,))``, as in the PyTorch tutorial.
        target_transform: Label transform.

    Raises:
        DatasetNotFoundError: No local copy and no (successful) download.
        DatasetCorruptError: A file found is truncated, corrupt, or another dataset.
    """
    return _load(_MNIST, root, train, download, transform, target_transform)


def fashion_mnist(
    root: PathLike | None = None,
    train: bool = True,
    download: bool = False,
    transform: Callable | None = None,
    target_transform: Callable | None = None,
) -> Dataset:
    """Return torchvision's FashionMNIST, found locally like ``mnist``.

    Besides the data root and the sources, the Debian/Ubuntu package ``dataset-fashion-mnist``
    (``/usr/share/datasets/fashion-mnist/``) is used. The default transform normalizes with
    ``(0.2860,), (0.3530,)``.

    Raises:
        DatasetNotFoundError: No local copy and no (successful) download.
        DatasetCorruptError: A file found is truncated, corrupt, or another dataset.
    """
    return _load(_FASHION_MNIST, root, train, download, transform, target_transform)


def _load(
    spec: _Spec,
    root: PathLike | None,
    train: bool,
    download: bool,
    transform: Callable | None,
    target_transform: Callable | None,
) -> Dataset:
    from torchvision import datasets, transforms

    data_root = resolve_data_root(root)
    _prepare_raw_folder(spec, data_root, train, download)
    if transform is None:
        transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((spec.mean,), (spec.std,))])
    # download=False: the raw folder is complete and checked, and torchvision's md5 check would
    # reject a recompressed archive.
    return getattr(datasets, spec.folder)(
        str(data_root), train=train, download=False, transform=transform, target_transform=target_transform
    )


def _prepare_raw_folder(spec: _Spec, data_root: Path, train: bool, download: bool) -> None:
    raw = data_root / spec.folder / "raw"
    if all((raw / name).is_file() for name in _FILES):
        for name in _FILES:
            _check_cached(spec, raw / name)
        return
    searched: list[Path] = []
    skipped: list[str] = []
    for directory in _candidate_dirs(spec, raw):
        searched.append(directory)
        sources = [_find(directory, name) for name in _FILES]
        if None in sources:
            continue
        problems = [_label_problem(spec, path) for path in sources if _is_labels(path)]
        if any(problems):
            skipped.append(f"{directory}: {next(p for p in problems if p)}")
            continue
        _install(spec, sources, raw)
        return
    if not download:
        raise _not_found(spec, data_root, searched, skipped, None)
    made = [d for d in (raw, raw.parent, data_root) if not d.exists()]  # the deepest first
    try:
        _torchvision_download(spec, data_root, train)
    except Exception as err:  # any failure (offline, mirror down) means: no dataset
        for directory in made:  # what the failed download created, if it left it empty
            try:
                directory.rmdir()
            except OSError:
                break
        raise _not_found(spec, data_root, searched, skipped, _short_reason(err)) from err
    for name in _FILES:
        _check_cached(spec, raw / name)


def _torchvision_download(spec: _Spec, data_root: Path, train: bool) -> None:
    from torchvision import datasets

    getattr(datasets, spec.folder)(str(data_root), train=train, download=True)


def _candidate_dirs(spec: _Spec, raw: Path) -> list[Path]:
    """Existing directories to search, in order: the raw folder, the sources, the system's folder."""
    sources = [Path(p).expanduser() for p in envvars.get_paths(DATA_SOURCES_ENV)]
    dirs = [raw] + [base / layout for base in sources for layout in (f"{spec.folder}/raw", spec.folder, ".")]
    dirs += [Path(spec.system_dir)] if spec.system_dir else []
    unique = dict.fromkeys(Path(os.path.normpath(d)) for d in dirs)
    return [d for d in unique if d.is_dir()]


def _find(directory: Path, name: str) -> Path | None:
    for path in (directory / name, directory / f"{name}.gz"):
        if path.is_file():
            return path
    return None


def _stem(path: Path) -> str:
    return path.name.removesuffix(".gz")


def _is_labels(path: Path) -> bool:
    return _FILES[_stem(path)][0] == _LABELS


def _open(path: Path) -> BinaryIO:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _label_problem(spec: _Spec, path: Path) -> str | None:
    """Check a labels file (``.gz`` or not); return why it is not ``spec``'s, or None.

    The label histogram tells the datasets apart: Fashion-MNIST has exactly 6000 (train) or
    1000 (test) labels per class, MNIST its own known counts.
    """
    try:
        with _open(path) as stream:
            data = stream.read()
    except (EOFError, OSError, zlib.error) as err:
        raise _corrupt(path, err) from err
    _check_idx(path, data[:8], len(data))
    counts = tuple(torch.bincount(torch.frombuffer(bytearray(data[8:]), dtype=torch.uint8), minlength=10).tolist())
    expected = spec.label_counts[_FILES[_stem(path)][1]]
    if counts != expected:
        return f"labels per class {list(counts)} in {path.name} are not {spec.name}'s {list(expected)}"
    return None


def _check_cached(spec: _Spec, path: Path) -> None:
    """Check an uncompressed file of the raw folder, telling how to have it rebuilt."""
    try:
        with open(path, "rb") as stream:
            _check_idx(path, stream.read(16), path.stat().st_size)
        problem = _label_problem(spec, path) if _is_labels(path) else None
        if problem:
            raise DatasetCorruptError(f"{path} does not hold {spec.name}: {problem}")
    except DatasetCorruptError as err:
        raise DatasetCorruptError(f"{err}\nDelete {path} to have it rebuilt from the .gz sources.") from None


def _check_idx(path: Path, header: bytes, size: int) -> None:
    """Refuse an IDX file whose header or size is not that of its name's file (``size``: uncompressed)."""
    magic, count, item_bytes = _FILES[_stem(path)]
    kind, header_len = ("labels", 8) if magic == _LABELS else ("images", 16)
    if len(header) < header_len:
        raise DatasetCorruptError(f"{path} is truncated: {size} bytes, not even an IDX header ({header_len} bytes)")
    found_magic, found_count = struct.unpack(">II", header[:8])
    if found_magic != magic:
        raise DatasetCorruptError(
            f"{path} is not an IDX {kind} file: magic number {found_magic}, expected {magic} for {_stem(path)}"
        )
    if found_count != count:
        raise DatasetCorruptError(f"{path} declares {found_count} {kind}, expected {count} for {_stem(path)}")
    if kind == "images" and struct.unpack(">II", header[8:16]) != (28, 28):
        raise DatasetCorruptError(f"{path} declares images of {struct.unpack('>II', header[8:16])}, expected (28, 28)")
    if size != header_len + count * item_bytes:
        raise DatasetCorruptError(
            f"{path} holds {size} bytes of IDX data, expected {header_len + count * item_bytes} ({count} {kind}): "
            f"the file is truncated or corrupt; replace it with a good copy"
        )


def _install(spec: _Spec, sources: Sequence[Path], raw: Path) -> None:
    """Decompress (or copy) the four checked-to-be sources into ``raw``, keeping files already there."""
    try:
        raw.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OSError(
            f"cannot create the {spec.name} cache folder {raw} ({err}); the data root must be "
            f"writable. Pass another root or set {DATA_ROOT_ENV} to a writable directory."
        ) from err
    for src in sources:
        dest = raw / _stem(src)
        if dest.is_file():
            _check_cached(spec, dest)
            continue
        # A unique temporary file, then a rename: ranks that start together may all decompress at
        # once, and an interrupted run must not leave a half file behind.
        fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=raw)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out:
                try:
                    with _open(src) as stream:
                        shutil.copyfileobj(stream, out, 1 << 20)
                except (EOFError, OSError, zlib.error) as err:
                    raise _corrupt(src, err) from err
            with open(tmp, "rb") as written:
                _check_idx(src, written.read(16), tmp.stat().st_size)
            os.chmod(tmp, 0o644)  # mkstemp makes it private; a shared cache must stay readable to others
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)


def _corrupt(path: Path, err: BaseException) -> DatasetCorruptError:
    return DatasetCorruptError(
        f"{path} is truncated or corrupt and cannot be read ({err}); replace it with a good copy"
    )


def _not_found(
    spec: _Spec, data_root: Path, searched: list[Path], skipped: list[str], download_error: str | None
) -> DatasetNotFoundError:
    apt = ""
    if spec.apt_package:
        apt = f"On Debian/Ubuntu: apt-get install {spec.apt_package} (puts them in {spec.system_dir})."
    files = [f"{name}.gz" for name in _FILES]
    return DatasetNotFoundError(
        spec.name, files, data_root / spec.folder / "raw", searched, skipped, download_error, apt
    )


def _short_reason(err: BaseException) -> str:
    """The gist of a failed download: urllib's last "<urlopen error ...>" line, or the error itself."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    reason = next((ln for ln in reversed(lines) if "error" in ln.lower()), lines[-1] if lines else repr(err))
    return reason.strip("<>")


class SyntheticClassification(Dataset):
    """A deterministic in-memory classification task, for benchmarks and tests.

    Each class has a fixed random template; a sample of class ``y`` is standard normal noise
    plus ``signal`` times template ``y``, so any model (an MLP, the tutorial's convolutional
    network) learns it within a few dozen steps and its loss falls clearly — what a smoke run
    needs. The templates depend only on ``seed``; the train and test splits draw different
    labels and noise for the same templates.

    Args:
        num_samples: Number of samples.
        input_shape: Shape of one input, default MNIST's ``(1, 28, 28)``.
        num_classes: Number of labels.
        seed: Seed of the templates and of the samples.
        train: Which split's samples to draw.
        signal: Strength of the class template against unit noise (larger: easier).
    """

    def __init__(
        self,
        num_samples: int,
        input_shape: Sequence[int] = (1, 28, 28),
        num_classes: int = 10,
        seed: int = 0,
        train: bool = True,
        signal: float = 2.0,
    ) -> None:
        if num_samples < 1 or num_classes < 2:
            raise ValueError(f"need num_samples >= 1 and num_classes >= 2, got {num_samples} and {num_classes}")
        self.input_shape = tuple(input_shape)
        self.num_classes = num_classes
        self.seed = seed
        templates = torch.randn(num_classes, *self.input_shape, generator=torch.Generator().manual_seed(seed))
        # 2 * seed + split is a distinct stream for every (seed, split) pair.
        samples = torch.Generator().manual_seed(2 * seed + (0 if train else 1))
        self.targets = torch.randint(0, num_classes, (num_samples,), generator=samples)
        self.data = torch.randn(num_samples, *self.input_shape, generator=samples) + signal * templates[self.targets]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.data[index], int(self.targets[index])


DATASET_NAMES = ("mnist", "fashion_mnist", "synthetic")

# Sizes of the synthetic splits when none is given: small enough to build in a moment.
_SYNTHETIC_DEFAULT_SAMPLES = {True: 10000, False: 2000}


def prepare_dataset_files(name: str, root: PathLike | None = None, train: bool = True, download: bool = False) -> None:
    """Make a file-based dataset's split ready to load, without loading it: find, decompress and
    check its files (or download them), exactly as :func:`build_dataset` does first. Nothing to do
    for ``"synthetic"``. It reads only the small label files, so a launcher can check a run's data
    in a fraction of the time building the dataset takes.

    Raises:
        DatasetNotFoundError: No local copy and no (successful) download.
        DatasetCorruptError: A file found is truncated, corrupt, or another dataset.
        ValueError: If ``name`` is not a known dataset.
    """
    specs = {"mnist": _MNIST, "fashion_mnist": _FASHION_MNIST}
    if name in specs:
        _prepare_raw_folder(specs[name], resolve_data_root(root), train, download)
    elif name not in DATASET_NAMES:
        raise _unknown_dataset(name)


def build_dataset(
    name: str, root: PathLike | None = None, train: bool = True, download: bool = False, **kwargs: Any
) -> Dataset:
    """Build a dataset by name: ``"mnist"``, ``"fashion_mnist"`` or ``"synthetic"``.

    Args:
        name: One of ``DATASET_NAMES``.
        root: Data root for file-based datasets (ignored by ``"synthetic"``).
        train: Training split, else test split.
        download: Allow downloading a missing file-based dataset.
        **kwargs: Passed on: ``transform``/``target_transform`` for MNIST-style datasets;
            ``num_samples`` (default 10000 train / 2000 test), ``input_shape``,
            ``num_classes``, ``seed`` for ``"synthetic"``.

    Raises:
        ValueError: If ``name`` is not a known dataset.
    """
    if name == "mnist":
        return mnist(root, train=train, download=download, **kwargs)
    if name == "fashion_mnist":
        return fashion_mnist(root, train=train, download=download, **kwargs)
    if name == "synthetic":
        kwargs.setdefault("num_samples", _SYNTHETIC_DEFAULT_SAMPLES[bool(train)])
        return SyntheticClassification(train=train, **kwargs)
    raise _unknown_dataset(name)


def _unknown_dataset(name: str) -> ValueError:
    return ValueError(f"unknown dataset {name!r}; known datasets are {', '.join(DATASET_NAMES)}")
