"""A shard lends its tables to its replies (`Shard._snapshot`: one snapshot per version,
the tables themselves while ZeroMQ may read them, `Shard._changing`) and checkpoints a
copy of them written on another thread (`ShardServer._checkpoint_in_background`). Under
load, through real sockets, every model a reader gets and every checkpoint written must
be one version's tables, never half of one and half of the next.

The updates make each version recognisable: with plain SGD at an effective rate of 1
(async applies lr / W), a first push of the initial values themselves brings the table
to 0 (exactly: x - x), and every later push of all -1 adds exactly 1, so version v's
table is v - 1 in every entry. The table (about 2.6 MB) is far above
`transport.COPY_THRESHOLD`: replies go without copies, and ZeroMQ reads the tables
while the next pushes arrive."""
from __future__ import annotations

import glob
import os
import threading
import time

import pytest
import torch

from psgd import transport
from psgd.config import load
from psgd.inprocess import InProcessCluster
from psgd.workers.client import ParameterClient, tensors_of

pytestmark = pytest.mark.inprocess

W = 4                 # ranks 0, 1 push (and read); 2, 3 only read
PUSHES = 100          # per pushing rank
HIDDEN = 768          # the MLP's ~0.65M parameters: one 2.6 MB table on one shard


def one_version(table: torch.Tensor, version: int, what: str) -> str:
    """'' if `table` is version `version`'s (every entry version - 1), else what it holds."""
    want = float(version - 1)
    if bool(torch.all(table == want)):
        return ""
    values = torch.unique(table)
    return f"{what} of version {version}: values {values[:6].tolist()} (want {want} everywhere)"


@pytest.mark.timeout(30)
def test_every_read_and_checkpoint_under_load_is_one_versions_tables(port_block, tmp_path):
    cfg = load(None, [f"cluster.port={port_block(2)}", f"cluster.workers={W}", "cluster.servers=1",
                      "cluster.evaluator=false", "mode.name=async", f"model.hidden={HIDDEN}",
                      "optimizer.name=sgd", f"optimizer.lr={W}", "optimizer.momentum=0",
                      "optimizer.weight_decay=0", "train.steps=100000", "checkpoint.every_s=0.05"], env={})
    bad: list[str] = []
    reads = {k: 0 for k in ("checkpoints", 0, 1, 2, 3)}   # each counted by one thread
    done = threading.Event()
    minus_one: torch.Tensor | None = None

    def pusher(cluster, rank: int, start: int, version: int) -> None:
        client = ParameterClient(cfg, cluster.ctx, rank)
        try:
            for clock in range(start, start + PUSHES):
                _, pulled = client.push_pull(clock, [minus_one], [torch.zeros(0)], [version])
                version = pulled[0].get("version")
                bad.extend(filter(None, [one_version(tensors_of(pulled, 0)[0], version, f"rank {rank}'s read")]))
                reads[rank] += 1
        except Exception as e:  # noqa: BLE001 (reported by the test)
            bad.append(f"rank {rank}: {type(e).__name__}: {e}")
        finally:
            client.close()

    def puller(cluster, rank: int) -> None:
        client = ParameterClient(cfg, cluster.ctx, rank)
        try:
            while not done.is_set():
                m, = client.pull(1)
                bad.extend(filter(None, [one_version(tensors_of([m], 0)[0], m.get("version"), f"rank {rank}'s pull")]))
                reads[rank] += 1
        except Exception as e:  # noqa: BLE001
            bad.append(f"rank {rank}: {type(e).__name__}: {e}")
        finally:
            client.close()

    def checkpoints(folder: str) -> None:
        """Read every checkpoint written while the pushes go on (replaced atomically)."""
        seen = None
        while not done.is_set():
            for path in glob.glob(os.path.join(folder, "shard-0.pt")):
                stamp = os.stat(path).st_mtime_ns
                if stamp == seen:
                    continue
                seen = stamp
                sd = torch.load(path, weights_only=True)
                if sd["version"] >= 1:
                    bad.extend(filter(None, [one_version(sd["params"], sd["version"], "checkpoint")]))
                    reads["checkpoints"] += 1
            time.sleep(0.01)

    with InProcessCluster(cfg, out=str(tmp_path)) as cluster:
        first = ParameterClient(cfg, cluster.ctx, 0)
        (init,), _ = first.tables(first.join(0))
        # version 1: the initial values pushed as a gradient, at rate 1, leave 0 everywhere
        _, (m,) = first.push_pull(0, [init.clone()], [torch.zeros(0)], [0])
        first.close()
        assert 4 * init.numel() > 8 * transport.COPY_THRESHOLD and bool(torch.any(init != 0))   # lent, not copied
        assert m.get("version") == 1 and not one_version(tensors_of([m], 0)[0], 1, "version 1")
        minus_one = torch.full_like(init, -1.0)
        folder = os.path.dirname(cfg.checkpoint_file(str(tmp_path), 0))
        threads = [threading.Thread(target=pusher, args=(cluster, 0, 1, 1)),
                   threading.Thread(target=pusher, args=(cluster, 1, 0, 1))]
        others = [threading.Thread(target=puller, args=(cluster, r)) for r in (2, 3)]
        others.append(threading.Thread(target=checkpoints, args=(folder,)))
        for t in threads + others:
            t.start()
        for t in threads:
            t.join(timeout=20)
        done.set()
        for t in others:
            t.join(timeout=5)
        assert not any(t.is_alive() for t in threads + others), "a client did not finish"
    assert not bad, f"{len(bad)} reads were not one version's tables: {bad[:5]}"
    final = torch.load(cfg.checkpoint_file(str(tmp_path), 0), weights_only=True)
    assert final["version"] == 1 + 2 * PUSHES
    assert not one_version(final["params"], final["version"], "final checkpoint")
    assert reads[0] == reads[1] == PUSHES and reads[2] and reads[3] and reads["checkpoints"], reads
