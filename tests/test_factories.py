"""A user's `model.name` / `data.name = "package.module:factory"`: what a factory that is
wrong in a user's usual ways gives (one ConfigError line naming the factory)."""
import math
import re

import pytest
import torch
from torch import nn

from psgd.config import ConfigError, DataConfig
from psgd.data import check_dataset, load_dataset
from psgd.models import build_model

pytestmark = pytest.mark.unit

HERE = re.escape(__file__)


def data_raises_runtime():
    raise RuntimeError("database down")


def data_raises_file_not_found():
    raise FileNotFoundError("/data/missing.bin")


def data_raises_value():
    raise ValueError("bad split name")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("factory,says", [
    ("data_raises_runtime", "RuntimeError: database down"),
    ("data_raises_file_not_found", "FileNotFoundError: /data/missing.bin"),
    ("data_raises_value", "ValueError: bad split name"),   # (not "the factory must return ...")
])
def test_a_data_factory_that_raises_is_one_config_error_naming_it_and_where(factory, says):
    """Seen by a review: psgd run, compare and simulate printed the factory's traceback
    (a RuntimeError), or its message alone ("psgd run: error: /data/missing.bin", which
    factory?)."""
    name = f"{__name__}:{factory}"
    for check in (check_dataset, load_dataset):
        with pytest.raises(ConfigError, match=rf"^data.name '{name}': the factory raised {re.escape(says)} "
                                              rf"\({HERE}, line \d+\)$"):
            check(DataConfig(name=name))


@pytest.mark.timeout(60)
def test_a_factory_module_that_fails_to_import_is_one_config_error(tmp_path, monkeypatch):
    """Seen by a review: a data factory's module with a NameError at its top printed a
    traceback; a package not found did not say where psgd looks for it."""
    (tmp_path / "broken_factories_psgd_test.py").write_text("import torch\nx = undefined_name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"^data.name 'broken_factories_psgd_test:make': importing "
                                          r"broken_factories_psgd_test raised NameError: name 'undefined_name' is not "
                                          r"defined \(.*broken_factories_psgd_test.py, line 2\)$"):
        check_dataset(DataConfig(name="broken_factories_psgd_test:make"))
    with pytest.raises(ConfigError, match="No module named 'no_such_pkg_psgd_test'.*; psgd imports it from the folder "
                                          "it runs in and PYTHONPATH$"):
        build_model("no_such_pkg_psgd_test.nets:make", (4,), 3, seed=0)


def linear(input_shape, outputs):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), outputs))


def more_outputs(input_shape, num_classes):
    return linear(input_shape, num_classes + 3)


def other_input(input_shape, num_classes):
    return linear((7,), num_classes)


class _OneLogit(nn.Module):
    def __init__(self, input_shape):
        super().__init__()
        self.fc = nn.Linear(math.prod(input_shape), 1)

    def forward(self, x):
        return self.fc(x.flatten(1)).squeeze(1)


def one_logit(input_shape, num_classes):
    return _OneLogit(input_shape)


class _Pair(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.net = linear(input_shape, num_classes)

    def forward(self, x):
        return self.net(x), x


def pair(input_shape, num_classes):
    return _Pair(input_shape, num_classes)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("factory,says", [
    ("more_outputs", "its output for a batch of 2 inputs of shape (6,) is shape (2, 6); psgd trains it with "
                     "cross-entropy over the data's 3 classes: it must be a tensor of shape (2, 3)"),
    ("other_input", "the model fails on the data: a batch of 2 inputs of shape (6,) (float32 zeros, on cpu) "
                    "raised RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x6 and 7x3)"),
    ("one_logit", "is shape (2,);"),
    ("pair", "is a tuple;"),
])
def test_a_model_that_does_not_fit_the_data_is_a_config_error(factory, says):
    """Seen by a review: a model with 6 outputs for 3 classes trained with nothing said;
    one whose first layer took another input size, or that gave one logit, passed the
    launcher's check and failed every worker's first step and the evaluator (restarted
    five times) with a traceback."""
    with pytest.raises(ConfigError, match=f"^model.name '{__name__}:{factory}': .*{re.escape(says)}"):
        build_model(f"{__name__}:{factory}", (6,), 3, seed=0, check=True)


def batchnorm_frozen(input_shape, num_classes):
    m = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 8), nn.BatchNorm1d(8), nn.Dropout(0.5),
                      nn.Linear(8, num_classes))
    m[1].requires_grad_(False)
    m[2].running_mean.fill_(0.5)
    return m


def embedding(input_shape, num_classes):
    return nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(4 * math.prod(input_shape), num_classes))


@pytest.mark.timeout(60)
def test_the_check_leaves_the_model_as_built_and_takes_token_ids():
    """The check's forward pass changes nothing: BatchNorm's statistics and batch count,
    and every module's training mode, stay as the factory left them; a model of integer
    inputs (a streamed dataset's token ids) passes."""
    m = build_model(f"{__name__}:batchnorm_frozen", (6,), 3, seed=0, check=True)
    assert m.training and all(x.training for x in m.modules())
    assert torch.equal(m[2].running_mean, torch.full((8,), 0.5)) and int(m[2].num_batches_tracked) == 0
    embedding = build_model(f"{__name__}:embedding", (5,), 3, seed=0, check=True)
    assert embedding(torch.zeros(4, 5, dtype=torch.long)).shape == (4, 3)


def elsewhere(input_shape, num_classes):
    return linear(input_shape, num_classes).to("meta")


@pytest.mark.timeout(60)
def test_the_check_runs_a_model_on_the_device_its_factory_put_it_on():
    """A factory that moves its model to a GPU (`.cuda()`; "meta" here) is checked there:
    the CPU's zeros would make its forward raise, refusing a model that trains."""
    model = build_model(f"{__name__}:elsewhere", (6,), 3, seed=0, check=True)
    assert next(model.parameters()).device.type == "meta"


@pytest.mark.parametrize("module,means", [("tests/test_factories.py", "tests.test_factories"),
                                          ("./tests/test_factories.py", "tests.test_factories"),
                                          ("tests.test_factories.py", "tests.test_factories"),
                                          (".test_factories", "test_factories")])
def test_a_file_s_path_for_a_module_s_name_says_the_name(module, means):
    """Seen by a review: model.name = "mypkg/nets.py:make" said "No module named
    'mypkg/nets'", and ".nets:make" "importing .nets raised TypeError: the 'package'
    argument is required to perform a relative import"."""
    for check in (lambda name: build_model(name, (6,), 3, seed=0), lambda name: check_dataset(DataConfig(name=name))):
        with pytest.raises(ConfigError, match=re.escape(f"{module} is not a module's name: give it as Python imports "
                                                        f"it, e.g. {means}:linear")):
            check(f"{module}:linear")
