"""`psgd simulate` used as a user would: odd input, large worker counts, what each run's
outputs say, interrupting it."""
from __future__ import annotations

import _thread
import json
import os
import signal
import threading
import time

import pytest

from psgd import data
from psgd.config import load
from psgd.consistency import get as get_mode
from psgd.sim import run as sim_run
from psgd.sim.run import Simulation


@pytest.mark.unit
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "ltfb"])
def test_a_run_draws_the_data_permutation_once_not_once_a_worker(monkeypatch, mode):
    """Building a run drew the training set's permutation once per worker (W x n):
    100,000 timing-only workers of 200,000 synthetic samples spent minutes before the
    first event, without a word. Each worker's partition is still `data.worker_part`'s."""
    W, n = 60, 500
    cfg = load(None, [f"cluster.workers={W}", "sim.train=false", "sim.compute_s=0.01", "train.steps=1",
                      'data.name="synthetic"', f"data.samples={n}", f'mode.name="{mode}"'])
    drawn = []
    real = data.permutation

    def counting(*a):
        drawn.append(a)
        return real(*a)
    monkeypatch.setattr(data, "permutation", counting)
    monkeypatch.setattr(sim_run, "permutation", counting)
    sim = Simulation(cfg, cfg.sim.compute_s)
    assert len(drawn) <= 2, len(drawn)   # check_partitions' and the run's
    monkeypatch.setattr(data, "permutation", real)
    split = get_mode(mode).schedule(cfg).data_split
    assert (split > 0) == (mode == "ltfb")
    n_train = sim._train_size()
    perm = data.permutation(n_train, cfg.job.seed)
    for r in range(W):   # each worker's share, dealt from the one permutation, is a real worker's
        part, held = data.worker_part(n_train, r, W, cfg.job.seed, split, perm)
        want, want_held = data.worker_part(n_train, r, W, cfg.job.seed, split)
        assert part.tolist() == want.tolist()
        assert (held is None) == (want_held is None)
        assert held is None or held.tolist() == want_held.tolist()


@pytest.mark.inprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("after", ["spill", "write"])
def test_an_interrupted_run_leaves_no_folder(tmp_path, monkeypatch, after):
    """Ctrl-C during a run (after it began its event logs: `spill`) removed its event logs
    but left its folder, empty, among the finished runs' (psgd status of it: 'has no
    config.toml'). A review: one while it wrote its outputs (`write`) left its summary.json,
    so the folder of a run the report says did not finish read as a finished run's."""
    from psgd import simulate
    cfg = load(None, ["cluster.workers=4", "sim.train=false", "sim.compute_s=0.01", "train.steps=50"])
    monkeypatch.setattr(sim_run, "SPILL_LINES", 20)
    done = getattr(Simulation, after)

    def interrupted(self, *args):
        done(self, *args)
        raise KeyboardInterrupt
    monkeypatch.setattr(Simulation, after, interrupted)
    folder = str(tmp_path / "runs" / "sync-w4-r0")
    with pytest.raises(KeyboardInterrupt):
        simulate.simulate_one((0, cfg, 0.01, "cpu", folder, "[1/1]", "sync, 4 workers"))
    assert not os.path.exists(folder)
    assert os.listdir(tmp_path / "runs") == []


@pytest.mark.inprocess
@pytest.mark.timeout(120)
def test_a_failed_runs_report_line_names_no_folder_it_did_not_leave(tmp_path, monkeypatch, capsys):
    """A review: the report's Failed runs line named `runs/sync-w2-r0` as where its logs
    are, a folder the failed run had removed (it leaves none)."""
    from psgd.simulate import cli

    def fails(self, out):
        raise RuntimeError("the run's own error")
    monkeypatch.setattr(Simulation, "run", fails)
    out = tmp_path / "out"
    assert cli(["--modes", "sync", "--workers", "2", *TIMING, "--out", str(out)]) == 1
    [entry] = json.load(open(out / "compare.json"))
    assert entry["error"] == "the run's own error" and not os.path.exists(out / entry["dir"]), entry
    report = (out / "report.md").read_text()
    assert "- sync (2 workers), repeat 0: the run's own error\n" in report and "runs/" not in report, report


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_a_jobs_process_stopped_mid_run_leaves_no_event_logs(tmp_path):
    """--jobs N: Ctrl-C stopped the processes with SIGTERM, which killed them where they
    were: a run that had begun writing its event logs left them (57 MB in 2,048 files at
    1,024 workers), in the folder of a run the report says did not finish. Now its process
    unwinds the run, which removes them, as in one process."""
    from psgd import simulate
    long = load(None, ["cluster.workers=256", "sim.train=false", "sim.compute_s=0.01", "train.steps=100000"])
    short = load(None, ["cluster.workers=2", "sim.train=false", "sim.compute_s=0.01", "train.steps=2"])
    runs = tmp_path / "runs"
    folder = str(runs / "long")
    tasks = [(0, long, 0.01, "cpu", folder, "[1/2]", "long"), (1, short, 0.01, "cpu", str(runs / "short"), "[2/2]",
                                                              "short")]
    wrote = threading.Event()
    done: list[tuple] = []

    def ctrl_c_once_it_has_written() -> None:   # (the generator must be running to hand out tasks:
        deadline = time.monotonic() + 180       # a test that stopped at the short run's answer starved
        while not (done and os.path.isdir(os.path.join(folder, "events"))) and time.monotonic() < deadline:
            time.sleep(0.2)                     # the long one when it started second)
        wrote.set() if os.path.isdir(os.path.join(folder, "events")) else None
        _thread.interrupt_main()   # as Ctrl-C: a KeyboardInterrupt in the loop below
    # interrupt_main does nothing where SIGINT is ignored, as in pytest started in the background by
    # a non-interactive shell (the test then waited out its timeout): Python's own handler, for this test
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=ctrl_c_once_it_has_written, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            for i, (_s, _, error, _) in simulate.simulated(tasks, 2):
                done.append((i, error))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert wrote.is_set(), "the long run wrote no event logs"
    assert done == [(1, None)]
    assert not os.path.exists(folder), os.listdir(folder)
    assert sorted(os.listdir(runs)) == ["short"]


TIMING = ["--set", "sim.train=false", "--set", "train.steps=2", "--set", "sim.compute_s=0.01"]


def warnings_of(tmp_path, capsys, *argv: str) -> tuple[list[str], str]:
    from psgd.simulate import cli
    out = str(tmp_path / "out")
    assert cli([*argv, *TIMING, "--out", out]) == 0
    ctx = json.load(open(os.path.join(out, "compare-context.json")))
    return ctx.get("warnings") or [], capsys.readouterr().err


@pytest.mark.inprocess
@pytest.mark.timeout(120)
def test_a_fault_that_slows_no_worker_is_warned_of(tmp_path, capsys):
    """`--set faults.jitter_prob=0.5` without jitter_s (or slow_factor without slow_rank)
    delayed nothing, and psgd simulate said nothing of it, on stderr or in the report,
    where psgd run warns."""
    warnings, err = warnings_of(tmp_path, capsys, "--modes", "sync", "--workers", "2,4",
                                "--set", "faults.jitter_prob=0.5", "--set", "faults.slow_rank=3",
                                "--set", "faults.slow_factor=2")
    assert warnings == [
        "sync with 2 workers: faults.slow_rank = 3 is no rank of this job's 2 workers (ranks 0..1): no worker is "
        "slowed",
        "faults.jitter_prob = 0.5 delays nothing: faults.jitter_s = 0 (set both: each step is delayed by jitter_s "
        "with probability jitter_prob)"]
    assert all(f"psgd simulate: warning: {w}" in err for w in warnings)
    report = open(tmp_path / "out" / "report.md").read()
    assert all(f"**Warning:** {w}" in report for w in warnings)
    warnings, _ = warnings_of(tmp_path, capsys, "--modes", "sync", "--workers", "2", "--set", "faults.slow_factor=3")
    assert warnings == ["faults.slow_factor = 3 slows no worker: faults.slow_rank = -1 (set it to a rank)"]


@pytest.mark.inprocess
@pytest.mark.timeout(120)
def test_a_set_key_that_a_simulation_does_not_read_is_warned_of(tmp_path, capsys):
    """`--set checkpoint.every_s=1`, `--set security.curve=true` (its keys folder absent),
    `--set cluster.port=...`: nothing in a simulation reads them; they ran as if not
    given, without a word, while the report listed them as applied."""
    warnings, err = warnings_of(tmp_path, capsys, "--modes", "sync,async:checkpoint.dir=/nowhere", "--workers", "2",
                                "--set", "security.curve=true", "--set", "security.keys=/nowhere",
                                "--set", "cluster.port=7000", "--set", "checkpoint.every_s=3",
                                "--set", "faults.on_worker_loss=abort")
    assert warnings == [
        "a simulation reads none of security.curve, security.keys, cluster.port (no sockets: the shards and workers "
        "are objects of one process); checkpoint.every_s, checkpoint.dir (no checkpoints are written: no shard "
        "restarts are simulated); faults.on_worker_loss (no worker is lost: no failures are simulated): setting "
        "them changes nothing"]
    assert f"psgd simulate: warning: {warnings[0]}" in err
    # keys it reads say nothing (cluster.servers, ltfb's heartbeat_timeout_s and timeout_s, the faults it simulates)
    warnings, _ = warnings_of(tmp_path, capsys, "--modes", "sync", "--workers", "2", "--set", "cluster.servers=3",
                              "--set", "cluster.heartbeat_timeout_s=9", "--set", "cluster.timeout_s=30",
                              "--set", "faults.step_delay_s=0.01")
    assert warnings == []


@pytest.mark.inprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("key, value, said", [
    ("sim.compute_s", "1.7e308", "sim.compute_s must be at most 1e+06 s"),
    ("sim.latency_s", "1e300", "sim.latency_s must be at most 1e+06 s"),
    ("sim.bandwidth_gbps", "1e-300", "sim.bandwidth_gbps must be at least 1e-12 Gbit/s"),
    ("sim.apply_gbps", "1e-300", "sim.apply_gbps must be at least 1e-12 Gbit/s")])
def test_a_cost_model_whose_times_overflow_is_refused(tmp_path, capsys, key, value, said):
    """sim.compute_s = 1.7e308 ran: its virtual times overflowed to inf (summary.json's
    wall_s null, `psgd status` of the run 'not a psgd summary', the report's wall 'inf');
    1e300 printed a 300-digit wall. Refused before anything runs."""
    from psgd.simulate import cli
    out = tmp_path / "out"
    assert cli(["--modes", "sync", "--workers", "2", *TIMING, "--set", f"{key}={value}", "--out", str(out)]) == 2
    assert said in capsys.readouterr().err
    assert not out.exists()
