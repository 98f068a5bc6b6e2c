"""The report's `psgd run` command for each configuration of a comparison ("then train with
the winner"): it must build the config that the comparison's run of that configuration had."""
from __future__ import annotations

import os
import shlex

import pytest

from psgd import cli
from psgd.compare import build_plan, parse_modes
from psgd.config import env_sets, load
from psgd.report import build_rows, run_commands
from psgd.report import main as report_main

from .test_report_claims import CTX, run
from .test_report_review import _folder

pytestmark = pytest.mark.unit

MODES = "sync,ssp:staleness=0,3,async:wire.compression=topk:wire.topk_fraction=0.05,easgd:tau=2:alpha=0.3"
SETS = ["train.steps=60", "eval.target_accuracy=0.5", "optimizer.lr=0.05"]
ENV = {"PSGD_OPTIMIZER_MOMENTUM": "0.5", "PSGD_OPTIMIZER_LR": "0.2"}   # (the --set's lr beats this one)


def commands(lines: list[str]) -> dict[str, list[str]]:
    """A section's commands by the configuration they are given for ("sync, 2 workers")."""
    out = {}
    for line in lines:
        if line.startswith("- "):
            name, _, command = line[2:].partition(": `")
            out[name] = shlex.split(command.rstrip("`"))
    return out


@pytest.mark.timeout(60)
def test_each_configurations_command_builds_the_config_its_runs_had(tmp_path, monkeypatch):
    """Its PSGD_* settings too (they are not in the comparison's command), and its
    checkpoint.dir as set, not the folder of its own that each run had inside it."""
    config = tmp_path / "job.toml"
    ck = tmp_path / "ck"
    config.write_text(f'[model]\nhidden = 64\n\n[cluster]\nservers = 3\n\n[checkpoint]\ndir = "{ck}"\n')
    base = load(str(config), SETS, env=ENV)
    plan = [r for r in build_plan(base, parse_modes(MODES), [1, 2], 1) if not r.is_baseline]
    results = [run("baseline", "baseline", workers=1)] + [
        run(r.label, r.mode, params=r.params, workers=r.workers) for r in plan]
    ctx = {**CTX, "config": str(config), "sets": SETS, "env_sets": env_sets(ENV), "servers": 3,
           "machine": {"device": "cpu"}}
    for name in [k for k in os.environ if k.startswith("PSGD_")]:   # (the commands' jobs: a clean shell's)
        monkeypatch.delenv(name)
    rows = build_rows(results)
    given = commands(run_commands(rows, ctx))
    built = {(r.label, r.workers): r.cfg for r in plan}
    assert len(given) == len(built) == 10
    for row in rows:
        if row.is_baseline:
            continue
        argv = given.pop(f"{row.name}, {row.workers} worker{'s' if row.workers != 1 else ''}")
        assert argv[:3] == ["psgd", "run", str(config)] and argv[argv.index("--device") + 1] == "cpu", argv
        args = cli.parser().parse_args(argv[1:])
        cfg = cli._config(args, {"mode.name": args.mode, "cluster.workers": args.workers,
                                 "cluster.servers": args.servers})
        assert cfg.optimizer.momentum == 0.5 and cfg.optimizer.lr == 0.05
        assert cfg.checkpoint.dir == str(ck) and os.path.dirname(built[row.key].checkpoint.dir) == str(ck)
        assert cfg.replace(**{"checkpoint.dir": built[row.key].checkpoint.dir}).to_dict() == \
            built[row.key].to_dict(), argv
    assert not given   # (the baseline's among them: it is a plain loop, not a psgd job)


@pytest.mark.timeout(60)
def test_the_section_gives_no_command_for_simulated_rows_merged_folders_or_a_baseline_alone(tmp_path):
    rows = build_rows([run("baseline", "baseline", workers=1), run("sync")])
    assert run_commands(rows, {**CTX, "servers": 2})[0] == "## Training with a configuration"
    assert commands(run_commands(rows, {**CTX, "servers": 2})) == {
        "sync, 2 workers": ["psgd", "run", "--mode", "sync", "--workers", "2", "--servers", "2"]}
    assert run_commands(rows, {**CTX, "simulated": {"compute_s": 0.01}}) == []
    assert run_commands(rows, {**CTX, "setups": [{"folder": "a", "command": "psgd compare"}]}) == []
    assert run_commands(build_rows([run("baseline", "baseline", workers=1)]), CTX) == []
    assert run_commands(build_rows([run("sync", simulated=True)]), CTX) == []
    out = _folder(str(tmp_path / "c"), [run("sync"), run("async", "async")], {**CTX, "servers": 1})
    assert report_main([out]) == 0
    text = open(os.path.join(out, "report.md")).read()
    section = text.split("## Training with a configuration", 1)[1].split("\n## ", 1)[0]
    assert "- async, 2 workers: `psgd run --mode async --workers 2 --servers 1`" in section


@pytest.mark.timeout(60)
def test_the_advice_for_a_longer_job_names_the_budget_that_ends_it():
    """A review: a comparison with `train.seconds` was told to add `--set train.steps=N` for
    a longer job, which changed nothing: its time budget still ended it first."""
    rows = build_rows([run("sync", wall=1.0)])
    by_steps = run_commands(rows, {**CTX, "job": {"steps": 300, "seconds": 0.0}})[2]
    by_time = run_commands(rows, {**CTX, "job": {"steps": 0, "seconds": 1.0}})[2]
    assert "for a longer one, add `--set train.steps=N` at the end" in by_steps
    assert "for a longer one, add `--set train.seconds=S` at the end" in by_time, by_time
    # both set (train.steps is 300 by default): the runs' wall times say which ended them (a review)
    both = {**CTX, "job": {"steps": 300, "seconds": 60.0}}
    assert "for a longer one, add `--set train.steps=N` at the end (its runs ended at their steps" in \
        run_commands(rows, both)[2]
    assert "for a longer one, add `--set train.seconds=S` at the end" in \
        run_commands(build_rows([run("sync", wall=60.0)]), both)[2]
    mixed = build_rows([run("sync", wall=60.0), run("async", "async", wall=3.0)])
    assert "raise the one that ends it: `--set train.steps=N` or `--set train.seconds=S`" in \
        run_commands(mixed, both)[2]
