"""Datasets and per-worker partitions.

Built-in: `digits` (scikit-learn's 1,797 8x8 handwritten digits, shipped inside that
package: no download), `synthetic` (Gaussian classes of any shape, for throughput),
`cifar10` (the official binary files in data.path), `mnist` (IDX files in data.path,
optionally .gz). A user dataset is `package.module:factory`, called with no arguments,
returning (train_x, train_y, test_x, test_y) as arrays or tensors (x as N x C x H x W
or N x D floats, y as integer labels).

A missing, truncated or malformed file raises `DataError` with one line that names the
file and what is wrong; `check_dataset` says so without torch (the launcher calls it
before starting any process).

torch is imported when a dataset is made into tensors, not with this module, and the
digits are read from scikit-learn's file without importing scikit-learn (which takes
longer than the rest of a worker's start-up on a small machine).
"""
from __future__ import annotations

import gzip
import importlib.util
import os
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .config import ConfigError, DataConfig

if TYPE_CHECKING:
    import torch

SPLIT_SEED = 1234  # the train/test split does not depend on the job seed
CIFAR_RECORD = 1 + 3 * 32 * 32
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


class DataError(ConfigError):
    """A dataset that cannot be read, phrased for the user."""


@dataclass
class Dataset:
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int

    @property
    def input_shape(self) -> tuple:
        return tuple(self.train_x.shape[1:])


def _split(x: np.ndarray, y: np.ndarray, test_fraction: float):
    perm = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    n_test = max(1, int(round(len(x) * test_fraction)))
    te, tr = perm[:n_test], perm[n_test:]
    return x[tr], y[tr], x[te], y[te]


def digits_file() -> str | None:
    """scikit-learn's digits.csv.gz (what `sklearn.datasets.load_digits` reads), found
    without importing scikit-learn; None if it is not where scikit-learn keeps it."""
    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            return path
    return None


def _digits_raw() -> tuple[np.ndarray, np.ndarray]:
    """(images N x 8 x 8 with values 0..16, labels), as `load_digits()` has them."""
    path = digits_file()
    if path:
        try:
            with gzip.open(path, "rt", encoding="ascii") as f:
                table = np.loadtxt(f, delimiter=",")
            return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)
        except (OSError, ValueError, EOFError):
            pass  # not the file we know: let scikit-learn read it
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise DataError(f"data.name = digits needs scikit-learn ({e}): pip install scikit-learn") from None
    d = load_digits()
    return d.images, d.target.astype(np.int64)


def _digits(cfg: DataConfig):
    images, y = _digits_raw()
    x = images.astype(np.float32)[:, None, :, :] / 16.0
    x = (x - x.mean()) / x.std()
    return _split(x, y, cfg.test_fraction) + (10,)


def _check_synthetic(cfg: DataConfig) -> tuple[int, ...]:
    shape = tuple(int(s) for s in cfg.shape)
    if not shape or any(s < 1 for s in shape):
        raise DataError(f"data.shape must be positive sizes, got {cfg.shape}")
    if cfg.classes < 2 or cfg.samples < cfg.classes:
        raise DataError("data.classes must be >= 2 and data.samples >= data.classes")
    return shape


def _synthetic(cfg: DataConfig, seed: int):
    shape = _check_synthetic(cfg)
    rng = np.random.default_rng(seed + 7)
    n = int(cfg.samples / (1 - cfg.test_fraction))
    centers = rng.normal(size=(cfg.classes,) + shape).astype(np.float32)
    y = rng.integers(0, cfg.classes, size=n)
    x = centers[y] + 2.0 * rng.normal(size=(n,) + shape).astype(np.float32)
    return _split(x.astype(np.float32), y.astype(np.int64), cfg.test_fraction) + (cfg.classes,)


def _read(path: str) -> bytes:
    if not os.path.exists(path):
        raise DataError(f"{path}: file not found")
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if path.endswith(".gz"):
            raw = gzip.decompress(raw)
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    return raw


def _cifar_file(path: str):
    raw = _read(path)
    if len(raw) == 0 or len(raw) % CIFAR_RECORD:
        raise DataError(f"{path}: {len(raw)} bytes is not a whole number of {CIFAR_RECORD}-byte "
                        f"CIFAR-10 records (truncated or not the binary version)")
    rec = np.frombuffer(raw, np.uint8).reshape(-1, CIFAR_RECORD)
    y = rec[:, 0].astype(np.int64)
    if y.max() > 9:
        raise DataError(f"{path}: label {int(y.max())} out of range 0..9 (not a CIFAR-10 binary file)")
    x = rec[:, 1:].reshape(-1, 3, 32, 32).astype(np.float32) / 255.0
    mean = np.array(CIFAR_MEAN, np.float32)[None, :, None, None]
    std = np.array(CIFAR_STD, np.float32)[None, :, None, None]
    return (x - mean) / std, y


def _cifar10(cfg: DataConfig):
    if not cfg.path:
        raise DataError("data.name = cifar10 needs data.path: the folder with data_batch_1.bin ... test_batch.bin")
    parts = [_cifar_file(os.path.join(cfg.path, f"data_batch_{i}.bin")) for i in range(1, 6)]
    tx, ty = _cifar_file(os.path.join(cfg.path, "test_batch.bin"))
    return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), tx, ty, 10)


def _idx(path: str, magic: int, ndim: int) -> np.ndarray:
    raw = _read(path)
    if len(raw) < 4 + 4 * ndim:
        raise DataError(f"{path}: too short for an IDX header")
    got = struct.unpack(">I", raw[:4])[0]
    if got != magic:
        raise DataError(f"{path}: IDX magic number {got:#010x}, expected {magic:#010x}")
    dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    need = int(np.prod(dims))
    body = raw[4 + 4 * ndim:]
    if len(body) != need:
        raise DataError(f"{path}: {len(body)} data bytes, header {list(dims)} needs {need} (truncated?)")
    return np.frombuffer(body, np.uint8).reshape(dims)


def _mnist_path(folder: str, stem: str) -> str:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx")):
        p = os.path.join(folder, name)
        if os.path.exists(p):
            return p
    return os.path.join(folder, stem)


def _mnist(cfg: DataConfig):
    if not cfg.path:
        raise DataError("data.name = mnist needs data.path: the folder with the four IDX files")
    out = []
    for split in ("train", "t10k"):
        xi = _idx(_mnist_path(cfg.path, f"{split}-images-idx3-ubyte"), 0x803, 3)
        yi = _idx(_mnist_path(cfg.path, f"{split}-labels-idx1-ubyte"), 0x801, 1)
        if len(xi) != len(yi):
            raise DataError(f"{cfg.path}: {split} has {len(xi)} images but {len(yi)} labels")
        if yi.size and yi.max() > 9:
            raise DataError(f"{cfg.path}: {split} label {int(yi.max())} out of range 0..9")
        x = (xi.astype(np.float32)[:, None] / 255.0 - 0.1307) / 0.3081
        out += [x, yi.astype(np.int64)]
    return tuple(out) + (10,)


def _user(cfg: DataConfig):
    from .models import load_factory  # torch: a user's factory may return tensors
    fn = load_factory(cfg.name, "data.name")
    try:
        got = fn()
        tx, ty, vx, vy = (np.asarray(a.numpy() if hasattr(a, "numpy") else a) for a in got)
    except (TypeError, ValueError) as e:
        raise DataError(f"data.name {cfg.name!r}: the factory must return "
                        f"(train_x, train_y, test_x, test_y) ({e})") from None
    if len(tx) != len(ty) or len(vx) != len(vy) or len(tx) == 0 or len(vx) == 0:
        raise DataError(f"data.name {cfg.name!r}: x and y lengths differ or a split is empty")
    classes = int(max(ty.max(), vy.max())) + 1
    return tx.astype(np.float32), ty.astype(np.int64), vx.astype(np.float32), vy.astype(np.int64), classes


def _arrays(cfg: DataConfig, seed: int):
    """(train_x, train_y, test_x, test_y, classes) as numpy arrays."""
    if cfg.name == "digits":
        parts = _digits(cfg)
    elif cfg.name == "synthetic":
        parts = _synthetic(cfg, seed)
    elif cfg.name == "cifar10":
        parts = _cifar10(cfg)
    elif cfg.name == "mnist":
        parts = _mnist(cfg)
    elif ":" in cfg.name:
        parts = _user(cfg)
    else:
        raise DataError(f"data.name {cfg.name!r}: expected digits, synthetic, cifar10, mnist "
                        f"or package.module:factory")
    return parts


def check_dataset(cfg: DataConfig, seed: int = 0) -> None:
    """Raise the `DataError` that `load_dataset` would, without torch: the files (cifar10,
    mnist) are read and checked as a worker will read them, a factory is called; digits
    and synthetic, which cannot fail once their settings are valid, are not made."""
    if cfg.name == "digits":
        if digits_file() is None and importlib.util.find_spec("sklearn") is None:
            raise DataError("data.name = digits needs scikit-learn: pip install scikit-learn")
    elif cfg.name == "synthetic":
        _check_synthetic(cfg)
    else:
        _arrays(cfg, seed)


def load_dataset(cfg: DataConfig, seed: int = 0) -> Dataset:
    import torch
    tx, ty, vx, vy, classes = _arrays(cfg, seed)
    return Dataset(torch.from_numpy(np.ascontiguousarray(tx)), torch.from_numpy(np.ascontiguousarray(ty)),
                   torch.from_numpy(np.ascontiguousarray(vx)), torch.from_numpy(np.ascontiguousarray(vy)),
                   int(classes))


def partition(n: int, rank: int, world: int, seed: int) -> np.ndarray:
    """A disjoint share of range(n) for worker `rank` of `world` (same on every party)."""
    perm = np.random.default_rng(seed).permutation(n)
    return perm[rank::world]


def holdout(indices: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train part, held-out part): LTFB's tournament split of a partition."""
    k = max(1, int(round(len(indices) * fraction)))
    return indices[k:], indices[:k]


class Batches:
    """Endless mini-batches over a partition, reshuffled every epoch from (seed, rank, epoch)."""

    def __init__(self, ds_x: torch.Tensor, ds_y: torch.Tensor, indices: np.ndarray,
                 batch_size: int, seed: int, rank: int):
        if len(indices) == 0:
            raise DataError(f"worker {rank}: its data partition is empty (too many workers for the dataset)")
        self.x, self.y, self.idx = ds_x, ds_y, np.asarray(indices)
        self.batch_size = min(batch_size, len(self.idx))
        self.seed, self.rank, self.epoch, self.pos = seed, rank, 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.rank, self.epoch])
        return self.idx[rng.permutation(len(self.idx))]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        import torch
        if self.pos + self.batch_size > len(self._order):
            self.epoch += 1
            self.pos = 0
            self._order = self._shuffle()
        sel = torch.from_numpy(self._order[self.pos:self.pos + self.batch_size])
        self.pos += self.batch_size
        return self.x[sel], self.y[sel]


def describe(cfg: DataConfig) -> tuple[tuple, int]:
    """(input shape, number of classes) without loading the files where they are known."""
    known = {"digits": ((1, 8, 8), 10), "cifar10": ((3, 32, 32), 10), "mnist": ((1, 28, 28), 10)}
    if cfg.name in known:
        return known[cfg.name]
    if cfg.name == "synthetic":
        return tuple(int(s) for s in cfg.shape), cfg.classes
    ds = load_dataset(cfg)
    return ds.input_shape, ds.num_classes
