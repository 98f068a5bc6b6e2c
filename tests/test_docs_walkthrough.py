"""What a new user typing the README's commands, with the mistakes next to them, sees."""
from __future__ import annotations

import pytest

from psgd.cli import main

pytestmark = pytest.mark.unit


@pytest.mark.timeout(60)
@pytest.mark.parametrize("given,after_dashes", [
    (["--batch", "64"], "-- --batch 64"),
    (["--batch=64"], "-- --batch=64"),
    (["--workers", "3", "--batch", "64"], "-- --batch 64"),
    (["--workers", "2", "--batch", "2"], "-- --batch 2"),   # (a review: it said "-- 2 --batch 2")
])
def test_a_scripts_options_before_the_dashes_say_where_they_go(given, after_dashes, tmp_path, capsys):
    """README: `psgd run --script examples/custom_loss.py --mode async --workers 3 -- --batch 64`.
    Without its `--` this was argparse's top-level usage (4 lines) and "psgd: error:
    unrecognized arguments: --batch", the `64` taken for CONFIG and no word of `--`."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('never run')\n")
    assert main(["run", "--script", str(script), *given]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("psgd run: error: unrecognized arguments:"), err
    assert f"psgd run --script {script} [options] {after_dashes})" in err, err
    assert "usage:" not in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv,close", [
    (["run", "--mdoe", "sync"], "--mode"),
    (["compare", "--repaets=2"], "--repeats"),
    (["worker", "--rnak", "1"], "--rank"),
    (["run", "--script", "train.py", "--mdoe", "sync"], "--mode"),   # (a review: "go after --")
])
def test_a_misspelt_option_is_one_line_naming_the_closest(argv, close, capsys):
    """It was the top-level usage (psgd [-h] [--version] {run,compare,...}) and
    "unrecognized arguments: --mdoe", with no word of the option meant."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    misspelt = next(a for a in argv[1:] if a.startswith("--") and a != "--script")
    assert f"psgd {argv[0]}: error: unrecognized arguments: {misspelt}" in err, err
    assert f"did you mean {close}?" in err, err


@pytest.mark.timeout(60)
def test_a_scripts_option_close_to_one_of_psgds_gets_both_hints(tmp_path, capsys):
    """A review: `psgd run --script s.py --outdir y` said only "did you mean --out?", where
    --outdir is likely the script's own option, which goes after `--`."""
    script = tmp_path / "s.py"
    script.write_text("raise SystemExit('never run')\n")
    assert main(["run", "--script", str(script), "--outdir", "y"]) == 2
    err = capsys.readouterr().err
    assert "did you mean --out? Or, if they are the script's, arguments for the script go after --" in err, err
    assert err.rstrip().endswith("-- --outdir y)"), err
