"""End-to-end: the `psgd` command line with real processes on loopback."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from tests.conftest import free_port_block, kill_all

pytestmark = pytest.mark.processes

PSGD = [sys.executable, "-m", "psgd"]
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("PSGD_")}, "OMP_NUM_THREADS": "1"}
STEP_KEYS = {"t", "role", "rank", "step", "clock", "loss", "samples", "staleness", "wait_s", "bytes_sent", "bytes_recv"}
SUMMARY_KEYS = {"mode", "mode_params", "workers", "servers", "wall_s", "samples", "samples_per_s", "final_accuracy",
                "final_loss", "time_to_target_s", "staleness", "max_clock_gap", "wait_fraction", "bytes_per_sample",
                "failures"}


def psgd(*args, timeout=240, **kw):
    return subprocess.run(PSGD + list(args), capture_output=True, text=True, timeout=timeout, env=ENV, **kw)


def lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_default_job_trains_to_90_percent(tmp_path):
    out = tmp_path / "run"
    # a port block of its own: the default, 5555, may be taken by another job on this machine
    # between the launcher's check and the daemons' bind
    r = psgd("run", "--out", str(out), "--set", f"cluster.port={free_port_block(3)}")
    assert r.returncode == 0, r.stderr
    assert "step" in r.stderr and "samples" in r.stderr  # progress while it trains
    s = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(s)
    assert s["mode"] == "sync" and s["workers"] == 2 and s["servers"] == 2
    assert s["final_accuracy"] >= 0.90, s
    assert s["time_to_target_s"] is not None and s["samples"] == 2 * 300 * 32
    assert set(s["staleness"]) == {"mean", "max", "hist"}
    # each shard served for part of the run (the two shards and the two workers share two cores)
    assert len(s["shard_busy_fraction"]) == 2 and all(0 < f < 1 for f in s["shard_busy_fraction"]), s
    # what it prints is what it wrote (speed is measured in bench/, never asserted here)
    assert f"sync: accuracy {s['final_accuracy']:.4f}" in r.stdout
    assert f"summary: {out / 'summary.json'}" in r.stdout
    for rank in (0, 1):
        steps = lines(out / "events" / f"worker-{rank}.jsonl")
        assert len(steps) == 300 and STEP_KEYS <= set(steps[0])
    evals = lines(out / "events" / "evaluator-0.jsonl")
    assert evals and {"t", "samples", "accuracy", "loss"} <= set(evals[-1])
    state = torch.load(out / "model.pt", weights_only=True)
    assert "net.1.weight" in state
    assert not list((out / "pids").iterdir())  # pid files are removed when the daemons exit
    # README's model.pt example scores the final model again (a review: nothing said how to
    # rebuild a built-in model to load it into)
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    [snippet] = [b for b in readme.split("```python")[1:] if "build_model" in b.split("```")[0]]
    code = "\n".join(line[2:] for line in snippet.split("```")[0].splitlines())
    r = subprocess.run([sys.executable, "-c", code.replace("DIR", str(out))], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and abs(float(r.stdout) - s["final_accuracy"]) < 1e-6, (r.stdout, r.stderr)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_daemons_started_one_by_one_in_any_order(tmp_path):
    port = free_port_block(3)
    out = str(tmp_path)
    common = ["--out", out, "--set", f"cluster.port={port}", "--set", "train.steps=100"]
    roles = [["evaluator"], ["worker"], ["worker"], ["server", "--shard", "1"], ["server", "--shard", "0"],
             ["coordinator"]]
    procs = []
    logs = [tmp_path / f"daemon-{k}.err" for k in range(len(roles))]   # a pipe nobody reads could fill and block one
    try:
        for role, err in zip(roles, logs, strict=True):
            with open(err, "w") as f:
                procs.append(subprocess.Popen(PSGD + role + common, env=ENV, stdout=subprocess.DEVNULL, stderr=f))
            time.sleep(0.3)
        pids = tmp_path / "pids"
        # six interpreters import torch at once, on two cores: 14 s under a load of 6 (the
        # wait ends as soon as all six run; no pid file goes before the job's end)
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and len(list(pids.glob("*.pid"))) < 6:
            time.sleep(0.1)
        names = sorted(p.name for p in pids.glob("*.pid"))
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        kill_all(procs)
    errs = "\n".join(err.read_text() for err in logs)
    assert codes == [0] * 6, errs
    assert names == ["coordinator-0.pid", "evaluator-0.pid", "server-0.pid", "server-1.pid",
                     "worker-0.pid", "worker-1.pid"]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["samples"] == 2 * 100 * 32 and s["final_accuracy"] > 0.8


def test_shards_command():
    r = psgd("shards", "--servers", "3", timeout=60)
    assert r.returncode == 0
    assert "shard 2:" in r.stdout and "bytes" in r.stdout


@pytest.mark.parametrize("args,needle", [
    (["run", "--set", "mode.name=chaos"], "mode.name must be one of"),
    (["run", "--set", "data.name=cifar10", "--set", "data.path=/nonexistent"], "data_batch_1.bin: file not found"),
    (["server", "--shard", "5"], "--shard 5 is out of range"),
    (["worker", "--set", "cluster.hots=x"], "unknown key cluster.hots"),
])
def test_bad_input_is_one_line_not_a_traceback(args, needle):
    r = psgd(*args, timeout=60)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_non_loopback_bind_without_curve_is_refused():
    r = psgd("coordinator", "--set", "cluster.host=10.1.2.3", timeout=60)
    assert r.returncode == 2 and "without CurveZMQ" in r.stderr and "--insecure" in r.stderr


def frozen_cnn(input_shape, num_classes):
    """A user model with BatchNorm and a frozen layer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(input_shape[0], 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Flatten(), nn.Linear(8 * input_shape[1] * input_shape[2], num_classes))
    model[0].requires_grad_(False)
    return model


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_batchnorm_and_frozen_parameters(tmp_path):
    r = psgd("run", "--out", str(tmp_path), "--quiet", "--set", f"cluster.port={free_port_block(3)}",
             "--set", "model.name=tests.test_cli_e2e:frozen_cnn",
             "--set", "train.steps=80", "--set", "eval.target_accuracy=0.5")
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["final_accuracy"] > 0.8
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    init = frozen_cnn((1, 8, 8), 10).state_dict()
    assert torch.equal(state["0.weight"], init["0.weight"])  # frozen: never changed
    assert not torch.equal(state["4.weight"], init["4.weight"])  # trained
    assert not torch.equal(state["1.running_mean"], init["1.running_mean"])  # BN statistics averaged on the shards


@pytest.mark.timeout(180)
def test_sigterm_to_psgd_run_stops_every_daemon(tmp_path):
    """`kill PID` of `psgd run` (a scheduler's cancel, a CI timeout) stops its daemons as
    Ctrl-C does, instead of leaving them training until they miss the coordinator."""
    out = tmp_path / "run"
    proc = subprocess.Popen(PSGD + ["run", "--quiet", "--out", str(out), "--set", f"cluster.port={free_port_block(3)}",
                                    "--set", "train.steps=100000"], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        pids: dict[str, int] = {}
        deadline = time.monotonic() + 120
        every = {"coordinator-0.pid", "evaluator-0.pid", "server-0.pid", "server-1.pid", "worker-0.pid", "worker-1.pid"}
        while time.monotonic() < deadline and not every <= set(pids):   # the default job's six daemons
            if (out / "pids").is_dir():
                for f in (out / "pids").iterdir():
                    try:
                        pids[f.name] = int(f.read_text())
                    except (OSError, ValueError):
                        pass  # being written
            time.sleep(0.2)
        assert every <= set(pids), pids
        while not (out / "events" / "worker-0.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.2)  # training
        proc.terminate()
        assert proc.wait(timeout=60) == 143
        gone = time.monotonic() + 10
        while time.monotonic() < gone and any(os.path.exists(f"/proc/{p}") for p in pids.values()):
            time.sleep(0.1)
        assert not [n for n, p in pids.items() if os.path.exists(f"/proc/{p}")]
        assert not sorted(os.listdir(out / "pids"))   # every daemon removed its pid file on its way out
    finally:
        kill_all([proc])
        for p in pids.values():  # what a failure left running
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


def _pids_when_training(out, proc, deadline: float, names: set[str]) -> dict[str, int]:
    """The daemons' pids once they all run and worker 0 has logged a step."""
    pids: dict[str, int] = {}
    while time.monotonic() < deadline and not names <= set(pids) and proc.poll() is None:
        if (out / "pids").is_dir():
            for f in (out / "pids").iterdir():
                with contextlib.suppress(OSError, ValueError):   # being written
                    pids[f.name] = int(f.read_text())
        time.sleep(0.2)
    assert names <= set(pids), pids
    while not (out / "events" / "worker-0.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return pids


@pytest.mark.timeout(180)
def test_kill_9_of_psgd_run_ends_its_daemons(tmp_path):
    """`psgd run` killed with -9 (an OOM killer, a node's reaper) cannot stop its daemons:
    they get SIGTERM when their parent ends (the launcher, or the fork server that goes
    with it) instead of training on, unwatched, to the end of their budget."""
    out = tmp_path / "run"
    proc = subprocess.Popen(PSGD + ["run", "--quiet", "--out", str(out), "--set", f"cluster.port={free_port_block(3)}",
                                    "--set", "train.steps=100000"], env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    pids: dict[str, int] = {}
    try:
        pids = _pids_when_training(out, proc, time.monotonic() + 120,
                                   {"worker-0.pid", "server-0.pid", "coordinator-0.pid", "evaluator-0.pid"})
        proc.kill()
        proc.wait(timeout=10)
        gone = time.monotonic() + 30
        while time.monotonic() < gone and any(os.path.exists(f"/proc/{p}") for p in pids.values()):
            time.sleep(0.1)
        assert not [n for n, p in pids.items() if os.path.exists(f"/proc/{p}")]
    finally:
        kill_all([proc])
        for p in pids.values():  # what a failure left running
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


@pytest.mark.timeout(240)
def test_an_evaluator_that_dies_is_restarted_and_the_job_ends_with_its_score(tmp_path):
    """The evaluator keeps no state: one killed mid-run is started again, and the job
    ends with a final score and model.pt (it waited cluster.timeout_s for a final score
    that could not come, then exited 0 without a model)."""
    out = tmp_path / "run"
    proc = subprocess.Popen(PSGD + ["run", "--quiet", "--out", str(out), "--set", f"cluster.port={free_port_block(3)}",
                                    "--set", "train.steps=0", "--set", "train.seconds=12"], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = _pids_when_training(out, proc, time.monotonic() + 120, {"evaluator-0.pid", "worker-0.pid"})
        os.kill(pids["evaluator-0.pid"], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=150)
        assert proc.returncode == 0, stderr[-3000:]
        assert "evaluator-0 exited with -9" in stderr and "restarting it" in stderr, stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["final_accuracy"] is not None and (out / "model.pt").exists()
        assert summary["evals"][-1]["t"] > 6   # scored after the restart, not only before the kill
    finally:
        kill_all([proc])


@pytest.mark.timeout(180)
def test_sigterm_to_psgd_simulate_stops_its_job_processes(tmp_path):
    """`psgd simulate --jobs 2` runs its simulations in processes of its own: SIGTERM stops
    them with it (exit 143), as it stops `psgd run`'s daemons."""
    from tests.conftest import children
    proc = subprocess.Popen(PSGD + ["simulate", "--modes", "sync,async", "--workers", "64", "--jobs", "2",
                                    "--out", str(tmp_path / "sim"), "--set", "sim.train=false",
                                    "--set", "sim.compute_s=0.01", "--set", "train.steps=1000000"],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        reporting: set[str] = set()
        while len(reporting) < 2 and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stderr.readline()
            if "% of the steps" in line:
                reporting.add(line.split()[0])   # [1/2], [2/2]: both runs under way, each in its process
        assert reporting == {"[1/2]", "[2/2]"}, reporting
        pids = children(proc.pid)
        assert len(pids) >= 2
        proc.terminate()
        assert proc.wait(timeout=60) == 143
        gone = time.monotonic() + 10
        while time.monotonic() < gone and any(os.path.exists(f"/proc/{p}") for p in pids):
            time.sleep(0.1)
        assert not [p for p in pids if os.path.exists(f"/proc/{p}")]
    finally:
        kill_all([proc])
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


SCRIPT_CRASHES = """
import os, torch, psgd
from torch import nn
torch.manual_seed(0)
model = nn.Linear(4, 2)
ps = psgd.connect(model)   # no `with`: the process just dies, it never says it finished
x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
for i in range(3):
    model.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    ps.step(loss)
os._exit(1)   # (a crash: an exception it raised would end the job with its reason, through sys.excepthook)
"""


@pytest.mark.timeout(180)
def test_psgd_run_fails_when_every_worker_crashed(tmp_path):
    """Both workers' script dies (exit 1) without telling the coordinator: they are
    lost, none finished, so the job failed — summary.json is written with `aborted`, and
    `psgd run` exits 1 naming the workers' exit codes (not 0 with "target not reached")."""
    script = tmp_path / "crash.py"
    script.write_text(SCRIPT_CRASHES)
    out = tmp_path / "run"
    proc = subprocess.Popen(PSGD + ["run", "--mode", "async", "--workers", "2", "--servers", "1", "--quiet",
                                    "--script", str(script), "--out", str(out),
                                    "--set", f"cluster.port={free_port_block(2)}"],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=150)
    finally:
        kill_all([proc])
    assert proc.returncode == 1, (stdout, stderr)
    assert "psgd: error: job aborted: all 2 workers were lost (stopped heartbeating) and none finished" in stderr
    assert "worker exit codes: worker-0 1, worker-1 1" in stderr, stderr
    assert "target 0.9 not reached" not in stdout
    s = json.loads((out / "summary.json").read_text())
    assert s["aborted"] == "all 2 workers were lost (stopped heartbeating) and none finished"
    assert s["failures"]["workers_lost"] == 2


RANK_1_FAILS = """
import os
from torch import nn

def model(input_shape, num_classes):
    if os.environ.get("LOCAL_RANK") == "1":
        raise RuntimeError("rank 1 cannot build the model here")
    n = 1
    for d in input_shape:
        n *= d
    return nn.Sequential(nn.Flatten(), nn.Linear(n, num_classes))
"""


@pytest.mark.timeout(240)
def test_a_worker_of_another_job_waiting_on_the_port_cannot_join_a_psgd_run_job(tmp_path):
    """Seen by a review: a worker of another job, still waiting for its coordinator on the
    port a new `psgd run` then took, registered first; it took a rank of the new job (and
    its model's layout became the job's), and one of the job's own workers was refused.
    Now the job's daemons carry its token: the stray is refused, and the job trains."""
    port = free_port_block(3)
    common = ["--set", f"cluster.port={port}", "--set", "train.steps=60"]
    with open(tmp_path / "stray.err", "w") as err:
        stray = subprocess.Popen(PSGD + ["worker", "--out", str(tmp_path / "stray"), "--set", "cluster.timeout_s=120",
                                         *common], env=ENV, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 90   # until it waits for a coordinator (after importing torch)
        while "waiting for the coordinator" not in (tmp_path / "stray.err").read_text():
            assert time.monotonic() < deadline and stray.poll() is None, (tmp_path / "stray.err").read_text()
            time.sleep(0.2)
        r = psgd("run", "--quiet", "--out", str(tmp_path / "job"), "--set", "cluster.evaluator=false", *common,
                 timeout=180)
        code = stray.wait(timeout=60)
    finally:
        kill_all([stray])
    said = (tmp_path / "stray.err").read_text()
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "job" / "summary.json").read_text())["samples"] == 2 * 60 * 32
    assert code != 0 and "this worker belongs to another job" in said, said[-2000:]


@pytest.mark.timeout(180)
def test_a_worker_that_fails_before_training_stops_the_job_at_once(tmp_path):
    """A review: a training script that ended before the job began training stopped the
    job at once; psgd's own worker that did (here its model factory raises on rank 1
    only; an OOM kill is the same) was only logged, and the job waited for the
    coordinator's cluster.timeout_s before failing with "the coordinator ended without a
    summary". The error now names the worker, with the end of its log."""
    (tmp_path / "rankfail.py").write_text(RANK_1_FAILS)
    began = time.monotonic()
    proc = psgd("run", "--quiet", "--out", str(tmp_path / "run"), "--servers", "1",
                "--set", f"cluster.port={free_port_block(2)}", "--set", "cluster.evaluator=false",
                "--set", "model.name=rankfail:model", "--set", "cluster.timeout_s=90", timeout=170, cwd=str(tmp_path))
    took = time.monotonic() - began
    assert proc.returncode == 1, proc.stderr[-3000:]
    failure = proc.stderr[proc.stderr.index("psgd: error:"):]
    assert failure.startswith("psgd: error: worker-1 exited with code 2 before the job began training"), failure
    # (the factory's error is one line, a ConfigError's exit code 2: it was a traceback, exit 1)
    assert "model.name 'rankfail:model': the factory raised RuntimeError: rank 1 cannot build the model here" in failure
    assert took < 60, f"psgd run took {took:.0f} s to report a worker that died at start-up"


@pytest.mark.timeout(180)
def test_restart_workers_does_not_restart_the_workers_of_an_aborted_job(tmp_path):
    """A review: --restart-workers is for a worker that dies; one that exits 1 because the
    coordinator aborted the job (here: a diverging lr) is not one. The launcher restarted
    it anyway: the new process was refused ("the job is finishing; no new workers"), and
    the error named the exit codes of those processes ("worker-0 still running") instead
    of the ones that ended the job."""
    proc = psgd("run", "--quiet", "--restart-workers", "--out", str(tmp_path / "run"), "--servers", "1",
                "--set", f"cluster.port={free_port_block(2)}", "--set", "cluster.evaluator=false",
                "--set", "train.steps=1000", "--set", "optimizer.lr=1e6", timeout=170)
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    assert "job aborted: " in err and "gradient has NaN or Inf" in err, err[-3000:]
    assert "restarting it" not in err and "still running" not in err, err[-3000:]
    assert "worker exit codes: worker-0 1, worker-1 1" in err, err[-3000:]


@pytest.mark.timeout(120)
def test_an_interrupt_before_any_shard_ran_does_not_claim_checkpoints(tmp_path):
    """A review: SIGTERM to `psgd run` while it was still starting (no shard had run,
    nothing was saved) ended with "the shards' checkpoints are in DIR/checkpoints (a psgd
    run into the same --out resumes from them)": there were none. The fork server, still
    importing torch, outlived the command and said "the process that started this one
    (PID) is gone" after it."""
    out = tmp_path / "run"
    proc = subprocess.Popen(PSGD + ["run", "--quiet", "--out", str(out), "--set", f"cluster.port={free_port_block(3)}",
                                    "--set", "train.steps=100000"],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / "config.toml").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (out / "config.toml").exists()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)   # (until every holder of its stderr is gone)
    finally:
        kill_all([proc])
    assert proc.returncode == 143, err
    ckpts = os.listdir(out / "checkpoints") if (out / "checkpoints").is_dir() else []
    assert not [f for f in ckpts if f.endswith(".pt")], ckpts   # the premise: nothing was saved
    assert "psgd run: terminated; its daemons are stopped" in err and "checkpoints are in" not in err, err
    assert "the process that started this one" not in err, err


@pytest.mark.timeout(120)
def test_a_shard_stopped_before_it_serves_removes_its_pid_file(tmp_path):
    """SIGTERM while a shard waited for the coordinator killed it at once (no handler yet):
    its pid file stayed, as after `docker compose stop` or `scancel` during the rendezvous."""
    started = tmp_path / "server.started"
    proc = subprocess.Popen(PSGD + ["server", "--shard", "0", "--out", str(tmp_path), "--started-file", str(started),
                                    "--set", f"cluster.port={free_port_block(3)}", "--set", "cluster.timeout_s=100"],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "pids" / "server-0.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "pids" / "server-0.pid").exists()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
    finally:
        kill_all([proc])
    assert not (tmp_path / "pids" / "server-0.pid").exists()


@pytest.mark.timeout(180)
def test_ctrl_c_twice_from_a_terminal_keeps_every_shards_checkpoint(tmp_path):
    """A terminal's Ctrl-C reaches the whole process group: `psgd run` and every daemon.
    A second one landed in a shard's final `torch.save` and left only a temp file: the
    next run into the folder resumed one shard and started the other afresh. The shards
    now stop on Ctrl-C as on SIGTERM, and `psgd run` says what happened."""
    out = tmp_path / "run"
    proc = subprocess.Popen(PSGD + ["run", "--quiet", "--out", str(out), "--set", f"cluster.port={free_port_block(3)}",
                                    "--set", "train.steps=100000"], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,   # a group, as a shell's job
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pids: dict[str, int] = {}
    try:
        pids = _pids_when_training(out, proc, time.monotonic() + 120, {"server-0.pid", "server-1.pid", "worker-0.pid"})
        for _ in range(3):
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(0.05)
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 130, err
        lines = err.strip().splitlines()
        said = [i for i, line in enumerate(lines) if "psgd run: interrupted; its daemons are stopped" in line]
        assert said, err
        # after it, only the line of a Ctrl-C that landed as psgd run exited (the third, on a loaded machine)
        late = "interrupted while it exited; its exit code stands (130)"
        assert all(late in line for line in lines[said[0] + 1:]), err
        ckpts = sorted(os.listdir(out / "checkpoints"))
        assert ckpts == ["shard-0.pt", "shard-1.pt"], ckpts
        for i in (0, 1):
            log = (out / "logs" / f"server-{i}.log").read_text()
            assert "stopped (SIGTERM or Ctrl-C): checkpointing" in log, log
    finally:
        kill_all([proc])
        for p in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
