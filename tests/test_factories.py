"""A user's `model.name` / `data.name = "package.module:factory"`: what a factory that is
wrong in a user's usual ways gives (one ConfigError line naming the factory)."""
import re

import pytest

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
