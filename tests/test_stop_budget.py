"""`psgd run`'s stop (`LocalJob._stop_children`) and a shard's checkpoint at exit. The stop
sent SIGTERM to every daemon and SIGKILL to what had not exited 5 s later; a shard writes
its checkpoint on SIGTERM, and a large model's (hundreds of MB, a slow disk, several
shards writing at once) took longer: SIGKILL cut it short, the checkpoint before it stood
(the write is atomic: its temp file was left), and nothing said so. The stand-in shard
here runs the shard server's own checkpoint at exit (`ShardServer._final_checkpoint`)
with a slowed write."""
from __future__ import annotations

import glob
import os
import sys
import time

import pytest
import torch

from psgd.config import load
from psgd.launcher import LocalJob
from tests.conftest import free_port_block
from tests.test_launcher import start_all

pytestmark = pytest.mark.processes

STAND_IN_SHARD = """
import signal, sys, time
import torch
from psgd.config import Config
from psgd.servers.shard_server import ShardServer
from psgd.shard import Shard

out, delay, started = sys.argv[1], float(sys.argv[2]), sys.argv[-1]
cfg = Config().replace(**{"cluster.servers": 1})
shard, server = Shard(cfg, 0), ShardServer(cfg, 0, out)
ckpt = cfg.checkpoint_file(out, 0)
shard.version = 3
shard.save(ckpt)                  # the checkpoint written before the stop
stopped = []
signal.signal(signal.SIGTERM, lambda *_: stopped.append(1))
open(started, "w").close()
while not stopped:
    time.sleep(0.05)
save = torch.save

def slow_save(obj, f):            # a slow disk: its bytes are in the temp file, the write not done for `delay` s
    save(obj, f)
    time.sleep(delay)

torch.save = slow_save
shard.version = 7                 # what the checkpoint at the stop holds
server._final_checkpoint(shard, ckpt)
"""

IDLE = "import sys, time; open(sys.argv[-1], 'w').close(); time.sleep(60)"
DEAF = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "open(sys.argv[-1], 'w').close(); time.sleep(60)")


class SlowCheckpointJob(LocalJob):
    """The shard is the stand-in above, whose checkpoint at exit takes `delay` s; the
    coordinator and the worker wait to be stopped (the worker, `deaf`, ignores SIGTERM)."""
    delay = 6.5
    deaf = False

    def _argv(self, role: str, *extra: str) -> list[str]:
        if role == "server":
            return [sys.executable, "-c", STAND_IN_SHARD, self.out, str(self.delay), *extra]
        return [sys.executable, "-c", DEAF if self.deaf and role == "worker" else IDLE, *extra]


def stopped(job_class: type[SlowCheckpointJob], tmp_path) -> tuple[float, str]:
    """Start a job of `job_class` (a shard, a worker, no evaluator), stop it once every
    process has started: how long the stop took, and the checkpoint's path."""
    cfg = load(None, [f"cluster.port={free_port_block(3)}", "cluster.servers=1", "cluster.workers=1",
                      "cluster.evaluator=false"], env={})
    job = job_class(cfg, str(tmp_path), quiet=True, timeout_s=60)
    try:
        start_all(job, 3)
        assert len(job.started) == 3, [job.tail(c) for c in job.children]
        t = time.monotonic()
        job.stop()
        return time.monotonic() - t, str(job.cfg.checkpoint_file(job.out, 0))
    finally:
        job.stop()


def version(path: str) -> int:
    return int(torch.load(path, weights_only=True)["version"])


@pytest.mark.timeout(120)
def test_a_shard_writing_its_checkpoint_at_the_stop_is_waited_for(tmp_path, capsys):
    """Its write takes 6.5 s, past the 5 s after which SIGKILL came."""
    took, ckpt = stopped(SlowCheckpointJob, tmp_path)
    assert version(ckpt) == 7, "the checkpoint written at the stop was cut short: the one before stands"
    assert glob.glob(ckpt + ".tmp.*") == []
    err = capsys.readouterr().err
    assert "server-0 is writing its checkpoint; waiting for it" in err, err
    assert "killed" not in err, err
    assert took >= 6.0
    assert os.listdir(tmp_path / "pids") == []


class StalledCheckpointJob(SlowCheckpointJob):
    """The shard's checkpoint never gets written (a stalled disk): the wait for it ends."""
    delay = 600.0
    stop_s = 3.0    # (the stand-in notes its write about 0.05 s after SIGTERM idle: room for a busy machine)
    saving_s = 6.0


@pytest.mark.timeout(120)
def test_the_wait_for_a_checkpoint_is_bounded_and_its_loss_said(tmp_path, capsys):
    took, ckpt = stopped(StalledCheckpointJob, tmp_path)
    assert 5.5 <= took < 20
    assert version(ckpt) == 3
    err = capsys.readouterr().err
    assert "server-0 is writing its checkpoint; waiting for it" in err, err
    assert (f"server-0 did not exit within 6 s of SIGTERM: killed (SIGKILL) while it wrote its checkpoint; "
            f"{ckpt} is the one written before, if any") in err, err
    assert os.listdir(tmp_path / "pids") == []   # (the shard's note that it was writing goes with it)


class DeafWorkerJob(SlowCheckpointJob):
    """The worker ignores SIGTERM; the shard exits at once."""
    delay = 0.0
    deaf = True
    stop_s = 3.0    # (the stand-in shard exits about 0.3 s after SIGTERM idle)
    saving_s = 60.0


@pytest.mark.timeout(120)
def test_a_daemon_that_is_not_writing_a_checkpoint_gets_the_short_budget(tmp_path, capsys):
    took, ckpt = stopped(DeafWorkerJob, tmp_path)
    assert took < 20
    assert version(ckpt) == 7
    err = capsys.readouterr().err
    assert "worker-0 did not exit within 3 s of SIGTERM: killed (SIGKILL)" in err, err
    assert "writing its checkpoint" not in err, err

