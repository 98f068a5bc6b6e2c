"""A resumed job keeps what the job it goes on from wrote: that job's logs (which say
why it stopped), event logs and TensorBoard scalars move to DIR/earlier/; a new job in
an old folder replaces them, as before."""
from __future__ import annotations

import os
import shutil

import pytest

from psgd.config import load
from psgd.launcher import LaunchError, LocalJob
from psgd.shard import Shard
from tests.conftest import free_port_block

pytestmark = pytest.mark.unit


def _interrupted_job(out, cfg) -> None:
    """What a job killed mid-run leaves: its shards' checkpoints, logs and event logs."""
    for i in range(cfg.cluster.servers):
        Shard(cfg, i).save(str(out / "checkpoints" / f"shard-{i}.pt"))
    for kind, name, text in (("logs", "server-0.log", "killed: out of memory\n"),
                             ("events", "worker-0.jsonl", '{"step": 1}\n'),
                             ("tb", "events.out.tfevents.1.host", "scalars")):
        os.makedirs(out / kind, exist_ok=True)
        (out / kind / name).write_text(text)


@pytest.mark.timeout(60)
def test_a_resumed_job_keeps_the_interrupted_jobs_logs_in_earlier(tmp_path, capsys):
    """A review: resuming an interrupted job removed its logs, so the line that said why it
    had stopped was gone as the user started the run that was to go on from it."""
    cfg = load(None, [f"cluster.port={free_port_block(3)}"], env={})
    _interrupted_job(tmp_path, cfg)
    LocalJob(cfg, str(tmp_path), quiet=True).stop()
    err = capsys.readouterr().err
    assert f"the logs and event logs of the job it resumes are kept in {tmp_path / 'earlier'}" in err, err
    assert (tmp_path / "earlier" / "logs" / "server-0.log").read_text() == "killed: out of memory\n"
    assert (tmp_path / "earlier" / "events" / "worker-0.jsonl").read_text() == '{"step": 1}\n'
    assert (tmp_path / "earlier" / "tb" / "events.out.tfevents.1.host").exists()
    assert not (tmp_path / "events" / "worker-0.jsonl").exists()   # this job's own start afresh
    assert not (tmp_path / "tb" / "events.out.tfevents.1.host").exists()
    # A second resume keeps the job it goes on from: the one before is replaced, not mixed in
    (tmp_path / "logs" / "server-0.log").write_text("killed again\n")
    LocalJob(cfg, str(tmp_path), quiet=True).stop()
    assert (tmp_path / "earlier" / "logs" / "server-0.log").read_text() == "killed again\n"
    assert not (tmp_path / "earlier" / "events" / "worker-0.jsonl").exists()
    # A review: a resume stopped before its daemons wrote a line (empty logs) replaced the
    # kept logs of the job before it with nothing
    (tmp_path / "logs" / "server-0.log").write_text("")
    LocalJob(cfg, str(tmp_path), quiet=True).stop()
    assert (tmp_path / "earlier" / "logs" / "server-0.log").read_text() == "killed again\n"
    assert not (tmp_path / "logs" / "server-0.log").exists()
    # ... and OUT/earlier as a file is one error naming it, the logs left where they are
    (tmp_path / "logs" / "server-0.log").write_text("killed a third time\n")
    shutil.rmtree(tmp_path / "earlier")
    (tmp_path / "earlier").write_text("a file")
    with pytest.raises(LaunchError, match="could not keep the logs of the job it resumes in"):
        LocalJob(cfg, str(tmp_path), quiet=True)
    assert (tmp_path / "logs" / "server-0.log").read_text() == "killed a third time\n"


@pytest.mark.timeout(60)
def test_a_job_that_does_not_resume_replaces_the_earlier_jobs_logs(tmp_path, capsys):
    cfg = load(None, [f"cluster.port={free_port_block(3)}"], env={})
    _interrupted_job(tmp_path, cfg)
    (tmp_path / "earlier" / "logs").mkdir(parents=True)   # a review: kept by a resume two jobs back, left
    (tmp_path / "earlier" / "logs" / "server-0.log").write_text("two jobs back\n")
    other = load(None, [f"cluster.port={cfg.cluster.port}", "optimizer.lr=0.05"], env={})   # not resumed
    LocalJob(other, str(tmp_path), quiet=True).stop()
    assert "kept in" not in capsys.readouterr().err
    assert not (tmp_path / "earlier").exists()
    assert not (tmp_path / "logs" / "server-0.log").exists() or \
        "out of memory" not in (tmp_path / "logs" / "server-0.log").read_text()
    assert not (tmp_path / "events" / "worker-0.jsonl").exists()
