"""Long jobs: what grows with a job's length must not grow what each second costs.

The coordinator rewrites DIR/coordinator-state.json every second (a restarted coordinator
resumes from it). It held the whole accuracy curve, two scores a second at the default
`eval.every_seconds`: each rewrite (fsync'd) wrote every score again, 0.8 MB an hour into a
job, 6.8 MB at 8 hours, 20 MB at a day, every second (1.7 TB a day written; 0.12 s of the
coordinator's loop a second on this machine, more on a network file system). Settled scores
are appended once to DIR/coordinator-scores.jsonl; the state file counts them."""
from __future__ import annotations

import contextlib
import json
import os
import time

import pytest

from psgd.servers import coordinator as coordinator_module
from psgd.servers.coordinator import STATE_FILE
from tests.test_coordinator_state import coordinator, training_with_two_workers

SCORES_FILE = getattr(coordinator_module, "SCORES_FILE", "coordinator-scores.jsonl")


def _scores(n: int, start: int = 0) -> list[dict]:
    return [{"t": round(0.5 * i, 6), "samples": 320 * i, "accuracy": (i % 100) / 100, "loss": 1.0 / (i + 1),
             "final": False} for i in range(start, start + n)]


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_the_state_files_rewrites_do_not_grow_with_the_accuracy_curve(tmp_path):
    out = str(tmp_path)
    cfg, c = training_with_two_workers(out)
    state = os.path.join(out, STATE_FILE)
    now = time.monotonic()
    sizes = []
    for hour in range(3):   # three "hours" of scores, 2 a second
        c.evals += _scores(7200, start=7200 * hour)
        now += 1.0
        c._save_state(now)
        sizes.append(os.path.getsize(state))
    assert max(sizes) < 20_000, f"the state file grows with the curve: {sizes} bytes"
    assert max(sizes) - min(sizes) < 1_000, sizes
    # each settled score is written once, one line each
    with open(os.path.join(out, SCORES_FILE)) as f:
        assert sum(1 for _ in f) == 3 * 7200

    # a restarted coordinator resumes the whole curve, NaN losses as null, as before
    c.evals.append({"t": 99999.0, "samples": 1, "accuracy": 0.5, "loss": float("nan"), "final": False})
    c._save_state(now + 1.0)
    again = coordinator(cfg, out)
    assert again.restarts == 1 and len(again.evals) == 3 * 7200 + 1
    assert again.evals[:-1] == c.evals[:-1] and again.evals[-1]["loss"] is None
    # ... and goes on appending after them, not over them or twice
    again.evals += _scores(3, start=30000)
    again._save_state(time.monotonic() + 5.0)
    third = coordinator(cfg, out)
    assert third.restarts == 2 and [e["t"] for e in third.evals] == [e["t"] for e in again.evals]


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_coordinator_that_starts_afresh_takes_no_earlier_jobs_scores(tmp_path):
    out = str(tmp_path)
    cfg, c = training_with_two_workers(out)
    c.evals += _scores(50)
    c._save_state(time.monotonic() + 1.0)
    os.unlink(os.path.join(out, STATE_FILE))   # a new `psgd run` into the folder removes it
    fresh = coordinator(cfg, out)
    assert fresh.restarts == 0 and fresh.evals == []
    fresh.phase, fresh.t0 = "training", time.monotonic()
    fresh.evals += _scores(2, start=1000)
    fresh._save_state(time.monotonic() + 1.0)
    back = coordinator(cfg, out)
    assert [e["t"] for e in back.evals] == [500.0, 500.5]


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_scores_file_cut_short_or_gone_keeps_the_job_resumable(tmp_path):
    """The scores file lost its tail (a machine that crashed between the append and the
    state file's rewrite cannot do it: the append is fsync'd first; a file cut by hand
    can): the restarted coordinator resumes with the scores it finds and says so."""
    out = str(tmp_path)
    cfg, c = training_with_two_workers(out)
    c.evals += _scores(10)
    c._save_state(time.monotonic() + 1.0)
    path = os.path.join(out, SCORES_FILE)
    with open(path) as f:
        lines = f.readlines()
    with open(path, "w") as f:
        f.writelines(lines[:6] + [lines[6][:10]])   # 6 whole lines and a torn one
    again = coordinator(cfg, out)
    assert again.restarts == 1 and [e["t"] for e in again.evals] == [e["t"] for e in c.evals[:6]]
    again.evals += _scores(1, start=100)
    again._save_state(time.monotonic() + 5.0)
    with open(path) as f:
        assert [json.loads(x)["t"] for x in f] == [e["t"] for e in again.evals]   # the torn line went
    os.unlink(path)
    third = coordinator(cfg, out)
    assert third.restarts == 2 and third.evals == []


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_scores_appended_by_a_coordinator_killed_before_its_state_rewrite_are_kept(tmp_path):
    """A coordinator killed -9 between the scores' append (fsync'd) and the state file's
    rewrite that counts them: the restart kept the count's scores and cut the rest off
    the curve (CI, session 32: three scores of a killed coordinator's last second gone)."""
    out = str(tmp_path)
    cfg, c = training_with_two_workers(out)
    c.evals += _scores(4)
    c.counting = [(c.evals[3], None)]   # the last score still waits for its samples
    c._save_state(time.monotonic() + 1.0)
    with open(os.path.join(out, STATE_FILE)) as f:
        assert json.load(f)["evals_settled"] == 3
    c.counting = []
    c.evals += _scores(3, start=4)
    c.evals[3] = dict(c.evals[3], samples=9999)   # settled with its counts
    c._append_scores(c.evals[3:])   # ... and killed here, before the state file's rewrite
    again = coordinator(cfg, out)
    assert again.restarts == 1 and again.evals == c.evals
    again.evals += _scores(1, start=100)
    again._save_state(time.monotonic() + 5.0)
    third = coordinator(cfg, out)
    assert third.evals == c.evals + _scores(1, start=100)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_state_file_of_the_earlier_format_with_the_whole_curve_is_resumed(tmp_path):
    out = str(tmp_path)
    cfg, c = training_with_two_workers(out)
    c._save_state(time.monotonic())
    path = os.path.join(out, STATE_FILE)
    with open(path) as f:
        st = json.load(f)
    st.pop("evals_settled", None)
    st["evals"] = _scores(5)
    with open(path, "w") as f:
        json.dump(st, f)
    # A review: a scores file beside it (an earlier job's in this folder) was appended to,
    # and the next restart read its lines as this job's first scores.
    with open(os.path.join(out, SCORES_FILE), "w") as f:
        f.write("".join(json.dumps(e) + "\n" for e in _scores(3, start=50)))
    again = coordinator(cfg, out)
    assert again.restarts == 1 and again.evals == _scores(5)
    again._save_state(time.monotonic() + 5.0)
    third = coordinator(cfg, out)
    assert third.evals == _scores(5)



@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_coordinator_killed_mid_run_keeps_the_curve_it_had_settled(tmp_path):
    """`psgd run`, the coordinator killed -9 once it has appended scores: the restarted
    one resumes them from the scores file, and summary.json's curve has them all, in order."""
    import signal

    from tests.test_reliability import child, job
    j = job(tmp_path, "mode.name=async", "train.steps=0", "train.seconds=8", "eval.every_seconds=0.25")
    scores = os.path.join(j.out, SCORES_FILE)
    try:
        j.start()
        end = time.monotonic() + 60
        while time.monotonic() < end:
            with contextlib.suppress(OSError):
                with open(scores) as f:
                    if sum(1 for _ in f) >= 6:
                        break
            time.sleep(0.05)
        else:
            raise AssertionError("the coordinator appended no scores")
        child(j, "coordinator-0").proc.send_signal(signal.SIGKILL)
        with open(scores) as f:   # (what the killed coordinator had appended: whole lines)
            before = [json.loads(line) for line in f if line.endswith("\n")]
        s = j.wait()
    finally:
        j.stop()
    assert s["failures"]["coordinator_restarts"] == 1, s["failures"]
    ts = [e["t"] for e in s["evals"]]
    assert ts == sorted(ts) and len(ts) > len(before)
    assert [(e["t"], e["accuracy"]) for e in s["evals"][:len(before)]] == [(e["t"], e["accuracy"]) for e in before]
    assert os.path.getsize(os.path.join(j.out, STATE_FILE)) < 20_000
