"""The `psgd` command line in this process, for what it decides before starting anything
(tests/test_cli_e2e.py runs it as real processes)."""
from __future__ import annotations

import pytest

from psgd.cli import main

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("argv,suggestion", [
    (["run", "--set", "train.steps", "100"], "--set train.steps=100"),
    (["run", "--set", "train.steps", "=", "100"], "--set train.steps=100"),
    (["run", "--set", "train.steps", "=100"], "--set train.steps=100"),
    (["compare", "--modes", "sync", "--set", "mode.staleness", "3", "--out", "x"], "--set mode.staleness=3"),
    (["worker", "--set", "train.steps"], "--set train.steps=VALUE"),
    (["worker", "--set=train.steps", "--rank", "1"], "--set train.steps=VALUE"),
])
def test_set_with_a_space_for_the_equals_sign_says_so(argv, suggestion, capsys):
    """It used to take the value for the CONFIG argument: "config file 100 does not exist"."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "expected SECTION.KEY=VALUE" in err and suggestion in err, err
    assert "does not exist" not in err and len(err.strip().splitlines()) == 1


def test_set_with_a_space_after_a_config_file(tmp_path, capsys):
    """With a CONFIG the value used to be an unrecognized argument."""
    config = tmp_path / "job.toml"
    config.write_text("[train]\nsteps = 10\n")
    assert main(["run", str(config), "--set", "train.steps", "100"]) == 2
    assert "did you mean --set train.steps=100?" in capsys.readouterr().err


def test_a_missing_value_is_not_taken_from_an_existing_file(tmp_path, capsys):
    config = tmp_path / "job.toml"
    config.write_text("")
    assert main(["run", "--set", "train.steps", str(config)]) == 2
    assert "did you mean --set train.steps=VALUE?" in capsys.readouterr().err
