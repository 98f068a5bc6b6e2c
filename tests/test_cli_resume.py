"""What `psgd run` says of an interrupted job's shard checkpoints in its --out: that it
resumes from them, or why not."""
from __future__ import annotations

import pytest

from psgd.config import load
from psgd.launcher import LocalJob
from psgd.shard import Shard
from tests.conftest import free_port_block

pytestmark = pytest.mark.unit


@pytest.mark.timeout(60)
def test_run_says_whether_it_resumes_the_shard_checkpoints_in_its_folder(tmp_path, capsys):
    """A helper's review: an interrupted job said "a psgd run into the same --out resumes
    from them", and the next run said nothing either way: one with another optimizer.lr (or
    a smaller train.steps) started afresh, its checkpoints replacing the interrupted job's,
    and only logs/server-I.log said why."""
    port = free_port_block(3)
    cfg = load(None, [f"cluster.port={port}"], env={})
    for i in range(2):
        Shard(cfg, i).save(str(tmp_path / "checkpoints" / f"shard-{i}.pt"))
    LocalJob(cfg, str(tmp_path), quiet=True).stop()
    err = capsys.readouterr().err
    assert f"resuming the unfinished job whose shard checkpoints are in {tmp_path / 'checkpoints'}" in err, err
    other = load(None, [f"cluster.port={port}", "optimizer.lr=0.05"], env={})
    LocalJob(other, str(tmp_path), quiet=True).stop()
    err = capsys.readouterr().err
    assert (f"warning: not resuming from the shard checkpoints in {tmp_path / 'checkpoints'} (shard-0.pt: it is of "
            f"another training configuration (optimizer.lr 0.1 → 0.05)") in err and "the job starts afresh" in err, err
    assert "resuming the unfinished" not in err
