import gzip
import struct

import numpy as np
import pytest
import torch

from psgd.config import ConfigError, DataConfig
from psgd.data import Batches, DataError, describe, holdout, load_dataset, partition
from psgd.models import build_model

pytestmark = pytest.mark.unit


def test_digits_needs_no_download():
    ds = load_dataset(DataConfig())
    assert ds.input_shape == (1, 8, 8) and ds.num_classes == 10
    assert len(ds.train_y) + len(ds.test_y) == 1797
    assert describe(DataConfig()) == ((1, 8, 8), 10)


def test_synthetic_any_shape():
    ds = load_dataset(DataConfig(name="synthetic", shape=[3, 4, 4], classes=5, samples=200))
    assert ds.input_shape == (3, 4, 4) and ds.num_classes == 5 and len(ds.train_y) == 200


def test_synthetic_and_in_memory_factories_know_their_classes_with_data_classes_unset():
    assert DataConfig().classes == 0   # unset: a torch-Dataset factory must say (tests/test_streaming.py)
    ds = load_dataset(DataConfig(name="synthetic", shape=[4], samples=100))
    assert ds.num_classes == 10 and int(ds.train_y.max()) < 10
    assert describe(DataConfig(name="synthetic", shape=[4])) == ((4,), 10)
    assert load_dataset(DataConfig(name=f"{__name__}:user_data")).num_classes == 3


def test_partitions_are_disjoint_and_cover():
    parts = [partition(100, r, 3, seed=1) for r in range(3)]
    joined = np.concatenate(parts)
    assert sorted(joined.tolist()) == list(range(100))
    assert np.array_equal(parts[0], partition(100, 0, 3, seed=1))
    train, held = holdout(parts[0], 0.1)
    assert len(held) == 3 and not set(train) & set(held)


def test_batches_cycle_over_partition():
    x, y = torch.arange(10).float()[:, None], torch.arange(10)
    b = Batches(x, y, np.arange(10), 4, seed=0, rank=0)
    seen = [b.next()[1] for _ in range(5)]
    assert all(len(s) == 4 for s in seen)
    assert set(torch.cat(seen[:2]).tolist()) <= set(range(10))
    with pytest.raises(DataError, match="empty"):
        Batches(x, y, np.arange(0), 4, 0, 3)


def write_cifar(folder, n=20, truncate=None):
    rec = np.zeros((n, 3073), np.uint8)
    rec[:, 0] = np.arange(n) % 10
    for i in range(1, 6):
        (folder / f"data_batch_{i}.bin").write_bytes(rec.tobytes())
    data = rec.tobytes()
    (folder / "test_batch.bin").write_bytes(data[:truncate] if truncate else data)


def test_cifar10_binary_format(tmp_path):
    write_cifar(tmp_path)
    ds = load_dataset(DataConfig(name="cifar10", path=str(tmp_path)))
    assert ds.input_shape == (3, 32, 32) and len(ds.train_y) == 100 and len(ds.test_y) == 20


def test_cifar10_errors_are_one_line(tmp_path):
    with pytest.raises(DataError, match="data_batch_1.bin: file not found"):
        load_dataset(DataConfig(name="cifar10", path=str(tmp_path)))
    write_cifar(tmp_path, truncate=3073 * 3 + 100)
    with pytest.raises(DataError, match="test_batch.bin: .* not a whole number") as e:
        load_dataset(DataConfig(name="cifar10", path=str(tmp_path)))
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="needs data.path"):
        load_dataset(DataConfig(name="cifar10"))


def write_idx(path, arr, magic, gz=False):
    raw = struct.pack(">I", magic) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)


def test_mnist_idx(tmp_path):
    for split, n in (("train", 30), ("t10k", 10)):
        write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz", np.zeros((n, 28, 28)), 0x803, gz=True)
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte", np.arange(n) % 10, 0x801)
    ds = load_dataset(DataConfig(name="mnist", path=str(tmp_path)))
    assert ds.input_shape == (1, 28, 28) and len(ds.train_y) == 30
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.arange(10) % 10, 0x999)
    with pytest.raises(DataError, match="magic number"):
        load_dataset(DataConfig(name="mnist", path=str(tmp_path)))
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x801, 10) + b"\x01")
    with pytest.raises(DataError, match="truncated"):
        load_dataset(DataConfig(name="mnist", path=str(tmp_path)))


def test_unknown_dataset_and_factory_errors():
    with pytest.raises(DataError, match="expected digits"):
        load_dataset(DataConfig(name="imagenet"))
    with pytest.raises(ConfigError, match="cannot import"):
        load_dataset(DataConfig(name="no_such_module_xyz:make"))


def user_data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(40, 6)).astype(np.float32), np.arange(40) % 3, \
        rng.normal(size=(10, 6)).astype(np.float32), np.arange(10) % 3


def user_model(input_shape, num_classes):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(int(np.prod(input_shape)), num_classes))


def test_user_factories():
    ds = load_dataset(DataConfig(name="tests.test_data_models:user_data"))
    assert ds.input_shape == (6,) and ds.num_classes == 3
    m = build_model("tests.test_data_models:user_model", ds.input_shape, 3, seed=0)
    assert m(ds.train_x[:2]).shape == (2, 3)


@pytest.mark.parametrize("name,shape", [("mlp", (1, 8, 8)), ("cnn", (1, 8, 8)), ("resnet20", (3, 32, 32))])
def test_models_forward_and_are_seeded(name, shape):
    a, b = build_model(name, shape, 10, seed=3), build_model(name, shape, 10, seed=3)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert a(torch.zeros(2, *shape)).shape == (2, 10)


def test_resnet20_size():
    n = sum(p.numel() for p in build_model("resnet20", (3, 32, 32), 10, 0).parameters())
    assert 260_000 < n < 300_000  # He et al. 2016: 0.27M
    with pytest.raises(ConfigError):
        build_model("resnet20", (1, 4, 4), 10, 0)
