"""Your own training loop as a psgd worker (psgd/connection.py): `psgd run --script`
starts the coordinator and the shards, then copies of the script, in every mode.

- examples/custom_loss.py (a model and a loss of its own) and examples/cifar10_resnet.py
  (a ResNet on synthetic CIFAR-shaped data) train in every mode at small budgets: the
  score the script reports beats an untrained model's, summary.json has it, and
  DIR/model.pt loads into the script's own module;
- the shards learn the model from the workers: no shard imports the script;
- a script that raises ends the job with its reason; a job whose workers build
  different models is refused with the difference;
- psgd run waits for a script's work after close(), and fails if a script fails there.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from psgd import consistency
from psgd.config import Config
from psgd.launcher import LaunchError, LocalJob, run_local
from tests.conftest import EXAMPLES, example, free_port_block

pytestmark = [pytest.mark.processes, pytest.mark.slow]

SMALL = {"cluster.workers": 2, "cluster.servers": 2, "model.name": "script", "cluster.evaluator": False,
         "mode.round_steps": 20, "mode.tau": 4, "mode.local_steps": 10}
# cluster.timeout_s of the script jobs below. It is also the coordinator's rendezvous, counted from its
# own start: the scripts (python, import torch, psgd.connect) must register within it. They took 6-8 s
# after the coordinator on a loaded 2-core machine and 12.5 s under heavier load, where 8 s and 12 s
# failed with "0/2 workers registered"; the tests' waits grow with it.
SCRIPT_TIMEOUT_S = 30.0
# examples/custom_loss.py's pinball loss on its test set: above this untrained (0.439, its seed 0)
UNTRAINED_LOSS = 0.4


def run_script(tmp_path, script: list[str], **sets) -> dict:
    cfg = Config().replace(**{**SMALL, **sets})
    return run_local(cfg, str(tmp_path), quiet=True, timeout_s=240, script=script)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", consistency.NAMES)
def test_custom_model_and_loss_in_every_mode(tmp_path, mode):
    s = run_script(tmp_path, [os.path.join(EXAMPLES, "custom_loss.py")], **{"mode.name": mode, "train.steps": 300})
    ex = example("custom_loss")
    x, y = ex.series(2000, seed=10_000)
    with torch.random.fork_rng():
        torch.manual_seed(0)   # as the script seeds its model
        untrained, untrained_loss = ex.within(ex.Forecaster(), x, y)
    assert untrained < 0.15 and untrained_loss > UNTRAINED_LOSS   # (0.047, 0.439; 0.28-0.44 for seeds 0-4)
    # Learned: the pinball loss 0.068-0.077 after these 300 steps of async in 10 runs, idle and
    # loaded; 0.061-0.109 over every mode in a review's runs (ssp 0.109, async 0.1065): below half
    # the untrained model's. The share within 0.1 of the truth is noisier: 0.27-0.51 in those
    # runs, 0.2255 in one CI run, where > 0.25 failed; it need only beat the untrained ceiling.
    assert s["final_loss"] < UNTRAINED_LOSS / 2 and s["final_accuracy"] >= 0.15, s   # the script's report
    assert s["mode"] == mode and s["failures"]["workers_lost"] == 0
    assert s["data"] is None and s["batch_size"] is None   # the script's own, not psgd's config (was digits, 32)
    model = ex.Forecaster()
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))   # the final global model
    assert ex.within(model, x, y)[1] < UNTRAINED_LOSS / 2
    for i in range(2):  # the shards never imported the script, and the workers wrote step lines
        with open(tmp_path / "logs" / f"server-{i}.log") as f:
            assert "custom_loss" not in f.read()
    assert os.path.getsize(tmp_path / "events" / "worker-1.jsonl") > 0


@pytest.mark.timeout(300)
def test_a_scripts_sync_job_with_wire_overlap_trains_and_says_its_pushes_leave_after_backward(tmp_path):
    """wire.overlap with a training script: its backward runs before psgd.step, where the
    step's pushes leave, all of them; the shards and the script's replica place the tables
    alike (whole layers in order), and the job trains."""
    s = run_script(tmp_path, [os.path.join(EXAMPLES, "custom_loss.py")],
                   **{"mode.name": "sync", "train.steps": 300, "wire.overlap": True})
    assert s["final_loss"] < UNTRAINED_LOSS / 2 and s["failures"]["workers_lost"] == 0, s
    with open(tmp_path / "logs" / "worker-0.log") as f:
        assert "wire.overlap: the training script runs backward before psgd.step" in f.read()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", consistency.NAMES)
def test_resnet_loop_in_every_mode(tmp_path, mode):
    s = run_script(tmp_path, [os.path.join(EXAMPLES, "cifar10_resnet.py"), "--width", "4", "--synthetic", "1200"],
                   **{"mode.name": mode, "train.steps": 60, "optimizer.lr": 0.05, "cluster.servers": 1})
    ex = example("cifar10_resnet")
    with torch.random.fork_rng():
        torch.manual_seed(0)   # as the script seeds its model
        _, test = ex.cifar10(None, 1200)
        untrained, _ = ex.evaluate(ex.ResNet(4, 1), test)
    assert untrained < 0.1   # 10 classes: chance is 0.1 (0.07; 0.065-0.12 for seeds 0-4)
    # Learned: 0.24-0.475 after these 60 steps on a loaded machine (ssp 0.24-0.465 in 11 runs, mean 0.37,
    # sd 0.07; async 0.32-0.475; easgd 0.36-0.455; diloco 0.32): > 0.2 was 2.4 sd below ssp's mean
    assert s["final_accuracy"] >= 0.15, s
    model = ex.ResNet(4, 1)
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))


@pytest.mark.timeout(240)
def test_a_shard_killed_before_its_first_checkpoint_takes_a_workers_copy(tmp_path):
    """A learned model's shard that comes back with nothing to restore: the workers give
    it their copy (not_ready, then init from any rank) and the job completes."""
    from tests.test_reliability import kill_during

    cfg = Config().replace(**{**SMALL, "mode.name": "sync", "train.steps": 900, "checkpoint.every_s": 0,
                              "faults.step_delay_s": 0.004})
    job = LocalJob(cfg, str(tmp_path), quiet=True, timeout_s=200,
                   script=[os.path.join(EXAMPLES, "custom_loss.py")])
    s = kill_during(job, "server-1", (0, 150))
    assert s["failures"]["shard_restarts"] == 1 and s["failures"]["workers_lost"] == 0, s["failures"]
    assert s["final_accuracy"] >= 0.3, s
    logs = "".join((tmp_path / "logs" / f"worker-{r}.log").read_text() for r in range(2))
    assert "lost its tables; offering this worker's copy" in logs


SCRIPT_RAISES = """
import torch, psgd
model = torch.nn.Linear(4, 2)
with psgd.connect(model) as ps:
    for i in range(5):
        model(torch.randn(8, 4)).sum().backward()
        ps.step()
    raise ValueError("the data ran dry")
"""

SCRIPT_BY_RANK = """
import torch, psgd
rank = int(__import__("os").environ["PSGD_RANK"])
model = torch.nn.Linear(4, 2 + rank)  # rank 1's model differs from rank 0's
with psgd.connect(model) as ps:
    while ps.step():
        model(torch.randn(8, 4)).sum().backward()
"""


@pytest.mark.timeout(120)
def test_a_script_that_raises_ends_the_job_with_its_reason(tmp_path):
    path = tmp_path / "raises.py"
    path.write_text(SCRIPT_RAISES)
    with pytest.raises(LaunchError, match="ValueError: the data ran dry"):
        run_script(tmp_path / "out", [str(path)], **{"mode.name": "sync", "train.steps": 1000})


SCRIPT_RAISES_WITHOUT_WITH = """
import os, torch, psgd
model = torch.nn.Linear(4, 2)
ps = psgd.connect(model)
for i in range(10 ** 6):
    model(torch.randn(8, 4)).sum().backward()
    if not ps.step():
        break
    if i == 5 and os.environ["PSGD_RANK"] == "1":
        raise ValueError("the data ran dry")
ps.close()
"""


@pytest.mark.timeout(120)
def test_a_script_that_raises_outside_with_ends_the_job_with_its_reason(tmp_path):
    """A helper's review: as the README's first example does (no `with`), a rank that raised
    left the job until the end of the other's train.steps (this one: 10**6 steps)."""
    path = tmp_path / "raises.py"
    path.write_text(SCRIPT_RAISES_WITHOUT_WITH)
    with pytest.raises(LaunchError, match="worker 1's training script raised ValueError: the data ran dry"):
        run_script(tmp_path / "out", [str(path)], **{"mode.name": "async", "train.steps": 10 ** 6})
    assert "Traceback" in (tmp_path / "out" / "logs" / "worker-1.log").read_text()


SCRIPT_RANK1_FAILS_FIRST = """
import os, sys, time, torch, psgd
from torch import nn
if os.environ["PSGD_RANK"] == "1" and os.path.exists(sys.argv[1]):
    time.sleep(2)
    sys.exit("rank 1: could not load its data")    # before psgd.connect: the shards never get their values
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
with psgd.connect(model, None) as ps:
    print("after connect: |w| =", float(sum(p.norm() for p in model.parameters())), flush=True)
    while True:
        model.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(16, 4)), torch.randint(0, 2, (16,))).backward()
        if not ps.step():
            break
"""


@pytest.mark.timeout(180)
def test_a_job_that_fails_before_the_initial_values_leaves_no_checkpoint_to_resume_at_zeros(tmp_path):
    """A review: the shards checkpointed their zero tables on the way out, and the next job
    in the folder resumed from them: every worker trained from all-zero weights."""
    path, flag = tmp_path / "rank1.py", tmp_path / "fail"
    path.write_text(SCRIPT_RANK1_FAILS_FIRST)
    flag.write_text("")
    out = tmp_path / "out"
    with pytest.raises(LaunchError):
        run_script(out, [str(path), str(flag)], **{"mode.name": "sync", "train.steps": 20,
                                                   "cluster.timeout_s": SCRIPT_TIMEOUT_S})
    assert list(out.glob("checkpoints/*.pt")) == []
    flag.unlink()
    run_script(out, [str(path), str(flag)], **{"mode.name": "sync", "train.steps": 20})
    said = (out / "logs" / "worker-0.log").read_text()
    assert "after connect: |w| = 0.0" not in said and "after connect: |w| =" in said, said


SCRIPT_RANK0_DIES_BEFORE_INIT = """
import os, torch, psgd
from torch import nn
import psgd.workers.worker
if os.environ["PSGD_RANK"] == "0":   # registered, then gone before it sends the initial values
    psgd.workers.worker.Worker.start = lambda self, schedule: os._exit(9)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
with psgd.connect(model, None) as ps:
    while ps.step():
        pass
"""


@pytest.mark.timeout(120)
def test_a_job_whose_worker_0_dies_before_the_initial_values_fails_and_says_why(tmp_path):
    """The other workers waited for its values for ever (the job until --timeout)."""
    path = tmp_path / "r0.py"
    path.write_text(SCRIPT_RANK0_DIES_BEFORE_INIT)
    with pytest.raises(LaunchError, match="worker 0, which brings the initial values, left the job before "
                                          "sending them"):
        run_script(tmp_path / "out", [str(path)], **{"mode.name": "sync", "train.steps": 50,
                                                     "cluster.timeout_s": SCRIPT_TIMEOUT_S})


SCRIPT_RANK1_ENDS_THE_JOB = """
import os, sys, torch, psgd
from torch import nn
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
ps = psgd.connect(model, None)
n = 0
try:
    while True:
        model.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(16, 4)), torch.randint(0, 2, (16,))).backward()
        n += 1
        if ps.rank == 1 and n == 20:
            ps.close(error="its data loader broke")
            sys.exit(1)
        if not ps.step():
            print(f"step() returned False after {n} steps", flush=True)
            break
    ps.close()
    print("close() returned", flush=True)
except psgd.JobError as e:
    print(f"JobError: {e}", flush=True)
    sys.exit(3)
"""


@pytest.mark.timeout(120)
def test_a_job_aborted_by_another_worker_is_an_error_in_the_script(tmp_path):
    """A review: step() returned False as for a spent budget, and close() returned: the
    script could not tell an aborted job (no model.pt) from a finished one."""
    path = tmp_path / "ab.py"
    path.write_text(SCRIPT_RANK1_ENDS_THE_JOB)
    with pytest.raises(LaunchError, match="its data loader broke"):
        run_script(tmp_path / "out", [str(path)], **{"mode.name": "async", "train.steps": 100000})
    said = (tmp_path / "out" / "logs" / "worker-0.log").read_text()
    assert "JobError: the job was aborted: its data loader broke" in said, said
    assert "returned" not in said, said


SCRIPT_NO_CLOSE = """
import torch, psgd
from torch import nn
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
ps = psgd.connect(model, None)
while True:
    model.zero_grad()
    nn.functional.cross_entropy(model(torch.randn(16, 4)), torch.randint(0, 2, (16,))).backward()
    if not ps.step():
        break
"""


@pytest.mark.timeout(120)
def test_a_script_that_never_closes_is_told_so(tmp_path):
    """A review: the job failed as "all workers were lost ... (exit codes 0, 0)", no hint."""
    path = tmp_path / "noclose.py"
    path.write_text(SCRIPT_NO_CLOSE)
    with pytest.raises(LaunchError, match=r"worker-0 0, worker-1 0; a script that exits without ps.close\(\)"):
        run_script(tmp_path / "out", [str(path)], **{"mode.name": "async", "train.steps": 20})


# A small script's model and its training loop, which the scripts below go on from
SMALL_TRAINING = """
import os, sys, time, torch, psgd
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

def train(ps):
    while True:
        model.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(16, 4)), torch.randint(0, 2, (16,))).backward()
        if not ps.step(samples=16):
            break
"""

SCRIPT_WORKS_AFTER_CLOSE = SMALL_TRAINING + """
with psgd.connect(model, None) as ps:
    train(ps)
    rank = ps.rank
# after close(): `model` holds the job's global model (README); score it, save results
time.sleep(float(sys.argv[2]))
with open(os.path.join(sys.argv[1], f"after-{rank}.txt"), "w") as f:
    f.write("scored")
if len(sys.argv) > 3:
    raise RuntimeError("writing the results failed")
"""


@pytest.mark.timeout(150)
def test_psgd_run_lets_a_script_finish_its_work_after_close(tmp_path, capsys):
    """A review: a script scores or saves after close() (README: rank 0 loads the final
    global model into its model; score DIR/model.pt), but psgd run gave the scripts 10 s
    after the coordinator exited, then SIGTERMed them: the work was lost, and the run
    reported success."""
    path = tmp_path / "after.py"
    path.write_text(SCRIPT_WORKS_AFTER_CLOSE)
    run_script(tmp_path / "out", [str(path), str(tmp_path), "14"],   # past the 10 s psgd run gave
               **{"mode.name": "async", "train.steps": 20, "cluster.servers": 1})
    assert (tmp_path / "after-0.txt").exists() and (tmp_path / "after-1.txt").exists()
    assert "the job has ended; waiting for worker-0's script to end" in capsys.readouterr().err


SCRIPT_SCORES_AFTER_ITS_LOOP = SMALL_TRAINING + """
with psgd.connect(model, None) as ps:
    train(ps)
    if ps.rank == 1:
        time.sleep(20)   # its own scoring of the model, before close()
"""


@pytest.mark.timeout(150)
def test_wall_s_and_samples_per_s_leave_out_what_a_script_does_after_its_last_step(tmp_path):
    """A review: the cifar example's evaluation after its loop, before close(), was in
    wall_s (5.7 s for 1.1 s of training) and samples/s fell by as much: a script's
    finish came at its close(). Its training ends at its last step (step() False)."""
    path = tmp_path / "scores.py"
    path.write_text(SCRIPT_SCORES_AFTER_ITS_LOOP)
    s = run_script(tmp_path / "out", [str(path)], **{"mode.name": "sync", "train.steps": 30, "cluster.servers": 1})
    assert s["samples"] == 2 * 30 * 16
    assert s["wall_s"] < 15.0, s["wall_s"]   # (30 steps of a tiny model; the sleep's 20 s were in it)
    assert s["samples_per_s"] == pytest.approx(s["samples"] / s["wall_s"], rel=0.01)


@pytest.mark.timeout(150)
def test_psgd_run_fails_when_a_script_fails_after_close(tmp_path):
    """A review: a script whose own work after close() raised (exit 1) still gave a clean
    psgd run (exit 0, no word): the launcher did not look at the scripts' exit codes once
    the coordinator had written its summary."""
    path = tmp_path / "after.py"
    path.write_text(SCRIPT_WORKS_AFTER_CLOSE)
    with pytest.raises(LaunchError, match=r"worker-0's script exited with code 1; .*worker-0.log ends:\n(.|\n)*"
                                          r"RuntimeError: writing the results failed") as e:
        run_script(tmp_path / "out", [str(path), str(tmp_path), "0", "fail"],
                   **{"mode.name": "async", "train.steps": 20, "cluster.servers": 1})
    assert "worker-1's script exited with code 1" in str(e.value)


SCRIPT_RANK_1_STALLS = """
import sys, time, torch, psgd
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
ps = psgd.connect(model)
x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
for k in range(int(sys.argv[1 + ps.rank])):   # rank 0's steps, rank 1's before it stalls
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    print(f"STEP {k}", flush=True)
    ps.step(samples=8)
if ps.rank == 1:
    time.sleep(10 ** 6)     # alive (its heartbeats go on), never steps again: a data loader that deadlocked
print("CLOSING", flush=True)
t0 = time.monotonic()
try:
    ps.close()
    print(f"close() returned after {time.monotonic() - t0:.1f} s [ended {time.time():.3f}]", flush=True)
except psgd.JobError as e:
    print(f"close() raised JobError after {time.monotonic() - t0:.1f} s [ended {time.time():.3f}]: {e}", flush=True)
except BaseException as e:
    print(f"close() raised {type(e).__module__}.{type(e).__name__} after {time.monotonic() - t0:.1f} s "
          f"[ended {time.time():.3f}]: {e}", flush=True)
"""
STALL_TIMEOUT_S = 15.0   # what close() and the coordinator's notice of a stall wait (each test waits it out)


def stalled_job(tmp_path, mode: str, steps: tuple[int, int]) -> LocalJob:
    """Two copies of SCRIPT_RANK_1_STALLS, started: rank 0 steps steps[0] times, then
    closes; rank 1 stalls, still live, after steps[1]."""
    path = tmp_path / "stalls.py"
    path.write_text(SCRIPT_RANK_1_STALLS)
    cfg = Config().replace(**{**SMALL, "cluster.servers": 1, "mode.name": mode, "train.steps": 1000,
                              "cluster.timeout_s": STALL_TIMEOUT_S, "cluster.heartbeat_s": 0.25,
                              "cluster.heartbeat_timeout_s": 2, "cluster.port": free_port_block(2)})
    j = LocalJob(cfg, str(tmp_path / "out"), quiet=True, timeout_s=200, script=[str(path), *map(str, steps)])
    j.start()
    return j


def child_named(j: LocalJob, name: str):
    return next(c for c in j.children if c.name == name)


def wait_for_line(j: LocalJob, name: str, text: str, timeout: float) -> str:
    """The first line of child NAME's log that holds `text`, waiting up to `timeout` s."""
    path = child_named(j, name).log_path
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            found = [line for line in open(path).read().splitlines() if text in line]
            if found:
                return found[0]
        time.sleep(0.2)
    tail = open(path).read()[-1500:] if os.path.exists(path) else "(no log)"
    raise AssertionError(f"no {text!r} in {name}'s log within {timeout:.0f} s; it ends:\n{tail}")


@pytest.mark.timeout(240)
def test_a_sync_job_names_a_live_worker_that_does_not_step(tmp_path):
    """A review: in sync, rank 1's script stalled after connect (its heartbeat thread
    went on: live, never dropped) and rank 0's step() waited for it with no word, until
    psgd run's --timeout (an hour by default). cluster.timeout_s does not bound that wait
    (a slow step is legitimate), but the coordinator's progress line now names the
    worker the job waits for once it has neither stepped nor waited on the shards for
    cluster.timeout_s."""
    j = stalled_job(tmp_path, "sync", (1000, 0))
    try:
        wait_for_line(j, "worker-0", "STEP 0", 120)
        line = wait_for_line(j, "coordinator-0", "waiting for worker", STALL_TIMEOUT_S + 20)
        assert "waiting for worker 1: no step for" in line and "worker 0" not in line, line
        assert child_named(j, "worker-0").poll() is None   # (still waiting: --timeout bounds it)
    finally:
        j.stop()


@pytest.mark.timeout(240)
def test_close_with_the_coordinator_stopped_gives_up_within_timeout_with_a_job_error(tmp_path):
    """A review: README says rank 0's close() gives up if the coordinator stops answering
    for cluster.timeout_s. With the coordinator stopped (SIGSTOP) while close() waited
    for rank 1, close() took twice that (the status poll's timeout, then the `release`
    call's) and raised the transport's PeerTimeout, which said 3 s (its last window).
    Now it skips the release and raises JobError."""
    j = stalled_job(tmp_path, "async", (5, 5))
    coordinator = j.children[0]
    try:
        wait_for_line(j, "worker-0", "CLOSING", 120)
        time.sleep(1.0)   # rank 0 polls the coordinator's status in close()
        stopped_at = time.time()
        coordinator.proc.send_signal(signal.SIGSTOP)
        line = wait_for_line(j, "worker-0", "close() r", 2 * STALL_TIMEOUT_S + 20)
        assert line.startswith("close() raised JobError") and "the coordinator stopped answering" in line, line
        # from the SIGSTOP (not from close()'s start, which adds this test's own reaction to CLOSING):
        # cluster.timeout_s and close()'s own ending (was twice the timeout)
        ended_at = float(line.split("[ended ")[1].split("]")[0])
        assert ended_at - stopped_at <= STALL_TIMEOUT_S + 5, (ended_at - stopped_at, line)
    finally:
        coordinator.proc.send_signal(signal.SIGCONT)
        j.stop()


@pytest.mark.timeout(120)
def test_workers_with_different_models_are_refused(tmp_path):
    path = tmp_path / "by_rank.py"
    path.write_text(SCRIPT_BY_RANK)
    with pytest.raises(LaunchError) as e:
        run_script(tmp_path / "out", [str(path)], **{"mode.name": "async", "train.steps": 50,
                                                     "cluster.timeout_s": SCRIPT_TIMEOUT_S})
    logs = "".join((tmp_path / "out" / "logs" / n).read_text() for n in os.listdir(tmp_path / "out" / "logs")
                   if n.endswith(".log"))
    assert "differs from the job's" in logs and "shape (2, 4)" in logs and "shape (3, 4)" in logs, str(e.value)
    # which worker's the job's model is (a review: the first to register, rank 1 here or there, was not named)
    assert re.search(r"differs from the job's \(worker [01]'s, the first to register: ", logs), logs


@pytest.mark.timeout(120)
def test_psgd_run_script_from_the_command_line(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "psgd", "run", "--script", os.path.join(EXAMPLES, "custom_loss.py"),
                        "--mode", "async", "--workers", "2", "--set", "train.steps=100", "--out", str(out),
                        "--quiet", "--", "--lr", "0.02"],
                       capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "async: accuracy" in r.stdout and (out / "model.pt").exists()
    r = subprocess.run([sys.executable, "-m", "psgd", "run", "--", "--lr", "1"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "give --script FILE" in r.stderr


SCRIPT_NEVER_STEPS = """
import torch, psgd
model = torch.nn.Linear(4, 2)
with psgd.connect(model) as ps:
    model(torch.randn(8, 4)).sum().backward()   # a loop that forgot ps.step()
"""


@pytest.mark.timeout(120)
def test_a_script_that_never_steps_is_warned_of_its_untrained_model(tmp_path):
    """Was: exit 0, "accuracy 0.0780 ... 0 samples/s" and the untrained model, with no
    word that no step was taken (only worker-R.log's "finished 0 steps")."""
    path = tmp_path / "idle.py"
    path.write_text(SCRIPT_NEVER_STEPS)
    r = subprocess.run([sys.executable, "-m", "psgd", "run", "--script", str(path), "--mode", "sync",
                        "--workers", "1", "--servers", "1", "--set", "train.steps=20", "--out",
                        str(tmp_path / "out"), "--quiet"], capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert ("psgd run: warning: no worker took a training step (0 samples): the model is untrained; does the "
            "script call ps.step() for each batch?") in r.stderr


SCRIPT_PRINTS = """
import sys, torch, psgd
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
with psgd.connect(model) as ps:
    print("stdout: rank", ps.rank, "of", ps.world_size)
    while True:
        model.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        if not ps.step():
            break
    print("stderr: rank", ps.rank, "done", file=sys.stderr)
    print("stdout: rank", ps.rank, "done")
"""


@pytest.mark.timeout(120)
def test_what_a_script_prints_to_stdout_is_in_its_log(tmp_path):
    """It used to be discarded: only stderr reached DIR/logs/worker-R.log."""
    path = tmp_path / "prints.py"
    path.write_text(SCRIPT_PRINTS)
    run_script(tmp_path / "out", [str(path)], **{"mode.name": "async", "train.steps": 20, "cluster.servers": 1})
    for rank in range(2):
        lines = (tmp_path / "out" / "logs" / f"worker-{rank}.log").read_text().splitlines()
        mine = [line for line in lines if line.startswith(("stdout:", "stderr:"))]
        assert mine == [f"stdout: rank {rank} of 2", f"stderr: rank {rank} done", f"stdout: rank {rank} done"], lines


@pytest.mark.timeout(120)
def test_a_scripts_help_ends_the_job_at_once_with_its_usage(tmp_path):
    """A script that exits 0 before psgd.connect (`-- --help`) used to leave the job
    waiting until cluster.timeout_s, then "0/2 workers registered"."""
    r = subprocess.run([sys.executable, "-m", "psgd", "run", "--script", os.path.join(EXAMPLES, "custom_loss.py"),
                        "--workers", "2", "--servers", "1", "--set", "cluster.timeout_s=90", "--out",
                        str(tmp_path / "out"), "--quiet", "--", "--help"],
                       capture_output=True, text=True, timeout=80, cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    assert "script exited with code 0 before joining the job" in r.stderr, r.stderr
    assert "usage: custom_loss.py" in r.stderr and "registered" not in r.stderr, r.stderr


@pytest.mark.timeout(120)
def test_the_cifar_example_refuses_a_data_folder_without_the_files(tmp_path):
    """A mistyped --data trained on the synthetic set and reported it as CIFAR-10."""
    r = subprocess.run([sys.executable, os.path.join(EXAMPLES, "cifar10_resnet.py"), "--data", str(tmp_path)],
                       capture_output=True, text=True, timeout=100)
    assert r.returncode == 1
    assert f"--data {tmp_path}: no CIFAR-10 binary file data_batch_1.bin there" in r.stderr


SCRIPT_KILLED_ONCE = """
import os, signal, sys, time, torch
from torch import nn
import psgd
torch.manual_seed(0)
model = nn.Linear(4, 2)
marker = os.path.join(sys.argv[1], "killed")
if os.path.exists(marker):
    time.sleep(10)   # the restarted copy loads its data: the job ends meanwhile
ps = psgd.connect(model)
step = 0
while True:
    step += 1
    if ps.rank == 1 and step == 5 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    model.zero_grad()
    x = torch.randn(8, 4)
    nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long()).backward()
    if not ps.step(samples=8):
        break
ps.close()
"""


@pytest.mark.timeout(200)
def test_a_restarted_script_that_had_not_rejoined_when_the_job_ended_is_stopped(tmp_path):
    """A review: with --restart-workers, a script killed mid-job was started again, and the
    job ended (the other worker finished) before the new copy registered; psgd run then
    waited for that copy, whose psgd.connect waited cluster.timeout_s for a coordinator
    that was gone, and failed the finished job ("worker-1's script exited with code 1")."""
    path = tmp_path / "killed_once.py"
    path.write_text(SCRIPT_KILLED_ONCE)
    cfg = Config().replace(**{**SMALL, "mode.name": "async", "train.steps": 10, "cluster.servers": 1,
                              "cluster.timeout_s": SCRIPT_TIMEOUT_S, "cluster.heartbeat_timeout_s": 2.0})
    started = time.monotonic()
    summary = run_local(cfg, str(tmp_path / "out"), quiet=True, timeout_s=150, script=[str(path), str(tmp_path)],
                        restart_workers=True)
    assert (tmp_path / "killed").exists() and summary["failures"]["workers_lost"] == 1
    assert time.monotonic() - started < 60 + SCRIPT_TIMEOUT_S - 10   # not the restarted copy's wait for the coordinator



@pytest.mark.timeout(200)
def test_a_script_killed_before_its_first_heartbeat_counts_its_steps_in_the_summary(tmp_path):
    """A review: rank 1's script was killed after 4 steps, in its first second, and
    summary.json counted only rank 0's samples: the coordinator had heard none of rank 1's,
    and no new process took its rank up to send what its step lines say. Its steps are
    now counted as those lines have them."""
    path = tmp_path / "killed_once.py"   # (killed in its first second: before a heartbeat counted a step)
    path.write_text(SCRIPT_KILLED_ONCE)
    cfg = Config().replace(**{**SMALL, "mode.name": "async", "train.steps": 10, "cluster.servers": 1,
                              "cluster.timeout_s": SCRIPT_TIMEOUT_S, "cluster.heartbeat_timeout_s": 2.0})
    with pytest.raises(LaunchError, match="worker-1's script exited with code -9"):   # (the job itself ended)
        run_local(cfg, str(tmp_path / "out"), quiet=True, timeout_s=150, script=[str(path), str(tmp_path)])
    with open(tmp_path / "out" / "summary.json") as f:
        summary = json.load(f)
    assert summary["failures"]["workers_lost"] == 1
    with open(tmp_path / "out" / "events" / "worker-1.jsonl") as f:
        last = [json.loads(line) for line in f if '"step"' in line][-1]
    assert last["step"] >= 4 and last["samples"] == 8 * last["step"]
    assert summary["samples"] == 8 * 10 + last["samples"]


SCRIPT_KILLED_THEN_FAILING = SCRIPT_KILLED_ONCE.replace(
    "if os.path.exists(marker):\n    time.sleep(10)",
    "if os.path.exists(marker):\n"
    "    if not os.path.exists(marker + '-failed'):   # the first restarted copy fails as it builds its model\n"
    "        open(marker + '-failed', 'w').close()\n"
    "        sys.exit(1)\n"
    "    time.sleep(10)")


@pytest.mark.timeout(200)
def test_a_restarted_script_that_fails_before_joining_does_not_stop_a_job_under_way(tmp_path):
    """A review: with --restart-workers, a script killed mid-job was started again, and
    that copy exited 1 before psgd.connect (its model's memory not yet freed, say): psgd
    run stopped the whole job, "exited with code 1 before joining the job; the job cannot
    start without it", though the job had been training. Its rank is lost, and the job
    goes on to its end; the failed copy is then said as the script's failure."""
    assert SCRIPT_KILLED_THEN_FAILING != SCRIPT_KILLED_ONCE
    path = tmp_path / "killed_then_failing.py"
    path.write_text(SCRIPT_KILLED_THEN_FAILING)
    cfg = Config().replace(**{**SMALL, "mode.name": "async", "train.steps": 10, "cluster.servers": 1,
                              "cluster.timeout_s": SCRIPT_TIMEOUT_S, "cluster.heartbeat_timeout_s": 2.0})
    with pytest.raises(LaunchError) as e:
        run_local(cfg, str(tmp_path / "out"), quiet=True, timeout_s=150, script=[str(path), str(tmp_path)],
                  restart_workers=True)
    assert (tmp_path / "killed-failed").exists()
    assert "before joining the job" not in str(e.value) and "(the job itself ended" in str(e.value), str(e.value)
    with open(tmp_path / "out" / "summary.json") as f:
        summary = json.load(f)
    assert summary["failures"]["workers_lost"] == 1 and "aborted" not in summary
