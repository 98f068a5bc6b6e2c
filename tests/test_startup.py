"""Start-up: what each process imports, and what `psgd run` reports about its start-up
(`startup_s` in summary.json, progress, the warning about more busy processes than cores).

Tests that start an interpreter or a job are `processes`; the rest `unit` (each test is
marked: this file mixes tiers)."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from psgd import consistency
from psgd.config import MODES, Config, load
from psgd.data import _digits_raw, check_dataset, digits_file
from psgd.launcher import available_cores, busy_processes, cpu_quota, format_summary, oversubscribed
from psgd.metrics import EXEC_SLACK_S, command_start, process_start_time
from psgd.optim import make_optimizer
from tests.conftest import free_port_block, kill_all

PSGD = [sys.executable, "-m", "psgd"]


def fresh(code: str) -> str:
    """Run code in a new interpreter; its stdout."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


# ---------------------------------------------------------------- what is imported where
@pytest.mark.processes
def test_the_coordinator_imports_no_torch():
    out = fresh("import sys; import psgd.servers.coordinator; "
                "print(sorted(m for m in ('torch', 'sklearn', 'matplotlib') if m in sys.modules))")
    assert out.strip() == "[]"


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_ctrl_c_while_psgd_loads_is_exit_130_without_a_traceback():
    """Ctrl-C in the first ~0.3 s of `psgd run` (the console script's `from psgd.cli
    import main`, importing numpy) printed a 20-line KeyboardInterrupt traceback; main()
    already took one while the verbs' modules load. Here the import of numpy is the Ctrl-C."""
    code = ("import builtins\n"
            "real = builtins.__import__\n"
            "def ctrl_c(name, *args, **kw):\n"
            "    if name == 'numpy':\n"
            "        raise KeyboardInterrupt\n"
            "    return real(name, *args, **kw)\n"
            "builtins.__import__ = ctrl_c\n"
            "from psgd.cli import main\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert r.returncode == 130 and r.stderr == "", r.stderr


@pytest.mark.processes
@pytest.mark.parametrize("mode", ["sync", "ltfb"])
def test_psgd_run_checks_the_config_and_data_without_torch_or_sklearn(mode):
    """What `psgd run` does before it starts the first process: parse, load the config,
    check the dataset, the model's name and the workers' partitions (with the share a
    mode holds out), import the launcher."""
    out = fresh("import sys\n"
                "from psgd import cli, launcher\n"
                f"args = cli.parser().parse_args(['run', '--set', 'train.steps=5', '--mode', {mode!r}])\n"
                "cfg = cli._config(args)\n"
                "cli.check_job(cfg)\n"
                "print(sorted(m for m in ('torch', 'sklearn', 'scipy', 'matplotlib') if m in sys.modules))")
    assert out.strip() == "[]"


@pytest.mark.processes
def test_the_first_optimizer_does_not_import_torch_dynamo():
    """torch.optim imports torch._dynamo on first use (1.9 s of CPU in every shard and
    worker); psgd's optimizers run the same code without it."""
    out = fresh("import sys, torch\n"
                "from psgd.config import OptimizerConfig\n"
                "from psgd.optim import make_optimizer\n"
                "for name in ('sgd', 'adam', 'adamw'):\n"
                "    p = torch.ones(3, requires_grad=True)\n"
                "    opt = make_optimizer([p], OptimizerConfig(name=name))\n"
                "    (p * p).sum().backward(); opt.step(); opt.zero_grad()\n"
                "    opt.load_state_dict(opt.state_dict())\n"
                "print('torch._dynamo' in sys.modules)")
    assert out.strip() == "False"


# ---------------------------------------------------------------- the same results as before
def _train(opt_factory, steps: int = 6) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    torch.manual_seed(0)
    p = torch.randn(20, requires_grad=True)
    target = torch.randn(20)
    opt = opt_factory([p])
    for _ in range(steps):
        opt.zero_grad()
        ((p - target) ** 2).sum().backward()
        opt.step()
    return p.detach().clone(), opt


@pytest.mark.unit
@pytest.mark.parametrize("sets,plain", [
    ({"name": "sgd", "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
     lambda ps, **f: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, **f)),
    ({"name": "sgd", "momentum": 0.0}, lambda ps, **f: torch.optim.SGD(ps, lr=0.1, momentum=0.0)),
    ({"name": "adam", "lr": 0.01}, lambda ps, **f: torch.optim.Adam(ps, lr=0.01, betas=(0.9, 0.999), eps=1e-8, **f)),
    ({"name": "adamw", "lr": 0.01, "weight_decay": 0.1},
     lambda ps, **f: torch.optim.AdamW(ps, lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, **f)),
])
def test_optimizers_compute_and_checkpoint_as_torch_optim(sets, plain):
    """torch's fused optimizer where it has one (not for plain SGD): the same values as
    torch's, to float tolerance as its unfused one, and checkpoints either loads."""
    cfg = Config().replace(**{f"optimizer.{k}": v for k, v in sets.items()}).optimizer
    ours, opt = _train(lambda ps: make_optimizer(ps, cfg))
    fused = cfg.momentum > 0 or cfg.name != "sgd"
    assert bool(opt.defaults.get("fused")) == fused
    theirs, ref = _train(lambda ps: plain(ps, **({"fused": True} if fused else {})))
    assert isinstance(opt, type(ref)) and torch.equal(ours, theirs)
    unfused, _ = _train(plain)
    torch.testing.assert_close(ours, unfused, rtol=1e-5, atol=1e-6)
    sd = opt.state_dict()
    assert sd["param_groups"] == ref.state_dict()["param_groups"]
    # a checkpoint of one loads into the other, fused or not
    for f in ({"fused": True} if fused else {}), {}:
        other = plain([torch.zeros(20, requires_grad=True)], **f)
        other.load_state_dict(sd)
        loaded, saved = other.state_dict()["state"], sd["state"]
        assert loaded.keys() == saved.keys()
        assert all(torch.equal(loaded[i][k], saved[i][k]) for i in saved for k in saved[i])
    seen = []
    opt.register_step_post_hook(lambda *a: seen.append(1))
    opt.step()
    assert seen == [1]  # torch.optim's hooks still run


@pytest.mark.unit
def test_digits_are_read_as_scikit_learn_reads_them():
    from sklearn.datasets import load_digits
    assert digits_file() is not None
    images, target = _digits_raw()
    d = load_digits()
    assert np.array_equal(images, d.images) and np.array_equal(target, d.target)


@pytest.mark.unit
def test_check_dataset_says_what_load_dataset_would(tmp_path):
    check_dataset(load(None, [], env={}).data)
    check_dataset(load(None, ["data.name=synthetic"], env={}).data)
    for sets, needle in ((["data.name=synthetic", "data.classes=20", "data.samples=10"],
                          "fewer than the synthetic dataset's 20 classes"),   # (the config refuses it first now)
                         (["data.name=cifar10", f"data.path={tmp_path}"], "data_batch_1.bin: file not found"),
                         (["data.name=imagenet"], "expected digits, synthetic")):
        with pytest.raises(ValueError, match=needle):
            check_dataset(load(None, sets, env={}).data)


@pytest.mark.unit
def test_config_takes_the_modes_and_their_keys_from_the_registry():
    assert MODES == consistency.NAMES == tuple(consistency.MODES)
    for name in MODES:
        cfg = Config().replace(**{"mode.name": name})
        assert tuple(cfg.mode_params) == consistency.PARAMS[name] == consistency.get(name).params


# ---------------------------------------------------------------- what the launcher says
@pytest.mark.unit
def test_a_warning_when_busy_processes_outnumber_cores():
    cfg = load(None, ["cluster.workers=4", "cluster.servers=2"], env={})
    assert busy_processes(cfg) == (7, "2 shards, 4 workers, an evaluator")
    assert oversubscribed(cfg, cores=7) == ""
    warning = oversubscribed(cfg, cores=2)
    assert warning.startswith("warning: 7 busy processes (2 shards, 4 workers, an evaluator) on 2 cores")
    assert oversubscribed(load(None, ["cluster.evaluator=false", "cluster.workers=1", "cluster.servers=1"],
                               env={}), cores=2) == ""


@pytest.mark.unit
def test_a_cgroup_cpu_quota_counts_as_fewer_cores(tmp_path):
    """`docker run --cpus 1` on a bigger host: every core is in the affinity mask, the
    quota allows one core's time; the job's processes take turns as on one core (psgd
    run gave no warning there)."""
    mask = len(os.sched_getaffinity(0))
    assert available_cores(str(tmp_path)) == mask   # no quota to read
    (tmp_path / "cpu.max").write_text("max 100000\n")   # cgroup v2, unlimited
    assert available_cores(str(tmp_path)) == mask
    (tmp_path / "cpu.max").write_text("50000 100000\n")   # half a core: rounded up
    assert cpu_quota(str(tmp_path)) == 0.5 and available_cores(str(tmp_path)) == 1
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()   # cgroup v1
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota(str(tmp_path)) is None
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    assert available_cores(str(tmp_path)) == 1


@pytest.mark.unit
def test_the_final_line_says_the_start_up():
    s = {"mode": "sync", "final_accuracy": 0.98, "final_loss": 0.05, "samples_per_s": 5000.0, "wall_s": 3.0,
         "time_to_target_s": 1.0, "target_accuracy": 0.9, "staleness": {"mean": 0.0, "max": 0}}
    assert "start-up" not in format_summary(s)  # a summary from before startup_s
    assert format_summary({**s, "startup_s": 4.26}).endswith("start-up 4.3 s")


@pytest.mark.unit
def test_process_start_time_is_this_process_start():
    t = process_start_time()
    assert t is not None and 0 <= time.time() - t < 3600


@pytest.mark.unit
def test_a_command_starts_at_its_fork_unless_exec_d_into_an_older_process():
    began, cpu = 1000.0, 0.2   # psgd's first moment, and the interpreter's start's CPU time by then
    assert command_start(began, cpu, 999.5) == 999.5   # forked, exec'd, started (its waits included)
    assert command_start(began, cpu, began - cpu - EXEC_SLACK_S) == began - cpu - EXEC_SLACK_S
    assert command_start(began, cpu, 900.0) == began - cpu   # a shell's process, running 100 s before
    assert command_start(began, cpu, None) == began - cpu    # no /proc


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_psgd_exec_d_by_a_shell_counts_from_its_own_start():
    """A shell execs a list's last command in its own process: `psgd run` after
    `sleep 2` in one `bash -c` counted the 2 s (an install before it, all of it) in
    startup_s. What it counts from lies at most the interpreter's start before psgd's
    first moment (`cli.BEGAN`), not the shell's 2 s."""
    code = ("import psgd.cli as c, psgd.metrics as m; "
            "print(c.BEGAN[0] - m.command_start(*c.BEGAN, m.process_start_time()), "
            "c.BEGAN[0] - m.process_start_time())")
    r = subprocess.run(["bash", "-c", f"sleep 2; exec {shlex.quote(sys.executable)} -c {shlex.quote(code)}"],
                       capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr
    counted, since_fork = map(float, r.stdout.split())
    assert since_fork >= 2.0   # the process is the shell's
    assert 0 <= counted < 1.0


# ---------------------------------------------------------------- real jobs
@pytest.mark.processes
@pytest.mark.timeout(240)
def test_psgd_run_reports_its_start_up(tmp_path):
    out = tmp_path / "run"
    t0 = time.time()
    r = subprocess.run(PSGD + ["run", "--out", str(out), "--set", f"cluster.port={free_port_block(3)}",
                               "--set", "train.steps=20"], capture_output=True, text=True, timeout=200)
    took = time.time() - t0
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["startup_from"] == "launcher"
    assert 0 < s["startup_s"] < took - s["wall_s"]  # from the command's start to the start of training
    start = [e for e in map(json.loads, (out / "events" / "coordinator-0.jsonl").read_text().splitlines())
             if e.get("event") == "start"]
    assert len(start) == 1 and start[0]["startup_s"] == s["startup_s"]
    assert f"start-up {s['startup_s']:.1f} s" in r.stdout.splitlines()[0]
    assert "started 6/6 processes in" in r.stderr  # coordinator, 2 shards, 2 workers, evaluator
    assert "workers registered 2/2" in r.stderr
    assert sorted(p.name for p in (out / "logs").glob("*.started")) == [
        "coordinator-0.started", "evaluator-0.started", "server-0.started", "server-1.started",
        "worker-0.started", "worker-1.started"]


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_a_coordinator_started_by_hand_counts_from_its_own_start(tmp_path):
    """Without psgd run nothing knows when the job was launched: the coordinator counts
    from its own process's start (and says so)."""
    common = ["--out", str(tmp_path), "--set", f"cluster.port={free_port_block(2)}", "--set", "cluster.servers=1",
              "--set", "cluster.workers=1", "--set", "cluster.evaluator=false", "--set", "train.steps=5"]
    procs = []
    try:
        for role in (["coordinator"], ["server", "--shard", "0"], ["worker"]):
            procs.append(subprocess.Popen(PSGD + role + common, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                          text=True))
        codes = [p.wait(timeout=200) for p in procs]
    finally:
        kill_all(procs)
    errs = "\n".join(p.stderr.read() for p in procs if p.stderr)
    assert codes == [0, 0, 0], errs
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["startup_from"] == "coordinator process" and s["startup_s"] > 0


@pytest.mark.unit
def test_the_final_line_does_not_call_a_score_after_training_a_time_to_target():
    """A review: "wall 1.8 s  time to 0.9: 1.8 s" where 0.9 was first seen by the score
    taken after training (its read time, rounded to the ms, fell just below wall_s)."""
    from psgd.metrics import summarize
    evals = [{"t": 0.0, "samples": 0, "accuracy": 0.1, "loss": 2.3},
             {"t": 1.5, "samples": 900, "accuracy": 0.85, "loss": 0.6},
             {"t": 1.763, "samples": 1200, "accuracy": 0.92, "loss": 0.3, "final": True}]
    s = summarize(mode="sync", mode_params={}, workers=2, servers=1, wall_s=1.763412, worker_stats={},
                  server_stats={}, evals=evals, target=0.9, failures={})
    assert s["evals"][-1]["final"] is True and "final" not in s["evals"][1]
    line = format_summary(s)
    assert "target 0.9 first seen by the final score (1.8 s), after training" in line and "time to" not in line
    earlier = [evals[0], {**evals[1], "accuracy": 0.91}, evals[2]]   # reached during training: a time
    assert "time to 0.9: 1.5 s" in format_summary({**s, "evals": earlier, "time_to_target_s": 1.5})
    # (a review: nor the time of the first score, already above the target, as
    # psgd compare's report marks it)
    first = [{**evals[0], "t": 0.6, "accuracy": 0.93}, *evals[1:]]
    line = format_summary({**s, "evals": first, "time_to_target_s": 0.6})
    assert "target 0.9 reached by the first score (0.6 s): when it looked" in line and "time to" not in line


@pytest.mark.unit
def test_a_target_first_seen_by_a_score_after_training_but_before_the_final_one():
    """A review: the evaluator read the model after the workers were done but before it
    heard so (its heartbeat's phase still said training): that score, not the final one,
    first reached the target, at 1.18 s of a 1.149 s run (time_to_target_s past wall_s);
    the line called it the final score."""
    from psgd.metrics import summarize
    evals = [{"t": 0.5, "samples": 9000, "accuracy": 0.85, "loss": 0.6},
             {"t": 1.18, "samples": 19200, "accuracy": 0.92, "loss": 0.3},
             {"t": 1.241, "samples": 19200, "accuracy": 0.92, "loss": 0.3, "final": True}]
    s = summarize(mode="sync", mode_params={}, workers=2, servers=2, wall_s=1.149017, worker_stats={},
                  server_stats={}, evals=evals, target=0.9, failures={})
    assert s["time_to_target_s"] == 1.18 > s["wall_s"]
    line = format_summary(s)
    assert "target 0.9 first seen by a score (1.2 s), after training" in line, line
    assert "final score" not in line and "time to" not in line


class SteppedClock:
    """time.time() that reads `step` seconds off the real one once stepped (NTP stepping
    the wall clock, a VM resumed): the monotonic clock goes on as it did."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.step = 0.0
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + self.step)


@pytest.mark.inprocess
@pytest.mark.timeout(30)
@pytest.mark.parametrize("step", [-3600.0, 3600.0])
def test_startup_s_is_not_moved_by_a_wall_clock_stepped_during_start_up(tmp_path, monkeypatch, step):
    """startup_s was the wall clock's time from launched_at to the start of training: a
    clock stepped an hour back while the workers registered gave startup_s -3600 (in the
    summary and the final line), an hour on 3600. It is counted on the monotonic clock."""
    import zmq

    from psgd.servers.coordinator import Coordinator
    clock = SteppedClock(monkeypatch)
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "cluster.workers": 1, "cluster.servers": 1})
    ctx = zmq.Context()
    c = Coordinator(cfg, str(tmp_path), ctx=ctx, quiet=True, launched_at=time.time() - 2.0, launched_by="launcher")
    try:
        clock.step = step
        c._start_training()
    finally:
        c.service.close()
        ctx.term()
        c.events.close()
    assert c.startup_s is not None and 2.0 <= c.startup_s < 60, c.startup_s


@pytest.mark.inprocess
@pytest.mark.timeout(30)
@pytest.mark.parametrize("step", [-3600.0, 3600.0])
def test_the_started_processes_line_is_not_moved_by_a_stepped_wall_clock(tmp_path, monkeypatch, capsys, step):
    """psgd run's "started N/N processes in T s" counted T on the wall clock: stepped an
    hour back while the processes started, it said "in -3598.0 s"."""
    from psgd.launcher import Child, LocalJob
    clock = SteppedClock(monkeypatch)
    cfg = Config().replace(**{"cluster.port": free_port_block(3)})
    job = LocalJob(cfg, str(tmp_path), launched_at=time.time() - 2.0)
    try:
        job.children = [Child("coordinator", 0, []), Child("server", 0, [])]
        for c in job.children:
            open(job.started_file(c.name), "w").close()
        clock.step = step
        job.show_started()
    finally:
        job.stop()
    took = [line for line in capsys.readouterr().err.splitlines() if "started 2/2 processes in" in line]
    assert len(took) == 1, took
    assert 2.0 <= float(took[0].rsplit(" in ", 1)[1].split()[0]) < 60, took
