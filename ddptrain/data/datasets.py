"""Datasets: MNIST and Fashion-MNIST from local files, and a synthetic task.

MNIST-style datasets are loaded with torchvision, but ddptrain finds the files itself
so that offline machines and read-only shared copies work:

1. The data root is ``root`` if given, else ``$DDPTRAIN_DATA``, else ``./data``.
2. If ``<root>/<Folder>/raw/`` (``MNIST`` or ``FashionMNIST``) already holds the four
   uncompressed IDX files, they are used.
3. Otherwise the four files (``.gz`` or uncompressed) are looked for in that folder,
   then in each directory of ``$DDPTRAIN_DATA_SOURCES`` (``os.pathsep``-separated), then
   in system locations (Debian's ``/usr/share/datasets/fashion-mnist``);
   ``DDPTRAIN_DATA_SOURCES_ONLY=1`` skips the system locations. A source directory may hold the files
   directly or in ``<Folder>/raw/`` or ``<Folder>/``. The first complete set is
   decompressed into ``<root>/<Folder>/raw/``; sources are never written to.
4. Otherwise ``download=True`` lets torchvision download them, and failing that a
   ``DatasetNotFoundError`` says what to put where.

torchvision's md5 check of the archives is not used (a recompressed but identical
archive fails it). Instead every file's IDX header, item count and size are checked,
and the label histogram must match the dataset, which also stops a folder of MNIST
files from being taken for Fashion-MNIST (the file names are the same).
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

__all__ = [
    "DatasetNotFoundError",
    "DatasetCorruptError",
    "resolve_data_root",
    "mnist",
    "fashion_mnist",
    "SyntheticClassification",
    "build_dataset",
    "DATASET_NAMES",
]

PathLike = Union[str, os.PathLike]  # noqa: UP007 - a runtime alias, usable on Python 3.10

DATA_ROOT_ENV = "DDPTRAIN_DATA"
DATA_SOURCES_ENV = "DDPTRAIN_DATA_SOURCES"


class DatasetNotFoundError(FileNotFoundError):
    """The dataset's files are neither in the data root nor in any known source (nor downloaded).

    ``str(error)`` speaks Python (``root=``, ``download=True``); :meth:`explain` words the same
    facts with the knobs of another interface (the command line's ``data.root=``...).

    Attributes:
        dataset: the dataset's name. files: the four file names. raw_dir: where they belong.
        searched: existing directories searched. skipped: sources holding another dataset.
        download_error: why the download failed, or None if none was attempted.
    """

    def __init__(
        self,
        dataset: str,
        files: Sequence[str],
        raw_dir: Path,
        searched: Sequence[Path],
        skipped: Sequence[str] = (),
        download_error: str | None = None,
        apt_hint: str = "",
    ):
        self.dataset, self.files, self.raw_dir = dataset, list(files), Path(raw_dir)
        self.searched, self.skipped = list(searched), list(skipped)
        self.download_error, self.apt_hint = download_error, apt_hint
        super().__init__(self.explain())

    def explain(
        self,
        root_knob: str = "the root argument (default: $DDPTRAIN_DATA, else ./data)",
        download_knob: str = "download=True",
        forbid_knob: str = "",
    ) -> str:
        """The message, naming ``root_knob`` for the data root and ``download_knob`` for downloading."""
        if self.download_error is None:
            how = f"it was not downloaded ({download_knob} allows it on a machine with internet access)"
        else:
            how = f"the download failed ({self.download_error})" + (
                f"; {forbid_knob} forbids it" if forbid_knob else ""
            )
        lines = [
            f"{self.dataset} was not found and {how}. It needs the four files {', '.join(self.files)} "
            f"(or the same without .gz): put them in {self.raw_dir}/, or point {root_knob} at a directory "
            f"holding {self.raw_dir.parent.name}/raw/, or list directories holding them in ${DATA_SOURCES_ENV}.",
        ]
        if self.apt_hint:
            lines.append(self.apt_hint)
        searched = ", ".join(str(d) for d in self.searched) or "no existing directory"
        lines.append(f"Searched: {searched}.")
        if self.skipped:
            lines.append("Skipped, another dataset: " + "; ".join(self.skipped))
        return "\n".join(lines)


class DatasetCorruptError(ValueError):
    """A dataset file exists but is truncated, corrupt, or holds another dataset."""


@dataclass(frozen=True)
class _IdxFile:
    """One of the four IDX files of an MNIST-style dataset."""

    stem: str
    train: bool
    images: bool

    @property
    def count(self) -> int:
        return 60000 if self.train else 10000

    @property
    def magic(self) -> int:
        # 0x0803: unsigned bytes, 3 dimensions; 0x0801: unsigned bytes, 1 dimension.
        return 2051 if self.images else 2049

    @property
    def header_len(self) -> int:
        return 16 if self.images else 8

    @property
    def size(self) -> int:
        return self.header_len + self.count * (28 * 28 if self.images else 1)


_FILES = (
    _IdxFile("train-images-idx3-ubyte", train=True, images=True),
    _IdxFile("train-labels-idx1-ubyte", train=True, images=False),
    _IdxFile("t10k-images-idx3-ubyte", train=False, images=True),
    _IdxFile("t10k-labels-idx1-ubyte", train=False, images=False),
)


@dataclass(frozen=True)
class _Spec:
    """What distinguishes MNIST from Fashion-MNIST for finding and loading files."""

    name: str
    folder: str  # torchvision's class name, which is its folder under the root
    mean: float
    std: float
    train_label_counts: tuple[int, ...]
    test_label_counts: tuple[int, ...]
    extra_layouts: tuple[str, ...] = ()
    system_dirs: tuple[str, ...] = ()
    apt_package: str | None = None

    def layouts(self) -> tuple[str, ...]:
        return (f"{self.folder}/raw", self.folder, *self.extra_layouts, ".")

    def torchvision_class(self) -> Callable[..., Any]:
        from torchvision import datasets

        return getattr(datasets, self.folder)


_MNIST = _Spec(
    name="MNIST",
    folder="MNIST",
    mean=0.1307,
    std=0.3081,
    train_label_counts=(5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949),
    test_label_counts=(980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009),
)

_FASHION_MNIST = _Spec(
    name="Fashion-MNIST",
    folder="FashionMNIST",
    mean=0.2860,
    std=0.3530,
    train_label_counts=(6000,) * 10,
    test_label_counts=(1000,) * 10,
    extra_layouts=("fashion-mnist",),
    system_dirs=("/usr/share/datasets/fashion-mnist",),
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

    Besides the usual sources, the Debian/Ubuntu package ``dataset-fashion-mnist``
    (``/usr/share/datasets/fashion-mnist/``) is used. The default transform normalizes
    with ``(0.2860,), (0.3530,)``.

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
    from torchvision import transforms

    data_root = resolve_data_root(root)
    _prepare_raw_folder(spec, data_root, train, download)
    if transform is None:
        transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((spec.mean,), (spec.std,))])
    # download=False: the raw folder is complete and validated, and torchvision's md5
    # check would reject a recompressed archive.
    return spec.torchvision_class()(
        str(data_root), train=train, download=False, transform=transform, target_transform=target_transform
    )


def _prepare_raw_folder(spec: _Spec, data_root: Path, train: bool, download: bool) -> Path:
    raw = data_root / spec.folder / "raw"
    if all((raw / f.stem).is_file() for f in _FILES):
        for f in _FILES:
            _validate_file(spec, f, raw / f.stem)
        return raw
    searched: list[Path] = []
    skipped: list[str] = []
    for candidate in _candidate_dirs(spec, raw):
        searched.append(candidate)
        sources = [_find_source(candidate, f) for f in _FILES]
        if any(s is None for s in sources):
            continue
        problem = _identity_problem(spec, sources)
        if problem:
            skipped.append(f"{candidate}: {problem}")
            continue
        _install(spec, sources, raw)
        return raw
    if not download:
        raise _not_found(spec, data_root, searched, skipped, None)
    try:
        _torchvision_download(spec, data_root, train)
    except Exception as err:  # any failure (offline, mirror down) means: no dataset
        raise _not_found(spec, data_root, searched, skipped, _short_reason(err)) from err
    for f in _FILES:
        _validate_file(spec, f, raw / f.stem)
    return raw


def _torchvision_download(spec: _Spec, data_root: Path, train: bool) -> None:
    spec.torchvision_class()(str(data_root), train=train, download=True)


def _candidate_dirs(spec: _Spec, raw: Path) -> list[Path]:
    bases = [Path(p).expanduser() for p in envvars.get_paths(DATA_SOURCES_ENV)]
    # DDPTRAIN_DATA_SOURCES_ONLY=1: search nothing but the root and $DDPTRAIN_DATA_SOURCES (to
    # reproduce an offline machine, or to be sure which copy is used).
    only_listed = envvars.get_flag("DDPTRAIN_DATA_SOURCES_ONLY")
    dirs = [raw] + [base / layout for base in bases for layout in spec.layouts()]
    if not only_listed:
        dirs += [Path(d) for d in spec.system_dirs]
    unique: list[Path] = []
    for d in dirs:
        d = Path(os.path.normpath(d))
        if d not in unique and d.is_dir():
            unique.append(d)
    return unique


def _find_source(directory: Path, f: _IdxFile) -> Path | None:
    for name in (f.stem, f.stem + ".gz"):
        if (directory / name).is_file():
            return directory / name
    return None


def _open(path: Path) -> BinaryIO:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _identity_problem(spec: _Spec, sources: Sequence[Path]) -> str | None:
    """Return why these four files are not ``spec``'s dataset, or None if labels match."""
    for f, path in zip(_FILES, sources):
        if not f.images:
            problem = _label_problem(spec, f, path)
            if problem:
                return problem
    return None


def _label_problem(spec: _Spec, f: _IdxFile, path: Path) -> str | None:
    # The label histogram identifies the dataset: MNIST and Fashion-MNIST share file
    # names and formats, but Fashion-MNIST has exactly 6000/1000 labels per class.
    data = _read_all(path)
    _check_idx(f, data[: f.header_len], len(data), path)
    labels = torch.frombuffer(bytearray(data[f.header_len :]), dtype=torch.uint8)
    counts = tuple(torch.bincount(labels, minlength=10).tolist())
    expected = spec.train_label_counts if f.train else spec.test_label_counts
    if counts != expected:
        return f"labels per class {list(counts)} in {path.name} are not {spec.name}'s {list(expected)}"
    return None


def _read_all(path: Path) -> bytes:
    try:
        with _open(path) as stream:
            return stream.read()
    except (EOFError, OSError, zlib.error) as err:
        raise _corrupt(path, err) from err


def _install(spec: _Spec, sources: Sequence[Path], raw: Path) -> None:
    try:
        raw.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OSError(
            f"cannot create the {spec.name} cache folder {raw} ({err}); the data root must be "
            f"writable. Pass another root or set {DATA_ROOT_ENV} to a writable directory."
        ) from err
    for f, src in zip(_FILES, sources):
        dest = raw / f.stem
        if dest.is_file():
            _validate_file(spec, f, dest)
            continue
        _copy_validated(f, src, dest)


def _copy_validated(f: _IdxFile, src: Path, dest: Path) -> None:
    # Write to a unique temporary file and rename: ranks that start together may all
    # decompress at once, and an interrupted run must not leave a half file behind.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{f.stem}.", suffix=".tmp", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                with _open(src) as stream:
                    shutil.copyfileobj(stream, out, 1 << 20)
            except (EOFError, OSError, zlib.error) as err:
                raise _corrupt(src, err) from err
        with open(tmp, "rb") as written:
            header = written.read(f.header_len)
        _check_idx(f, header, tmp.stat().st_size, src)
        # mkstemp makes the file private; a shared cache must stay readable to others.
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _validate_file(spec: _Spec, f: _IdxFile, path: Path) -> None:
    with open(path, "rb") as stream:
        header = stream.read(f.header_len)
    try:
        _check_idx(f, header, path.stat().st_size, path)
        if not f.images:
            problem = _label_problem(spec, f, path)
            if problem:
                raise DatasetCorruptError(f"{path} does not hold {spec.name}: {problem}")
    except DatasetCorruptError as err:
        raise DatasetCorruptError(f"{err}\nDelete {path} to have it rebuilt from the .gz sources.") from None


def _check_idx(f: _IdxFile, header: bytes, size: int, path: Path) -> None:
    if len(header) < f.header_len:
        raise DatasetCorruptError(f"{path} is truncated: {size} bytes, not even an IDX header ({f.header_len} bytes)")
    magic, count = struct.unpack(">II", header[:8])
    kind = "images" if f.images else "labels"
    if magic != f.magic:
        raise DatasetCorruptError(
            f"{path} is not an IDX {kind} file: magic number {magic}, expected {f.magic} for {f.stem}"
        )
    if count != f.count:
        raise DatasetCorruptError(f"{path} declares {count} {kind}, expected {f.count} for {f.stem}")
    if f.images and struct.unpack(">II", header[8:16]) != (28, 28):
        raise DatasetCorruptError(f"{path} declares images of {struct.unpack('>II', header[8:16])}, expected (28, 28)")
    if size != f.size:
        raise DatasetCorruptError(
            f"{path} holds {size} bytes of IDX data, expected {f.size} ({f.count} {kind}): the file is "
            f"truncated or corrupt; replace it with a good copy"
        )


def _corrupt(path: Path, err: BaseException) -> DatasetCorruptError:
    return DatasetCorruptError(
        f"{path} is truncated or corrupt and cannot be read ({err}); replace it with a good copy"
    )


def _not_found(
    spec: _Spec, data_root: Path, searched: list[Path], skipped: list[str], download_error: str | None
) -> DatasetNotFoundError:
    apt = ""
    if spec.apt_package:
        apt = f"On Debian/Ubuntu: apt-get install {spec.apt_package} (puts them in {', '.join(spec.system_dirs)})."
    return DatasetNotFoundError(
        spec.name,
        [f.stem + ".gz" for f in _FILES],
        data_root / spec.folder / "raw",
        searched,
        skipped,
        download_error,
        apt,
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
    raise ValueError(f"unknown dataset {name!r}; known datasets are {', '.join(DATASET_NAMES)}")
