"""Session 32, helper D: config values refused with one line that names the key, its value and its source."""
import pytest

from psgd.config import ConfigError, load

pytestmark = pytest.mark.unit


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sets, says", [
    (["data.name=synthetic", "data.samples=0"], "--set data.samples=0: data.samples must be >= 1"),
    (["data.name=synthetic", "data.samples=5"],
     "--set data.samples=5: data.samples = 5 is fewer than the synthetic dataset's 10 classes "
     "(data.classes = 0: 10): set data.samples >= 10"),
    (["data.name=synthetic", "data.classes=3", "data.samples=2"], "set data.samples >= 3"),
    (["optimizer.step_size=0"], "--set optimizer.step_size=0: optimizer.step_size must be >= 1"),
    (["optimizer.warmup_steps=-1"], "--set optimizer.warmup_steps=-1: optimizer.warmup_steps must be >= 0, got -1"),
    (["mode.dc_lambda=-1"], "--set mode.dc_lambda=-1: mode.dc_lambda must be >= 0, got -1"),
    (["faults.on_worker_loss=stop"], "faults.on_worker_loss must be continue or abort, got 'stop'"),
])
def test_bad_value_is_named_with_its_source_and_value(sets, says):
    """data.samples below the synthetic classes passed the config and was refused by the data
    loader as "data.classes must be >= 2 and data.samples >= data.classes" (data.classes was
    the valid 0); optimizer.step_size = 0 said "optimizer.warmup_steps >= 0 and step_size >= 1",
    naming neither the source nor the value."""
    with pytest.raises(ConfigError) as e:
        load(None, sets, env={})
    assert says in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.timeout(30)
def test_synthetic_with_enough_samples_and_other_data_unchecked():
    assert load(None, ["data.name=synthetic", "data.samples=10"], env={}).data.samples == 10
    assert load(None, ["data.samples=5"], env={}).data.samples == 5   # digits: data.samples is not read


@pytest.mark.timeout(30)
def test_config_file_with_a_byte_order_mark_is_read(tmp_path):
    """A config saved as UTF-8 with a byte-order mark (Notepad's "UTF-8 with BOM") was refused
    as "Invalid statement (at line 1, column 1)", a line that looks fine in any editor."""
    f = tmp_path / "c.toml"
    f.write_bytes("\ufeff[train]\nsteps = 3\n".encode("utf-8"))
    assert load(str(f), [], env={}).train.steps == 3


@pytest.mark.timeout(30)
@pytest.mark.parametrize("text, says", [
    ('mode = "ssp"\n', "mode = 'ssp': mode is a section, not a key: write its keys under a [mode] header (name = ...)"),
    ('[[cluster]]\nworkers = 2\n', "cluster is a section, not a key: write its keys under a [cluster] header"),
])
def test_section_name_used_as_a_key(tmp_path, text, says):
    """`mode = "ssp"` above every header was refused as "[mode] must be a table", which
    names neither the line written nor what to write instead."""
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=r"c\.toml: ") as e:
        load(str(f), [], env={})
    assert says in str(e.value)
