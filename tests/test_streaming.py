"""Datasets bigger than memory (psgd/data.py): torch Datasets from a factory, read
through DataLoaders, a disjoint partition per rank reshuffled every epoch."""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from psgd.config import Config, ConfigError
from psgd.data import DataError, StreamingDataset, check_dataset, load_dataset, partition
from psgd.models import build_model
from psgd.replica import Replica

FACTORY = "tests.streaming_data:on_demand"


class Indexed(torch.utils.data.Dataset):
    """Item i is (tensor([i]), i % 3): a batch says which indices it read."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]), i % 3


def small() -> tuple[Indexed, Indexed]:
    return Indexed(100), Indexed(30)


def read(batches, steps: int) -> list[int]:
    return [int(v) for _ in range(steps) for v in batches.next()[0][:, 0].tolist()]


@pytest.mark.unit
def test_each_rank_reads_a_disjoint_part_reshuffled_every_epoch():
    cfg = Config().replace(**{"data.name": "tests.test_streaming:small", "data.classes": 3})
    ds = load_dataset(cfg.data)
    assert isinstance(ds, StreamingDataset) and ds.train_size == 100 and ds.input_shape == (1,)
    parts = [partition(ds.train_size, r, 2, seed=5) for r in range(2)]
    b0 = ds.train_batches(parts[0], 10, seed=5, rank=0)
    epoch1, epoch2 = read(b0, 5), read(b0, 5)   # 50 indices per rank: 5 batches an epoch
    assert sorted(epoch1) == sorted(epoch2) == sorted(parts[0].tolist())
    assert epoch1 != epoch2 and b0.epoch == 1          # reshuffled
    again = ds.train_batches(parts[0], 10, seed=5, rank=0)
    assert read(again, 5) == epoch1                    # from the seed
    b1 = ds.train_batches(parts[1], 10, seed=5, rank=1)
    assert not set(read(b1, 5)) & set(epoch1)          # disjoint
    x, y = ds.take(np.array([3, 4]))
    assert x[:, 0].tolist() == [3.0, 4.0] and y.tolist() == [0, 1]


@pytest.mark.unit
def test_the_evaluator_streams_the_test_set():
    ds = load_dataset(Config().replace(**{"data.name": FACTORY, "data.classes": 10}).data)
    model = build_model("mlp", ds.input_shape, ds.num_classes, 0, 16)
    acc, loss = Replica(model, 1, torch.device("cpu")).score_batches(ds.test_batches(256))
    assert 0.0 <= acc <= 1.0 and loss > 0
    seen = sum(len(y) for _, y in ds.test_batches(256))
    assert seen == 2000


@pytest.mark.unit
def test_bad_dataset_factories_say_what_is_wrong():
    with pytest.raises(ConfigError, match=r"data.classes must be 0 \(the dataset's own\) or >= 2, got 1"):
        Config().replace(**{"data.name": "tests.test_streaming:small", "data.classes": 1})
    with pytest.raises(DataError, match="set data.classes"):   # unset: a Dataset does not say how many
        load_dataset(Config().replace(**{"data.name": "tests.test_streaming:small"}).data)
    with pytest.raises(DataError, match="label is 2, not in 0..1; set data.classes"):
        load_dataset(Config().replace(**{"data.name": "tests.test_streaming:from_two", "data.classes": 2}).data)
    with pytest.raises(DataError, match=r"must return \(train_x, train_y, test_x, test_y\) or \(train_dataset"):
        load_dataset(Config().replace(**{"data.name": "tests.test_streaming:three"}).data)
    # a dict of two splits read "(not enough values to unpack (expected 4, got 2))", as if a pair had come
    with pytest.raises(DataError, match=r"or \(train_dataset, test_dataset\), got a dict$"):
        load_dataset(Config().replace(**{"data.name": "tests.test_streaming:splits_in_a_dict"}).data)
    assert load_dataset(Config().replace(**{"data.name": "tests.test_streaming:four_from_a_generator"}).data)


def three():
    return [1, 2, 3]


def four_from_a_generator():
    x, y = np.zeros((8, 2), np.float32), np.arange(8) % 2
    return (a for a in (x, y, x, y))


def splits_in_a_dict():
    x, y = np.zeros((8, 2), np.float32), np.arange(8) % 2
    return {"train": (x, y), "test": (x, y)}


def from_two() -> tuple[Indexed, Indexed]:
    """Indexed, from item 2 on: the first label is 2."""
    class Shifted(Indexed):
        def __getitem__(self, i: int):
            return super().__getitem__(i + 2)
    return Shifted(10), Shifted(10)


class Items(torch.utils.data.Dataset):
    """n items of `shape` floats of `dtype` (as numpy arrays if `numpy`), labels i % 3
    unless `label` says otherwise."""

    def __init__(self, n: int, dtype=torch.float32, numpy: bool = False, shape=(4,), label=None):
        self.n, self.dtype, self.numpy, self.label = n, dtype, numpy, label or (lambda i: i % 3)
        self.x = torch.randn((n,) + tuple(shape), generator=torch.Generator().manual_seed(n))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = self.x[i].to(self.dtype)
        return (x.numpy() if self.numpy else x), self.label(i)


def doubles():
    return Items(60, torch.float64), Items(30, torch.float64)


def numpy_doubles():
    return Items(60, torch.float64, numpy=True), Items(30, torch.float64, numpy=True)


def halves():
    return Items(60, torch.float16), Items(30, torch.float16)


def _streamed(factory: str, classes: int = 3) -> StreamingDataset:
    ds = load_dataset(Config().replace(**{"data.name": f"{__name__}:{factory}", "data.classes": classes}).data)
    assert isinstance(ds, StreamingDataset)
    return ds


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("factory", ["doubles", "numpy_doubles", "halves"])
def test_streamed_items_of_another_float_type_are_float32_as_in_memory_data_is(factory):
    """A review: float64 items (tensors or numpy arrays) failed every worker's step and
    the evaluator ("mat1 and mat2 must have the same dtype"): psgd run gave up after 5
    evaluator restarts. An in-memory factory's x is cast to float32."""
    ds = _streamed(factory)
    model = build_model("mlp", ds.input_shape, ds.num_classes, 0, 16)
    x, y = ds.train_batches(np.arange(60), 8, seed=0, rank=0).next()
    assert x.dtype == torch.float32 and model(x).shape == (8, 3)
    x, _ = ds.take(np.array([1, 2]))
    assert x.dtype == torch.float32
    assert all(x.dtype == torch.float32 for x, _ in ds.test_batches(16))
    acc, loss = Replica(model, 1, torch.device("cpu")).score_batches(ds.test_batches(16))
    assert 0.0 <= acc <= 1.0 and loss > 0


def float_labels():
    return Items(60, label=lambda i: float(i % 3)), Items(30)


def float_test_labels():
    return Items(60), Items(30, label=lambda i: float(i % 3))


def column_labels():   # a label as tensor([y]): batches of N x 1 labels
    return Items(60, label=lambda i: torch.tensor([i % 3])), Items(30)


def late_float_labels():   # the first item's label is an int, the others floats
    return Items(60, label=lambda i: 0 if i == 0 else float(i % 3)), Items(30)


def small_int_labels():    # int32 and bool labels: class indices, as int64 ones
    return Items(60, label=lambda i: np.int32(i % 3)), Items(30, label=lambda i: torch.tensor(i % 2 == 0))


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("factory,says", [
    ("float_labels", "the first training item's label is 0.0, a float, not a class index (an int)"),
    ("float_test_labels", "the first test item's label is 0.0, a float, not a class index (an int)"),
    ("column_labels", "the first training item's label is tensor([0]), a Tensor, not a class index (an int)"),
])
def test_a_streamed_label_that_is_not_an_int_is_refused_before_the_job(factory, says):
    """A review: float labels (1.0) passed int(y); every worker and the evaluator failed
    ("expected target dtype to be Long"), psgd run giving up after 5 evaluator restarts."""
    name = f"{__name__}:{factory}"
    for check in (check_dataset, load_dataset):
        with pytest.raises(DataError, match=rf"^data.name '{name}': {re.escape(says)}$"):
            check(Config().replace(**{"data.name": name, "data.classes": 3}).data)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_float_labels_after_the_first_item_are_refused_in_the_batch_and_other_integers_taken():
    batches = _streamed("late_float_labels").train_batches(np.arange(60), 8, seed=0, rank=0)
    with pytest.raises(DataError, match=r"^data.name 'tests.test_streaming:late_float_labels': the training labels "
                                        r"must be class indices \(ints\), got torch.float64 ones such as \["):
        batches.next()
    ds = _streamed("small_int_labels")
    _, y = ds.train_batches(np.arange(60), 8, seed=0, rank=0).next()
    assert y.dtype == torch.int64
    assert all(y.dtype == torch.int64 for _, y in ds.test_batches(16))
    assert ds.take(np.array([1, 2]))[1].tolist() == [1, 2]


def other_test_shape():
    return Items(60), Items(30, shape=(5,))


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_streamed_test_set_of_another_sample_shape_is_refused_before_the_job():
    """A review: the evaluator failed with a traceback (mat1 and mat2 shapes cannot be
    multiplied), restarted 5 times; an in-memory factory's shapes were compared."""
    name = f"{__name__}:other_test_shape"
    for check in (check_dataset, load_dataset):
        with pytest.raises(DataError, match=rf"^data.name '{name}': a training sample has shape \(4,\), "
                                            rf"a test sample \(5,\)$"):
            check(Config().replace(**{"data.name": name, "data.classes": 3}).data)


def late_label_7():        # item 5's label is 7 (data.classes = 3): the first item's is fine
    return Items(60, label=lambda i: 7 if i == 5 else i % 3), Items(30, label=lambda i: -1 if i == 21 else i % 3)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_streamed_label_out_of_range_after_the_first_item_is_one_data_error_naming_it():
    """A review: label 7 at index 5 (data.classes = 3) killed a worker mid-training
    (IndexError: Target 7 is out of bounds) and the job went on with the other; in the
    test set it killed the evaluator, restarted 5 times."""
    ds = _streamed("late_label_7")
    says = r"^data.name 'tests.test_streaming:late_label_7': the {} item at index {} has label {}, not in 0..2 " \
           r"\(data.classes = 3\)$"
    for rank, part in enumerate((np.arange(0, 60, 2), np.arange(1, 60, 2))):   # item 5 in rank 1's part only
        batches = ds.train_batches(part, 5, seed=0, rank=rank)
        if rank == 0:
            for _ in range(30):   # (5 epochs of 6 batches)
                batches.next()
            continue
        with pytest.raises(DataError, match=says.format("training", 5, 7)):
            for _ in range(6):    # (an epoch)
                batches.next()
    with pytest.raises(DataError, match=says.format("test", 21, -1)):
        list(ds.test_batches(8))
    with pytest.raises(DataError, match=says.format("training", 5, 7)):
        ds.take(np.array([4, 5]))


class Shaped(Items):
    """A Dataset that says its samples' shape in an attribute `shape`, as some do."""

    def __init__(self, n: int):
        super().__init__(n)
        self.shape = (4,)


def with_shape_attribute():
    return Shaped(60), Shaped(30)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_torch_dataset_with_a_shape_attribute_is_streamed_not_taken_for_an_array():
    """A review: such a Dataset was taken for an array: "the factory must return (train_x,
    train_y, test_x, test_y) ... (setting an array element with a sequence ...)"."""
    ds = _streamed("with_shape_attribute")
    assert ds.train_size == 60 and ds.input_shape == (4,)


class Unreadable(Items):
    def __getitem__(self, i: int):
        raise FileNotFoundError(f"/data/img{i}.png")


def unreadable_test_set():
    return Items(60), Unreadable(30)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_dataset_whose_first_item_raises_is_one_data_error_naming_the_factory_and_where():
    """A review: psgd run said only "psgd run: error: /data/img0.png" (which factory?),
    and an exception that is not an OSError was a traceback."""
    name = f"{__name__}:unreadable_test_set"
    for check in (check_dataset, load_dataset):
        with pytest.raises(DataError, match=rf"^data.name '{name}': the test dataset's item 0 raised "
                                            rf"FileNotFoundError: /data/img0.png \({re.escape(__file__)}, line \d+\)$"):
            check(Config().replace(**{"data.name": name, "data.classes": 3}).data)


class Flawed(Items):
    """Items whose item `raises` cannot be read and whose item `odd` has 5 values, not 4."""

    def __init__(self, n: int, raises: int = -1, odd: int = -1):
        super().__init__(n)
        self.raises, self.odd = raises, odd

    def __getitem__(self, i: int):
        if i == self.raises:
            raise OSError(f"cannot read /data/img{i}.png")
        x, y = super().__getitem__(i)
        return (torch.zeros(5) if i == self.odd else x), y


def flawed_later():   # item 0 of each is fine: the checks before the job pass
    return Flawed(60, raises=5, odd=40), Flawed(30, raises=21)


def unreadable_later():
    return Flawed(60, raises=5), Items(30)


# (a loader process is a process: that case is not a unit test)
BY_LOADER = [pytest.param(0, marks=pytest.mark.unit), pytest.param(1, marks=pytest.mark.processes)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loader_workers", BY_LOADER)
def test_a_streamed_item_that_cannot_be_read_after_the_first_is_one_data_error_naming_it(loader_workers):
    """A review: an item whose __getitem__ raised (a file not found) or whose x had another
    shape (default_collate: "stack expects each tensor to be equal size") failed the worker
    that read it, and the job went on without it and ended with exit 0; in the test set
    it failed the evaluator. It is now a DataError naming the item, as a label out of
    range is, which ends the job."""
    import gc
    ds = dataclasses.replace(_streamed("flawed_later"), loader_workers=loader_workers)
    name = "tests.test_streaming:flawed_later"
    raised = rf"raised OSError: cannot read /data/img{{}}.png \({re.escape(__file__)}, line \d+\)$"

    def epoch(part: np.ndarray, rank: int) -> None:
        batches = ds.train_batches(part, 5, seed=0, rank=rank)
        for _ in range(6):
            batches.next()

    def error_of(read) -> str:   # (its loader process ends with the error and the loader, not kept by the test)
        try:
            read()
        except DataError as e:
            return str(e)
        return "no error"

    said = [error_of(lambda: epoch(np.arange(0, 30), 0)), error_of(lambda: epoch(np.arange(30, 60), 1)),
            error_of(lambda: list(ds.test_batches(8))), error_of(lambda: ds.take(np.array([4, 5])))]
    gc.collect()
    assert re.match(rf"^data.name '{name}': the training item at index 5 " + raised.format(5), said[0]), said
    assert re.match(rf"^data.name '{name}': the training item at index 40 has x of shape \(5,\), item \d+'s "
                    rf"\(4,\): a batch's items must all have one shape$", said[1]), said
    assert re.match(rf"^data.name '{name}': the test item at index 21 " + raised.format(21), said[2]), said
    assert re.match(rf"^data.name '{name}': the training item at index 5 " + raised.format(5), said[3]), said


class Hiccup(Items):
    """Item 5 cannot be read the first time only (a file server's hiccup)."""

    def __init__(self, n: int):
        super().__init__(n)
        self.failed = False

    def __getitem__(self, i: int):
        if i == 5 and not self.failed:
            self.failed = True
            raise OSError("Stale file handle")
        return super().__getitem__(i)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_read_error_that_reading_again_does_not_give_stands_as_it_was():
    """A review: such an error became a DataError that ended the job, where a restart of
    the worker (--restart-workers) or of the evaluator read on. It is left as it came."""
    ds = StreamingDataset(Hiccup(60), Items(30), 3, (4,))
    with pytest.raises(OSError, match="Stale file handle"):
        ds.take(np.array([4, 5]))
    assert len(ds.take(np.array([4, 5]))[1]) == 2


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_job_whose_worker_reads_an_unreadable_item_ends_naming_it(tmp_path):
    """The job of the test above: it ends with an error (exit 1), not without the worker."""
    import os
    import subprocess
    import sys

    from tests.conftest import free_port_block
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSGD_")}
    r = subprocess.run([sys.executable, "-m", "psgd", "run", "--out", str(tmp_path / "out"),
                        "--set", f"data.name={__name__}:unreadable_later", "--set", "data.classes=3",
                        "--set", "model.name=mlp", "--set", "train.batch_size=5", "--set", "train.steps=40",
                        "--set", f"cluster.port={free_port_block(4)}"],
                       capture_output=True, text=True, timeout=100, env=env)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "job aborted: worker" in r.stderr and "the training item at index 5 raised OSError: cannot read " \
           "/data/img5.png" in r.stderr, r.stderr[-2000:]


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM), in MB; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_job_trains_on_a_million_samples_made_on_demand_in_bounded_memory(tmp_path, monkeypatch):
    import os
    import time

    from psgd.config import load
    from psgd.launcher import LocalJob
    from tests.conftest import free_port_block
    cfg = load(None, [f"cluster.port={free_port_block(4)}", f"data.name={FACTORY}", "data.classes=10",
                      "data.loader_workers=1", "train.steps=150", "cluster.servers=1"], env={})
    import shutil
    import tempfile
    from pathlib import Path
    # the daemons' temp folder (their loader processes' `pymp-*`): a short path, as a socket's path in it
    # must fit in 108 bytes (under pytest-xdist's tmp_path, the job's loader processes waited for good)
    temp = Path(tempfile.mkdtemp(prefix="psgd-t", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(temp))
    job = LocalJob(cfg, str(tmp_path / "out"), quiet=True, timeout_s=240)
    peaks: dict[str, float] = {}
    try:
        job.start()
        while job.children[0].poll() is None:  # sample the workers' peak memory while they train
            for name in ("worker-0", "worker-1"):
                try:   # (read once: a worker that ends removes its pid file, between two reads in CI)
                    pid = int((tmp_path / "out" / "pids" / f"{name}.pid").read_text().split()[0])
                except (OSError, ValueError, IndexError):   # not there yet, or gone, or half written
                    continue
                peaks[name] = max(peaks.get(name, 0.0), peak_rss_mb(pid))
            time.sleep(0.2)
        summary = job.wait()
    finally:
        job.stop()
        left = [p.name for p in temp.iterdir() if p.name.startswith("pymp-")]
        shutil.rmtree(temp, ignore_errors=True)
    # 1,000,000 samples of 3 x 32 x 32 float32 are 12 GB: a worker that held its half
    # would need 6 GB. Each holds its partition's indices and the batches in flight.
    assert set(peaks) == {"worker-0", "worker-1"} and max(peaks.values()) < 1024, peaks
    print(f"workers' peak memory: {peaks} MB")
    assert summary["samples"] == 2 * 150 * 32 and summary["final_accuracy"] >= 0.8, summary
    assert os.path.exists(tmp_path / "out" / "model.pt")
    assert not left   # each daemon with loader processes left its multiprocessing folder: they end in os._exit


def late_label_7_in_training():   # item 5's training label is 7 (data.classes = 3); the test set is fine
    return Items(200, label=lambda i: 7 if i == 5 else i % 3), Items(30)


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_label_out_of_range_that_a_worker_reads_mid_training_ends_the_job_naming_it(tmp_path):
    """A review: the worker that read label 7 (data.classes = 3) died with a DataError
    (exit 2), the job went on with the other worker and ended with an accuracy; it now
    ends the job (a worker's finish with an error), with the data's line as the reason."""
    ends_naming(tmp_path, "late_label_7_in_training", r"worker 1: data.name '.*late_label_7_in_training': the "
                r"training item at index 5 has label 7, not in 0..2", "train.steps=200", "cluster.evaluator=false")


def late_label_in_test():   # the test set's item 21 has label -1; training is fine
    return Items(200), Items(30, label=lambda i: -1 if i == 21 else i % 3)


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_label_out_of_range_that_the_evaluator_reads_ends_the_job_at_once_naming_it(tmp_path):
    """A review: the evaluator that read label -1 exited 2 (a DataError), and psgd run
    restarted it five times, each saying the same, before it gave up."""
    ends_naming(tmp_path, "late_label_in_test", r"^evaluator-0 stopped: data.name '.*late_label_in_test': the test "
                r"item at index 21 has label -1, not in 0..2", "train.steps=300", "faults.step_delay_s=0.01")


class Tokens(Items):
    """Items whose x are token ids (int64), for a model that embeds them."""

    def __getitem__(self, i: int):
        return torch.arange(4, dtype=torch.int64) + i % 7, i % 3


def token_ids():
    return Tokens(60), Tokens(30)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_streamed_token_ids_stay_integers_for_an_embedding():
    """A review: every streamed batch's x was cast to float32, token ids too, and a model
    that embeds them failed every step ("Expected tensor for argument #1 'indices' to
    have one of the following scalar types: Long, Int")."""
    ds = _streamed("token_ids")
    x, y = ds.train_batches(np.arange(60), 8, seed=0, rank=0).next()
    assert x.dtype == torch.int64 and y.dtype == torch.int64
    torch.nn.Embedding(16, 3)(x)   # (what failed)
    tx, _ = next(iter(ds.test_batches(8)))
    assert tx.dtype == torch.int64


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([(torch.zeros(4), 0)] * 10)


def iterable():
    return Stream(), Stream()


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_an_iterable_dataset_is_one_data_error_not_a_traceback():
    """A review: an IterableDataset (no __len__) was taken for a streamed Dataset and
    psgd run printed a traceback (TypeError: object of type 'Stream' has no len())."""
    with pytest.raises(DataError, match=r"map-style torch Datasets .* an IterableDataset is not read"):
        _streamed("iterable")


def bad_after_first():   # every label but item 0's is 7 (data.classes = 3)
    return Items(200, label=lambda i: 0 if i == 0 else 7), Items(30)


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_label_out_of_range_in_ltfbs_held_out_part_ends_the_job_naming_it(tmp_path):
    """A review: ltfb's tournament data (`ds.take`) was read before the worker's steps,
    outside what turns a DataError into the job's end: the worker exited 2 and the job
    went on without it."""
    ends_naming(tmp_path, "bad_after_first", r"worker \d: data.name '.*bad_after_first': the training item at "
                r"index \d+ has label 7, not in 0..2", "mode.name=ltfb", "train.steps=50", "cluster.evaluator=false")


def ends_naming(tmp_path, factory: str, says: str, *sets: str) -> None:
    """A real job on `factory`'s data (data.classes = 3, one shard) ends with LaunchError `says`."""
    from psgd.config import load
    from psgd.launcher import LaunchError, LocalJob
    from tests.conftest import free_port_block
    cfg = load(None, [f"cluster.port={free_port_block(4)}", f"data.name=tests.test_streaming:{factory}",
                      "data.classes=3", "train.batch_size=8", "cluster.servers=1", *sets], env={})
    job = LocalJob(cfg, str(tmp_path), quiet=True, timeout_s=90)
    try:
        job.start()
        with pytest.raises(LaunchError, match=says):
            job.wait()
    finally:
        job.stop()


@pytest.mark.parametrize("loader_workers", BY_LOADER)
def test_batches_sought_to_a_step_continue_where_drawing_that_many_would(loader_workers):
    """A resumed job's worker (and a restarted one) drew its rank's data from epoch 0's
    first batch again: the batches that `seek(steps)` leads to are those after `steps` drawn."""
    cfg = Config().replace(**{"data.name": "tests.test_streaming:small", "data.classes": 3,
                              "data.loader_workers": loader_workers})
    ds = load_dataset(cfg.data)
    part = partition(ds.train_size, 0, 2, seed=5)
    drawn = ds.train_batches(part, 10, seed=5, rank=0)
    read(drawn, 7)
    sought = ds.train_batches(part, 10, seed=5, rank=0)
    sought.seek(7)
    assert sought.epoch == drawn.epoch == 1
    assert read(sought, 6) == read(drawn, 6)


@pytest.mark.unit
def test_a_streamed_batch_drawn_ahead_is_the_next_one_and_a_seek_drops_it():
    cfg = Config().replace(**{"data.name": "tests.test_streaming:small", "data.classes": 3})
    ds = load_dataset(cfg.data)
    part = partition(ds.train_size, 0, 2, seed=5)
    plain, early = (ds.train_batches(part, 10, seed=5, rank=0) for _ in range(2))
    for _ in range(4):
        early.ahead()
    assert read(early, 9) == read(plain, 9)
    early.ahead()
    early.seek(2)
    plain.seek(2)
    assert read(early, 3) == read(plain, 3)


class StuckInLoader(Items):
    """Every item hangs when read in a loader process (one stopped, or deadlocked after
    its fork from a process with threads), and reads at once in the process that made it."""

    def __init__(self, n: int):
        super().__init__(n)
        import os
        self.maker = os.getpid()

    def __getitem__(self, i: int):
        import os
        import time
        if os.getpid() != self.maker:
            time.sleep(3600)
        return super().__getitem__(i)


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_loader_process_that_gives_no_batch_is_one_data_error_after_data_loader_timeout_s():
    """The DataLoaders had no timeout: a loader process that stopped answering (stopped, or
    stuck in the dataset's __getitem__) held its worker, or the evaluator, for good, while
    its heartbeats went on. After data.loader_timeout_s without a batch, a DataError says
    so (the items are not read again here: a read that hangs there may hang here)."""
    import time
    ds = StreamingDataset(StuckInLoader(60), StuckInLoader(30), 3, (4,), loader_workers=1, name="stuck",
                          loader_timeout_s=1.0)
    for read in (lambda: ds.train_batches(np.arange(60), 5, seed=0, rank=0).next(), lambda: list(ds.test_batches(8))):
        t0 = time.monotonic()
        with pytest.raises(DataError) as e:
            read()
        assert time.monotonic() - t0 < 30
        split = "training" if "training" in str(e.value) else "test"
        assert str(e.value) == (f"data.name 'stuck': a DataLoader process gave no {split} batch within "
                                f"data.loader_timeout_s = 1 s (it stopped, or the dataset's __getitem__ hangs "
                                f"there)")
    with pytest.raises(DataError, match="gave no training batch"):   # a resumed worker's seek waits for the
        ds.train_batches(np.arange(60), 5, seed=0, rank=0).seek(3)   # batches its loader process owes first


class StuckAfterOneBatch(StuckInLoader):
    """A loader process reads 5 items (one batch of 5), then hangs in the next."""

    def __getitem__(self, i: int):
        import os
        if os.getpid() != self.maker:
            self.read = getattr(self, "read", 0) + 1
            if self.read <= 5:
                return Items.__getitem__(self, i)
        return super().__getitem__(i)


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_stopped_loader_process_is_a_data_error_and_is_not_left_stopped():
    """A loader process stopped (SIGSTOP) does not take the SIGTERM that ends a loader: it
    was left stopped, and a process whose multiprocessing joins its children at exit (a
    daemon not forked by psgd run's fork server) hung there. It is killed. (Stopped while
    a batch of its is on its way, its reader waits for it in torch's own code, without
    a timeout: stopped here while it reads an item.)"""
    import os
    import signal
    ds = StreamingDataset(StuckAfterOneBatch(60), Items(30), 3, (4,), loader_workers=1, name="stopped",
                          loader_timeout_s=1.0)
    batches = ds.train_batches(np.arange(60), 5, seed=0, rank=0)
    batches.next()
    pid = batches._it._workers[0].pid
    os.kill(pid, signal.SIGSTOP)
    with pytest.raises(DataError, match="gave no training batch"):
        batches.next()
    assert not os.path.exists(f"/proc/{pid}"), "the stopped loader process is still there"
