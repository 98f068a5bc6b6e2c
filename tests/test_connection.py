"""`psgd.connect` (psgd/connection.py) against an in-process cluster: workers are threads
running a training loop of their own, the shards learn the model from them.

- the shards start from rank 0's initial values, whatever the other ranks built;
- sync: every rank ends with the same model, which is the shards' and DIR/model.pt's;
- the script's own optimizer keeps its learning rate in the local-optimizer modes;
- ltfb without `score` is a clear error; `step()` after `close()` is one too.
"""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import psgd
from psgd.config import Config, ConfigError
from psgd.inprocess import InProcessCluster

pytestmark = pytest.mark.inprocess


class Net(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def config(port_block, mode: str, workers: int = 2, **sets) -> Config:
    return Config().replace(**{"cluster.port": port_block(3), "cluster.workers": workers, "cluster.servers": 2,
                               "model.name": "script", "cluster.evaluator": False, "mode.name": mode,
                               "train.steps": 20, "cluster.timeout_s": 20, **sets})


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def run_workers(cfg: Config, out: str | None, loop, optimizer=None) -> dict:
    """One thread per rank: connect a Net built from seed 100 + rank, run `loop`."""
    got: dict = {"errors": []}
    models = [Net(100 + rank) for rank in range(cfg.cluster.workers)]  # here: Net seeds torch's global RNG

    def worker(rank: int) -> None:
        try:
            model = models[rank]
            opt = optimizer(model) if optimizer else None
            ps = psgd.connect(model, opt, config=cfg, out=out, rank=rank)
            got[("start", rank)] = flat(model)
            loop(ps, model, opt)
            ps.close()
            got[("end", rank)] = flat(model)
            got[("opt", rank)] = opt
        except Exception as e:  # noqa: BLE001 - reported by the test
            got["errors"].append(e)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(cfg.cluster.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return got


def train(ps, model, opt) -> None:
    g = torch.Generator().manual_seed(ps.rank)
    while True:
        if opt is not None:
            opt.zero_grad()
        else:
            model.zero_grad()
        x = torch.randn(16, 6, generator=g)
        loss = nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
        loss.backward()
        if not ps.step(loss, samples=16):
            break


@pytest.mark.timeout(120)
def test_sync_workers_start_from_rank_0_and_end_with_the_saved_global_model(port_block, tmp_path):
    cfg = config(port_block, "sync")
    with InProcessCluster(cfg, str(tmp_path)):
        got = run_workers(cfg, str(tmp_path), train)
    assert not got["errors"], got["errors"]
    assert torch.equal(got[("start", 1)], got[("start", 0)])          # rank 1 took rank 0's values
    assert torch.equal(got[("start", 0)], flat(Net(100)))
    assert torch.equal(got[("end", 0)], got[("end", 1)])              # sync: one model
    assert not torch.equal(got[("end", 0)], got[("start", 0)])
    saved = Net(0)
    saved.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    assert torch.equal(flat(saved), got[("end", 0)])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["easgd", "diloco"])
def test_the_scripts_own_optimizer_keeps_its_learning_rate(port_block, mode):
    cfg = config(port_block, mode, **{"mode.tau": 4, "mode.local_steps": 5})
    with InProcessCluster(cfg):
        got = run_workers(cfg, None, train, lambda m: torch.optim.Adam(m.parameters(), lr=3e-3))
    assert not got["errors"], got["errors"]
    for rank in range(2):
        opt = got[("opt", rank)]
        assert opt.param_groups[0]["lr"] == 3e-3 and opt.state, "psgd's lr schedule touched the script's optimizer"


@pytest.mark.timeout(60)
def test_ltfb_without_a_score_and_a_step_after_close_are_clear_errors(port_block):
    cfg = config(port_block, "ltfb", workers=1)
    with InProcessCluster(cfg):
        with pytest.raises(ConfigError, match="score=fn"):
            psgd.connect(Net(0), config=cfg, rank=0)
    cfg = config(port_block, "async", workers=1)
    with InProcessCluster(cfg):
        ps = psgd.connect(Net(0), config=cfg, rank=0)
        ps.close()
        with pytest.raises(psgd.JobError, match="after close"):
            ps.step()


@pytest.mark.timeout(60)
def test_close_leaves_the_job_even_when_the_coordinator_is_gone_at_the_release(port_block, tmp_path):
    # rank 0 holds the job's end to save the final model, then releases it; a coordinator
    # that does not answer the release must not keep the worker's pid file and sockets
    from psgd.transport import PeerTimeout
    cfg = config(port_block, "async", workers=1, **{"train.steps": 3})
    with InProcessCluster(cfg, str(tmp_path)):
        ps = psgd.connect(Net(0), config=cfg, out=str(tmp_path), rank=0)
        call = ps.link.call

        def no_release(op, **kw):
            if op == "release":
                raise PeerTimeout(ps.link.address, 1.0, "the coordinator is gone")
            return call(op, **kw)
        ps.link.call = no_release
        train(ps, ps.replica.model, None)
        with pytest.raises(PeerTimeout):
            ps.close()
        assert ps.closed and not (tmp_path / "pids" / "worker-0.pid").exists()
