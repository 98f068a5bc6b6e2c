"""Datasets and per-worker partitions.

Built-in: `digits` (scikit-learn's 1,797 8x8 handwritten digits, shipped inside that
package: no download), `synthetic` (Gaussian classes of any shape, for throughput),
`cifar10` (the official binary files in data.path), `mnist` (IDX files in data.path,
optionally .gz). A user dataset is `package.module:factory`, called with no arguments,
returning either (train_x, train_y, test_x, test_y) as arrays or tensors (x as N x C x H x W
or N x D floats, y as N class indices >= 0; `data.classes`, where set, is the number of
classes, else the largest label + 1), or (train_dataset, test_dataset) as torch
`Dataset`s whose items are (tensor, int label), with `data.classes` saying how many
classes there are (x is made float32 in both; streamed integer x, token ids, is kept): those are streamed through a
`DataLoader` (`data.loader_workers` processes), so a dataset bigger than memory
trains; each worker reads only its
partition, reshuffled every epoch from the seed (as DistributedSampler does), and the
evaluator streams the test set. A worker that starts at a clock past 0 (a resumed job's,
a restarted one) `seek`s its batches there: it goes on in the epoch its rank had reached.

The built-in datasets' inputs, as the model trains on them and as a user feeds the saved
DIR/model.pt (README, "Output files"): digits: pixels (0..16) / 16, then standardised by
the mean and sd of all 1,797 images' pixels (0.3053 and 0.3760); mnist: bytes / 255, then
(x - MNIST_MEAN) / MNIST_STD; cifar10: bytes / 255, then per channel (x - CIFAR_MEAN) /
CIFAR_STD; synthetic: as drawn. A factory's are used as it returns them.

Both kinds answer the same calls: `train_size`, `train_batches(...)` (endless
mini-batches over a partition), `take(indices)` (a small held-out set, as tensors) and
`test_batches(batch_size)`.

A missing, truncated or malformed file raises `DataError` with one line that names the
file and what is wrong; `check_dataset` says so without torch (the launcher calls it
before starting any process).

torch is imported when a dataset is made into tensors, not with this module, and the
digits are read from scikit-learn's file without importing scikit-learn (which takes
longer than the rest of a worker's start-up on a small machine).
"""
from __future__ import annotations

import contextlib
import gzip
import importlib.util
import operator
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from .config import ConfigError, DataConfig, synthetic_classes

if TYPE_CHECKING:
    import torch

SPLIT_SEED = 1234  # the train/test split does not depend on the job seed
CIFAR_RECORD = 1 + 3 * 32 * 32
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


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

    @property
    def train_size(self) -> int:
        return len(self.train_y)

    def train_batches(self, indices: np.ndarray, batch_size: int, seed: int, rank: int) -> Batches:
        return Batches(self.train_x, self.train_y, indices, batch_size, seed, rank)

    def take(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        import torch
        sel = torch.from_numpy(np.asarray(indices))
        return self.train_x[sel], self.train_y[sel]

    def test_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(0, len(self.test_y), batch_size):
            yield self.test_x[i:i + batch_size], self.test_y[i:i + batch_size]


@dataclass
class StreamingDataset:
    """torch Datasets read through DataLoaders: only the batches in flight are in memory."""
    train: Any
    test: Any
    num_classes: int
    input_shape: tuple
    loader_workers: int = 0
    name: str = ""   # data.name, for the errors
    loader_timeout_s: float = DataConfig.loader_timeout_s   # a loader process's batch, at most (data.loader_timeout_s)

    @property
    def train_size(self) -> int:
        return len(self.train)

    def train_batches(self, indices: np.ndarray, batch_size: int, seed: int, rank: int) -> LoaderBatches:
        return LoaderBatches(self.train, indices, batch_size, seed, rank, self.loader_workers, self.name,
                             self.num_classes, self.loader_timeout_s)

    def take(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        from torch.utils.data import default_collate
        try:
            x, y = default_collate([self.train[int(i)] for i in indices])
        except Exception as e:
            unreadable(self.train, indices, self.name, "training", e)
            raise
        return _streamed_batch(x, y, self.name, "training", self.num_classes, lambda k: int(indices[k]))

    def test_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        from torch.utils.data import DataLoader
        start = 0
        _own_temp_dir(self.loader_workers)
        batches = iter(DataLoader(self.test, batch_size=batch_size, num_workers=self.loader_workers,
                                  timeout=loader_timeout(self.loader_workers, self.loader_timeout_s)))
        while True:
            try:
                x, y = next(batches)
            except StopIteration:
                return
            except Exception as e:
                no_batch(e, batches, self.name, "test", self.loader_timeout_s)
                unreadable(self.test, range(start, min(start + batch_size, len(self.test))), self.name, "test", e)
                raise
            yield _streamed_batch(x, y, self.name, "test", self.num_classes, partial(operator.add, start))
            start += len(y)


def loader_timeout(loader_workers: int, timeout_s: float) -> float:
    """A DataLoader's `timeout`: how long it waits for a loader process's batch (without
    one, a loader process stopped, or stuck in the dataset's `__getitem__`, held its psgd
    worker for good while the heartbeats went on); none without loader processes."""
    return timeout_s if loader_workers > 0 else 0


def no_batch(error: Exception, batches: Any, name: str, split: str, timeout_s: float) -> None:
    """Raise a DataError if `error` is a DataLoader's for a batch that did not come within
    its `timeout` (`loader_timeout`), once the loader processes of its iterator `batches`
    are stopped: ended later, by the garbage collector, the SIGCHLD handler of torch's
    loaders raised "DataLoader worker ... is killed" wherever this process then was. The
    batch's items are not read again here (`unreadable`): a read that hangs in the loader
    process may hang here."""
    if isinstance(error, RuntimeError) and str(error).startswith("DataLoader timed out"):
        with contextlib.suppress(Exception):   # (the DataError below is the news)
            batches._shutdown_workers()   # torch's own, as its iterator's end calls it: 5 s for each to exit
            for w in batches._workers:    # ... then SIGTERM, which one stopped (SIGSTOP) does not take
                if w.is_alive():
                    w.kill()
                    w.join(5)   # (bounded: SIGKILL ends a stopped process too)
        raise DataError(f"data.name {name!r}: a DataLoader process gave no {split} batch within "
                        f"data.loader_timeout_s = {timeout_s:g} s (it stopped, or the dataset's __getitem__ "
                        f"hangs there)") from error


def unreadable(dataset: Any, indices: Iterable, name: str, split: str, error: Exception) -> None:
    """Raise a DataError for a batch of a torch Dataset's items that could not be read
    (`error`), naming the item: the first of `indices` that raises when read alone, or the
    first whose x's shape is not the batch's first item's (default_collate cannot stack
    them: "stack expects each tensor to be equal size"). Such an error failed the worker
    that read it, and the job went on without it (exit 0, with half its workers and a
    stall in sync); the evaluator's, restarted until psgd run gave up. A data bug is the
    same at every read: the job ends, as for a label out of range. Where reading again
    gives no error (a file server's hiccup, a loader process killed), nothing is raised:
    the caller's error stands, as before, and a restart of the process that met it reads on."""
    from .models import _package_root, _raised
    root = _package_root(name.partition(":")[0])
    first: tuple[int, tuple | None] | None = None
    for i in map(int, indices):
        try:
            item = dataset[i]
        except Exception as e:
            raise DataError(f"data.name {name!r}: the {split} item at index {i} raised {_raised(e, root)}") from error
        shape = tuple(getattr(item[0], "shape", ())) if isinstance(item, (tuple, list)) and item else None
        if first is None:
            first = (i, shape)
        elif shape != first[1]:
            raise DataError(f"data.name {name!r}: the {split} item at index {i} has x of shape {shape}, item "
                            f"{first[0]}'s {first[1]}: a batch's items must all have one shape") from error


def _streamed_batch(x: torch.Tensor, y: torch.Tensor, name: str, split: str, classes: int,
                    index: Callable[[int], int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of a torch Dataset's items as the model takes it: floating x as float32,
    as an in-memory factory's is (float64 items failed every step and every evaluation:
    "mat1 and mat2 must have the same dtype"), integer x as it is (token ids for an
    nn.Embedding), y as int64, or a DataError if the labels
    are not integers (`_streaming` checks the first item's; float ones after it failed
    every step: "expected target dtype to be Long") or one is not in 0..classes - 1
    (`index(k)`: the dataset's index of the batch's item k): one out of range failed the
    worker that read it ("Target 7 is out of bounds"), and the job went on without it,
    or the evaluator, restarted until psgd run gave up. A streamed dataset's labels are
    not all read before the job (it may be bigger than memory): each batch's are
    checked, which costs the min and max of a few ints."""
    import torch
    if y.dtype != torch.int64:
        if y.is_floating_point() or y.is_complex():
            raise DataError(f"data.name {name!r}: the {split} labels must be class indices (ints), got {y.dtype} "
                            f"ones such as {y[:3].tolist()}")
        y = y.long()
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= classes):
        k = int(((y < 0) | (y >= classes)).nonzero()[0, 0])
        raise DataError(f"data.name {name!r}: the {split} item at index {index(k)} has label {int(y[k])}, not in "
                        f"0..{classes - 1} (data.classes = {classes})")
    return (x.float() if x.is_floating_point() and x.dtype != torch.float32 else x), y


def _test_count(n: int, test_fraction: float) -> int:
    """How many of `n` samples `_split` holds out for the test set."""
    return max(1, int(round(n * test_fraction)))


def _split(x: np.ndarray, y: np.ndarray, test_fraction: float):
    perm = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    n_test = _test_count(len(x), test_fraction)
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


DIGITS_SAMPLES = 1797  # scikit-learn's digits: the training set's size without reading them


def _digits(cfg: DataConfig):
    images, y = _digits_raw()
    x = images.astype(np.float32)[:, None, :, :] / 16.0
    x = (x - x.mean()) / x.std()
    return _split(x, y, cfg.test_fraction) + (10,)


KNOWN = {"digits": ((1, 8, 8), 10), "cifar10": ((3, 32, 32), 10), "mnist": ((1, 28, 28), 10)}  # (shape, classes)


def _classes(cfg: DataConfig, own: int) -> int:
    """The number of classes the model gets: data.classes where set, else the dataset's
    `own` (the largest label + 1), which the labels must fit."""
    if not cfg.classes:
        return own
    if own > cfg.classes:
        raise DataError(f"data.name {cfg.name!r}: label {own - 1} is out of range for data.classes = {cfg.classes} "
                        f"(0 = the dataset's own number of classes)")
    return cfg.classes


def _check_synthetic(cfg: DataConfig) -> tuple[int, ...]:
    shape = tuple(int(s) for s in cfg.shape)
    if not shape or any(s < 1 for s in shape):
        raise DataError(f"data.shape must be positive sizes, got {cfg.shape}")
    classes = synthetic_classes(cfg)
    if classes < 2 or cfg.samples < classes:
        raise DataError("data.classes must be >= 2 and data.samples >= data.classes")
    return shape


def _synthetic_size(cfg: DataConfig) -> int:
    """How many samples to draw so that `_split` leaves data.samples for training: the
    first count from samples / (1 - test_fraction) on that does (that count alone, which
    fell short for some settings, made the sets that had data.samples: they stay the same)."""
    n = int(cfg.samples / (1 - cfg.test_fraction))
    while n - _test_count(n, cfg.test_fraction) < cfg.samples:
        n += 1
    return n


def _synthetic(cfg: DataConfig, seed: int):
    shape = _check_synthetic(cfg)
    classes = synthetic_classes(cfg)
    rng = np.random.default_rng(seed + 7)
    n = _synthetic_size(cfg)
    centers = rng.normal(size=(classes,) + shape).astype(np.float32)
    y = rng.integers(0, classes, size=n)
    x = centers[y] + 2.0 * rng.normal(size=(n,) + shape).astype(np.float32)
    return _split(x.astype(np.float32), y.astype(np.int64), cfg.test_fraction) + (classes,)


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
        images = _mnist_path(cfg.path, f"{split}-images-idx3-ubyte")
        xi = _idx(images, 0x803, 3)
        if xi.shape[1:] != KNOWN["mnist"][0][1:]:   # (the shards build the model from that shape, not the files)
            raise DataError(f"{images}: images of {xi.shape[1]}x{xi.shape[2]}, data.name = mnist is 28x28 "
                            f"(other images: a data.name factory)")
        yi = _idx(_mnist_path(cfg.path, f"{split}-labels-idx1-ubyte"), 0x801, 1)
        if len(xi) != len(yi):
            raise DataError(f"{cfg.path}: {split} has {len(xi)} images but {len(yi)} labels")
        if yi.size and yi.max() > 9:
            raise DataError(f"{cfg.path}: {split} label {int(yi.max())} out of range 0..9")
        x = (xi.astype(np.float32)[:, None] / 255.0 - MNIST_MEAN) / MNIST_STD
        out += [x, yi.astype(np.int64)]
    return tuple(out) + (10,)


def _call_factory(cfg: DataConfig):
    from .models import load_factory  # torch: a user's factory may return tensors
    return load_factory(cfg.name, "data.name")()


def _is_datasets(got: Any) -> bool:
    """(train_dataset, test_dataset): two torch Datasets, or two objects with __getitem__
    and __len__ that are not arrays or tensors (a Dataset with an attribute `shape` was
    taken for an array)."""
    from torch.utils.data import Dataset
    return (isinstance(got, (tuple, list)) and len(got) == 2
            and all(isinstance(d, Dataset) or hasattr(d, "__getitem__") and hasattr(d, "__len__")
                    and not hasattr(d, "shape") for d in got))


def _first_item(cfg: DataConfig, dataset: Any, split: str) -> tuple[tuple, int]:
    """(x's shape, label) of a torch Dataset's first item, or a DataError: the label must
    be an integer (a float one, 1.0, failed every step and every evaluation: "expected
    target dtype to be Long"; a tensor([1]) gave N x 1 labels)."""
    try:
        item = dataset[0]
    except Exception as e:   # (a file it reads not found: "psgd run: error: /data/img0.png", which factory?)
        from .models import _package_root, _raised
        raise DataError(f"data.name {cfg.name!r}: the {split} dataset's item 0 raised "
                        f"{_raised(e, _package_root(cfg.name.partition(':')[0]))}") from e
    try:
        x, y = item
        shape = tuple(x.shape)
    except (TypeError, ValueError, AttributeError) as e:
        raise DataError(f"data.name {cfg.name!r}: a dataset's items must be (tensor, int label) ({e})") from None
    whole = isinstance(y, (int, np.integer)) or (
        getattr(y, "ndim", None) == 0 and hasattr(y, "dtype") and str(y.dtype).removeprefix("torch.").startswith(
            ("int", "uint", "bool")))
    if not whole:
        raise DataError(f"data.name {cfg.name!r}: the first {split} item's label is {y!r:.40}, a {type(y).__name__}, "
                        f"not a class index (an int)")
    return shape, int(y)


def _streaming(cfg: DataConfig, got: Any) -> StreamingDataset:
    train, test = got
    if not all(hasattr(d, "__len__") and hasattr(d, "__getitem__") for d in got):   # (TypeError: no len())
        raise DataError(f"data.name {cfg.name!r}: the datasets must be map-style torch Datasets (with __len__ "
                        f"and __getitem__); an IterableDataset is not read, since each worker reads its own "
                        f"partition by index")
    if len(train) == 0 or len(test) == 0:
        raise DataError(f"data.name {cfg.name!r}: the train or the test dataset is empty")
    shape, label = _first_item(cfg, train, "training")
    test_shape, _ = _first_item(cfg, test, "test")
    if test_shape != shape:   # (the evaluator failed every score: "mat1 and mat2 shapes cannot be multiplied")
        raise DataError(f"data.name {cfg.name!r}: a training sample has shape {shape}, a test sample {test_shape}")
    if cfg.classes < 2:
        raise DataError(f"data.name {cfg.name!r}: set data.classes (>= 2) to the number of classes")
    if not 0 <= label < cfg.classes:
        raise DataError(f"data.name {cfg.name!r}: the first training item's label is {label}, not in "
                        f"0..{cfg.classes - 1}; set data.classes to the number of classes")
    return StreamingDataset(train, test, cfg.classes, shape, cfg.loader_workers, cfg.name, cfg.loader_timeout_s)


def _labels(cfg: DataConfig, y: np.ndarray) -> np.ndarray:
    """A factory's labels as int64, or a DataError: they must be one whole number >= 0 per
    sample (float targets were truncated, to one class when in [0, 1); N x 1 labels and
    negative ones failed every step inside torch)."""
    if y.ndim != 1:
        raise DataError(f"data.name {cfg.name!r}: the labels must be one integer per sample (shape (N,)), "
                        f"got shape {y.shape}")
    if not (np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_
            or np.issubdtype(y.dtype, np.floating) and np.isfinite(y).all() and (y == np.round(y)).all()):
        raise DataError(f"data.name {cfg.name!r}: the labels must be whole numbers (class indices), got {y.dtype} "
                        f"values such as {y[:3].tolist()}")
    if y.min() < 0:
        raise DataError(f"data.name {cfg.name!r}: the labels must be class indices >= 0, got {y.min()}")
    return y.astype(np.int64)


def _host_array(a: Any) -> np.ndarray:
    """An array or a tensor (on any device, requiring grad or not) as a numpy array."""
    return np.asarray(a.detach().cpu().numpy() if hasattr(a, "detach") else a)


FACTORY_PARTS = ("train_x", "train_y", "test_x", "test_y")


def _user(cfg: DataConfig, got: Any = None):
    got = _call_factory(cfg) if got is None else got
    if isinstance(got, (Mapping, str, bytes)) or not isinstance(got, Iterable):   # (a dict's two keys read
        # "expected 4, got 2", as a pair would; any other iterable of the four, a generator's, is taken)
        raise DataError(f"data.name {cfg.name!r}: the factory must return (train_x, train_y, test_x, test_y) "
                        f"or (train_dataset, test_dataset), got a {type(got).__name__}")
    try:
        got = tuple(got)
        tx, ty, vx, vy = (_host_array(a) for a in got)
    except (TypeError, ValueError) as e:
        raise DataError(f"data.name {cfg.name!r}: the factory must return (train_x, train_y, test_x, test_y) "
                        f"or (train_dataset, test_dataset) ({e})") from None
    for part, given, a in zip(FACTORY_PARTS, got, (tx, ty, vx, vy), strict=True):
        # (four strings or numbers became 0-d arrays: len() raised TypeError, a traceback;
        # an x of strings failed astype below)
        if a.ndim < 1:
            raise DataError(f"data.name {cfg.name!r}: {part} is a {type(given).__name__} {given!r:.40}, not an "
                            f"array or tensor of one item per sample")
        if part.endswith("_x") and not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
            raise DataError(f"data.name {cfg.name!r}: {part} holds {a.dtype} values, not numbers")
    if len(tx) != len(ty) or len(vx) != len(vy) or len(tx) == 0 or len(vx) == 0:
        raise DataError(f"data.name {cfg.name!r}: x and y lengths differ or a split is empty")
    if tx.shape[1:] != vx.shape[1:]:
        raise DataError(f"data.name {cfg.name!r}: a training sample has shape {tx.shape[1:]}, a test sample "
                        f"{vx.shape[1:]}")
    ty, vy = _labels(cfg, ty), _labels(cfg, vy)
    own = int(max(ty.max(), vy.max())) + 1
    if own < 2 and not cfg.classes:
        raise DataError(f"data.name {cfg.name!r}: every label is 0: a classifier needs two classes or more")
    return tx.astype(np.float32), ty, vx.astype(np.float32), vy, _classes(cfg, own)


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
        return _user(cfg)
    else:
        raise DataError(f"data.name {cfg.name!r}: expected digits, synthetic, cifar10, mnist "
                        f"or package.module:factory")
    return parts[:4] + (_classes(cfg, parts[4]),)


def check_dataset(cfg: DataConfig, seed: int = 0) -> int:
    """Raise the `DataError` that `load_dataset` would, without torch, or return the size of
    the training set: the files (cifar10, mnist) are read and checked as a worker will
    read them, a factory is called; digits and synthetic, which cannot fail once their
    settings are valid, are not made."""
    if cfg.name == "digits":
        if digits_file() is None and importlib.util.find_spec("sklearn") is None:
            raise DataError("data.name = digits needs scikit-learn: pip install scikit-learn")
        _classes(cfg, KNOWN["digits"][1])
        return DIGITS_SAMPLES - _test_count(DIGITS_SAMPLES, cfg.test_fraction)
    if cfg.name == "synthetic":
        _check_synthetic(cfg)
        return cfg.samples
    if ":" in cfg.name:
        got = _call_factory(cfg)
        return _streaming(cfg, got).train_size if _is_datasets(got) else len(_user(cfg, got)[1])
    return len(_arrays(cfg, seed)[1])


def load_dataset(cfg: DataConfig, seed: int = 0) -> Dataset | StreamingDataset:
    import torch
    if ":" in cfg.name:
        got = _call_factory(cfg)
        if _is_datasets(got):
            return _streaming(cfg, got)
        tx, ty, vx, vy, classes = _user(cfg, got)
    else:
        tx, ty, vx, vy, classes = _arrays(cfg, seed)
    return Dataset(torch.from_numpy(np.ascontiguousarray(tx)), torch.from_numpy(np.ascontiguousarray(ty)),
                   torch.from_numpy(np.ascontiguousarray(vx)), torch.from_numpy(np.ascontiguousarray(vy)),
                   int(classes))


def permutation(n: int, seed: int) -> np.ndarray:
    """The order of range(n) that every party deals the workers' partitions from."""
    return np.random.default_rng(seed).permutation(n)


def partition(n: int, rank: int, world: int, seed: int, perm: np.ndarray | None = None) -> np.ndarray:
    """A disjoint share of range(n) for worker `rank` of `world` (same on every party);
    the shares shrink with the rank, by one sample at most. `perm`: `permutation(n,
    seed)`, drawn once by a caller that deals every rank's share (psgd simulate: drawing
    it for each of 100,000 workers took minutes)."""
    return (permutation(n, seed) if perm is None else perm)[rank::world]


def held_out_count(size: int, fraction: float) -> int:
    """How many of a partition of `size` samples `holdout` holds out: the fraction,
    rounded, at least one."""
    return max(1, int(round(size * fraction)))


def holdout(indices: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train part, held-out part): LTFB's tournament split of a partition."""
    k = held_out_count(len(indices), fraction)
    return indices[k:], indices[:k]


def worker_part(n: int, rank: int, world: int, seed: int, split: float = 0.0,
                perm: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """(the indices worker `rank` trains on, those it holds out or None): its partition,
    less the share `split` that its mode holds out (LTFB's tournament data)."""
    part = partition(n, rank, world, seed, perm)
    if split <= 0:
        return part, None
    train, held = holdout(part, split)
    if len(part) and not len(train):
        raise DataError(f"worker {rank}: its data partition ({len(part)} sample{'s' if len(part) != 1 else ''}) is "
                        f"all held out for the mode's tournaments (at least one sample, {split:g} of it), "
                        f"none left to train on ({world} workers, {n} training sample{'s' if n != 1 else ''}: too "
                        f"many workers for the dataset)")
    return train, held


def check_partitions(n: int, world: int, seed: int, split: float = 0.0) -> None:
    """Raise the DataError that a worker of `world` would for a training set of `n`
    samples: its partition empty, or all held out by its mode (`split`). The last rank's
    partition is the smallest, so its check is every worker's; psgd run and psgd simulate
    check before a job starts (a worker that stopped there left the job to the others)."""
    rank = world - 1
    part, _ = worker_part(n, rank, world, seed, split)
    if not len(part):
        raise DataError(f"worker {rank}: its data partition is empty ({world} workers, {n} training "
                        f"sample{'s' if n != 1 else ''}: too many workers for the dataset)")


def _share(n: int, rank: int, world: int, split: float) -> int:
    """How many samples worker `rank` of `world` trains on (worker_part's, counted without
    drawing the permutation)."""
    size = len(range(rank, n, world))   # (partition's rank::world)
    return size - held_out_count(size, split) if split > 0 and size else size


def batch_over_share(n: int, batch_size: int, counts: list[tuple[int, float]]) -> str:
    """A warning for the worker counts at which train.batch_size is larger than a worker's
    share of a training set of `n` samples, else "": a batch holds no more than the share
    (Batches, LoaderBatches), so each step processes fewer samples than the config says
    and samples/s fall with the worker count for want of data, not of speed. `counts`:
    (workers, the mode's held-out share, worker_part's `split`), each said once."""
    over = []
    for world, split in dict.fromkeys(counts):
        small, large = _share(n, world - 1, world, split), _share(n, 0, world, split)
        if 0 < small < batch_size:
            over.append((world, small, large))
    if not over:
        return ""
    at = ", ".join(f"{w} worker{'s' if w != 1 else ''} ({lo}{f'-{hi}' if hi != lo else ''} each)"
                   for w, lo, hi in over)
    return (f"train.batch_size = {batch_size} is larger than a worker's share of the {n:,} training samples at "
            f"{at}: a worker's batch is its whole share, so each step processes fewer samples than "
            f"train.batch_size and samples/s fall with the batch; use fewer workers, a smaller train.batch_size "
            f"or a larger dataset")


class Lookahead:
    """A source of mini-batches whose next batch may be drawn before it is asked for
    (`ahead`): the worker draws it while its request is on the way to the shards, not
    after the answer, when its step waits for it. The batches and their order are the
    same either way, and so is the step a draw's error ends: `ahead` keeps it for the
    `next` that would have drawn that batch (raised while the request travelled, it
    ended the job with the step's push sent and its line unwritten)."""

    _held: tuple[torch.Tensor, torch.Tensor] | None = None
    _failed: Exception | None = None

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        held, self._held = self._held, None
        if held is not None:
            return held
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed
        return self._draw()

    def ahead(self) -> None:
        """Draw the next batch now (once: until `next` takes it)."""
        if self._held is None and self._failed is None:
            try:
                self._held = self._draw()
            except Exception as e:   # (a DataError, most likely: the next step's, raised by `next`)
                self._failed = e

    def _draw(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class Batches(Lookahead):
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

    def _draw(self) -> tuple[torch.Tensor, torch.Tensor]:
        import torch
        if self.pos + self.batch_size > len(self._order):
            self.epoch += 1
            self.pos = 0
            self._order = self._shuffle()
        sel = torch.from_numpy(self._order[self.pos:self.pos + self.batch_size])
        self.pos += self.batch_size
        # (x[sel]'s values: index_select is one op, advanced indexing several a call)
        return torch.index_select(self.x, 0, sel), torch.index_select(self.y, 0, sel)

    def seek(self, steps: int) -> None:
        """Continue as if `steps` batches had been drawn: where a rank's earlier process
        (a resumed job's, a restarted worker's) left its data, not at epoch 0 again."""
        per_epoch = len(self.idx) // self.batch_size
        self.epoch, self.pos = divmod(steps, per_epoch)
        self.pos *= self.batch_size
        self._order = self._shuffle()
        self._held = self._failed = None


class EpochSampler:
    """A partition's indices in a new order every epoch, from (seed, rank, epoch): what
    DistributedSampler does, with psgd's partition."""

    def __init__(self, indices: np.ndarray, seed: int, rank: int):
        self.idx, self.seed, self.rank, self.epoch = np.asarray(indices), seed, rank, 0
        self.skip = 0   # items of the epoch already served (`LoaderBatches.seek`): its next pass starts after them

    def order(self) -> list[int]:
        """The epoch's order, whole."""
        rng = np.random.default_rng([self.seed, self.rank, self.epoch])
        return self.idx[rng.permutation(len(self.idx))].tolist()

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        return iter(self.order()[skip:])

    def __len__(self) -> int:
        return len(self.idx)


def _own_temp_dir(loader_workers: int) -> None:
    """Make this process's multiprocessing temp folder before its loader processes fork,
    so that they share it and its removal is this process's, at its exit: each loader
    process that sent a batch made its own (`/tmp/pymp-*`, a socket listener's), and,
    ended from here, never removed it (a folder left by every job and test whose loader
    met an unreadable item)."""
    if loader_workers > 0:
        import multiprocessing.util
        multiprocessing.util.get_temp_dir()


class LoaderBatches(Lookahead):
    """Endless mini-batches of a torch Dataset's partition through a DataLoader
    (`loader_workers` processes; 0 = in this process), reshuffled every epoch."""

    def __init__(self, dataset: Any, indices: np.ndarray, batch_size: int, seed: int, rank: int,
                 loader_workers: int = 0, name: str = "", classes: int = 0,
                 loader_timeout_s: float = DataConfig.loader_timeout_s):
        from torch.utils.data import DataLoader
        if len(indices) == 0:
            raise DataError(f"worker {rank}: its data partition is empty (too many workers for the dataset)")
        self.batch_size = min(batch_size, len(indices))
        self.sampler = EpochSampler(indices, seed, rank)
        _own_temp_dir(loader_workers)
        self.loader = DataLoader(dataset, batch_size=self.batch_size, sampler=self.sampler, drop_last=True,
                                 num_workers=loader_workers, persistent_workers=loader_workers > 0,
                                 timeout=loader_timeout(loader_workers, loader_timeout_s))
        self._it = iter(self.loader)
        self.name, self.classes, self.timeout_s = name, classes, loader_timeout_s
        self.served = 0   # batches of this epoch so far: which indices a batch holds (`_index`)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def _draw(self) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            try:
                x, y = next(self._it)
            except StopIteration:
                self.sampler.epoch += 1
                self._it = iter(self.loader)
                self.served = 0
                x, y = next(self._it)
        except Exception as e:   # (the user's __getitem__, default_collate, a loader process)
            no_batch(e, self._it, self.name, "training", self.timeout_s)
            start = self.served * self.batch_size
            unreadable(self.loader.dataset, self.sampler.order()[start:start + self.batch_size], self.name,
                       "training", e)
            raise
        self.served += 1
        return _streamed_batch(x, y, self.name, "training", self.classes, self._index)

    def seek(self, steps: int) -> None:
        """Continue as if `steps` batches had been drawn (`Batches.seek`), without reading
        the ones skipped."""
        self.sampler.epoch, self.served = divmod(steps, len(self.sampler) // self.batch_size)
        self.sampler.skip = self.served * self.batch_size
        try:
            self._it = iter(self.loader)   # (loader processes: it waits for the batches they owe first)
        except Exception as e:
            no_batch(e, self._it, self.name, "training", self.timeout_s)   # (loader processes: the same iterator)
            raise
        self._held = self._failed = None

    def _index(self, k: int) -> int:
        """The dataset's index of item k of the latest batch (its epoch's order drawn again)."""
        return self.sampler.order()[(self.served - 1) * self.batch_size + k]


def describe(cfg: DataConfig) -> tuple[tuple, int]:
    """(input shape, number of classes) without loading the files where they are known."""
    if cfg.name in KNOWN:
        shape, own = KNOWN[cfg.name]
        return shape, _classes(cfg, own)
    if cfg.name == "synthetic":
        return tuple(int(s) for s in cfg.shape), synthetic_classes(cfg)
    ds = load_dataset(cfg)
    return tuple(ds.input_shape), ds.num_classes
