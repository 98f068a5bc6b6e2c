"""A training script's mistakes with `psgd.connect` (psgd/connection.py) that psgd saw
nothing of: each is now a clear error naming what to do, not a run that trains wrong.

- a loop that still calls `optimizer.step()` itself in a mode where `ps.step()` steps the
  script's optimizer (easgd, diloco, ltfb) stepped each batch twice;
- an output folder (out= or PSGD_OUT) that is a file, or cannot be made: an OutputError from
  inside psgd after registering; now a ConfigError naming it before anything is sent;
- a script started by hand without PSGD_CONFIG (or config=) joins psgd's default job's
  address: its "no answer from tcp://127.0.0.1:5555" now says that no config was given;
- `ps.report(accuracy=95.0, ...)`, a percentage: the coordinator's "accuracy 95.0 is not in
  [0, 1]" now says "a percentage? divide it by 100", as an ltfb score function's does.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import psgd
from psgd.config import Config
from psgd.inprocess import InProcessCluster

pytestmark = pytest.mark.inprocess


def config(port_block, mode: str, **sets) -> Config:
    return Config().replace(**{"cluster.port": port_block(3), "cluster.workers": 1, "cluster.servers": 1,
                               "model.name": "script", "cluster.evaluator": False, "mode.name": mode,
                               "train.steps": 6, "cluster.timeout_s": 20, "mode.tau": 2, "mode.local_steps": 3,
                               "mode.round_steps": 3, **sets})


def loop(ps, model: nn.Module, opt: torch.optim.Optimizer, steps_itself: bool) -> int:
    """The script's loop; how many batches it stepped."""
    g = torch.Generator().manual_seed(0)
    n = 0
    while True:
        opt.zero_grad()
        model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
        if steps_itself:
            opt.step()   # kept from the script's own loop
        n += 1
        if not ps.step():
            return n


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["easgd", "diloco", "ltfb"])
def test_a_loop_that_steps_the_optimizer_psgd_steps_is_a_job_error_at_once(port_block, mode):
    """Was: Adam's step count 2 per batch (20 after 10 batches), silently."""
    cfg = config(port_block, mode)
    with InProcessCluster(cfg) as cluster:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        ps = psgd.connect(model, opt, config=cfg, rank=0, score=lambda m: 0.5)
        with pytest.raises(psgd.JobError, match=r"the script called optimizer.step\(\) itself.*stepped twice; "
                                                r"remove optimizer.step\(\)"):
            loop(ps, model, opt, steps_itself=True)
        assert ps.closed and opt.state[model.weight]["step"].item() == 1   # the script's one step: psgd took none
        assert "called optimizer.step() itself" in cluster.coordinator.abort   # the job ended with it
        opt.step()   # after the job, the script's optimizer is its own again


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["out", "PSGD_OUT"])
def test_an_output_folder_that_cannot_be_written_is_a_config_error_before_registering(port_block, tmp_path,
                                                                                     monkeypatch, how):
    (tmp_path / "a-file").write_text("")
    out = str(tmp_path / "a-file")
    if how == "PSGD_OUT":
        monkeypatch.setenv("PSGD_OUT", out)
    cfg = config(port_block, "async", **{"cluster.timeout_s": 3})   # no coordinator: nothing is sent
    with pytest.raises(psgd.ConfigError, match=rf"{'out=' if how == 'out' else 'PSGD_OUT'} '{out}' is not a "
                                               rf"folder .*Not a directory.*give the job's output folder"):
        psgd.connect(nn.Linear(4, 2), config=cfg, rank=0, out=out if how == "out" else None)


@pytest.mark.timeout(60)
def test_an_output_folder_not_there_yet_is_made(port_block, tmp_path):
    cfg = config(port_block, "async")
    with InProcessCluster(cfg):
        model = nn.Linear(4, 2)
        out = tmp_path / "new" / "job"
        with psgd.connect(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg, rank=0, out=out) as ps:
            loop(ps, model, torch.optim.SGD(model.parameters(), lr=0.1), steps_itself=False)
    assert os.path.isfile(out / "model.pt")


@pytest.mark.timeout(60)
def test_an_existing_output_folder_without_write_access_is_a_config_error(port_block, tmp_path, monkeypatch):
    """A review: an events/ folder there already but read-only passed (makedirs says nothing
    of a folder that exists), and the OutputError came after registering. (The tests run as
    root, whom no permission stops: os.access stands in for a read-only folder.)"""
    from psgd import connection
    events = str(tmp_path / "job" / "events")
    os.makedirs(events)
    real = os.access
    monkeypatch.setattr(connection.os, "access", lambda p, mode: p != events and real(p, mode))
    cfg = config(port_block, "async", **{"cluster.timeout_s": 3})
    with pytest.raises(psgd.ConfigError, match=r"out= '.*job' is not a folder this worker can write its step log in "
                                               r"\(Permission denied: .*events\)"):
        psgd.connect(nn.Linear(4, 2), config=cfg, rank=0, out=str(tmp_path / "job"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("given", [False, True])
def test_a_connect_with_no_config_that_finds_no_coordinator_says_no_config_was_given(port_block, tmp_path,
                                                                                    monkeypatch, given):
    monkeypatch.delenv("PSGD_CONFIG", raising=False)
    monkeypatch.setenv("PSGD_CLUSTER_TIMEOUT_S", "1")
    monkeypatch.setenv("PSGD_CLUSTER_PORT", str(port_block(3)))   # (nobody there)
    monkeypatch.setenv("PSGD_MODEL_NAME", "script")
    if given:   # a config file given: its address is the user's to check, no word about a missing config
        (tmp_path / "job.toml").write_text("")
        monkeypatch.setenv("PSGD_CONFIG", str(tmp_path / "job.toml"))
    with pytest.raises(psgd.JobError, match="no answer from") as e:
        psgd.connect(nn.Linear(4, 2), rank=0)
    said = "no config was given (psgd.connect(config=...), $PSGD_CONFIG)"
    assert (said in str(e.value)) == (not given), str(e.value)
    assert given or "set PSGD_CONFIG to the job's config file" in str(e.value)
    # (its port came from PSGD_CLUSTER_PORT: the address is not psgd's default, and not said to be)
    assert given or "so this address is from psgd's defaults and the PSGD_CLUSTER_* variables" in str(e.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("accuracy, said", [(95.0, r"accuracy 95 is not a fraction in \[0, 1\] \(a percentage\? "
                                                    r"divide it by 100\)"),
                                            (-0.5, r"accuracy -0.5 is not a fraction in \[0, 1\]$"),
                                            (float("nan"), r"accuracy nan is not a fraction in \[0, 1\]$")],
                         ids=["percentage", "negative", "nan"])
def test_a_report_of_an_accuracy_that_is_not_a_fraction_says_so_and_the_job_goes_on(port_block, accuracy, said):
    cfg = config(port_block, "async")
    with InProcessCluster(cfg) as cluster:
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with psgd.connect(model, config=cfg, rank=0) as ps:
            loop(ps, model, opt, steps_itself=False)
            with pytest.raises(psgd.JobError, match=r"report\(\): the score was not recorded: " + said):
                ps.report(accuracy=accuracy, loss=1.0)
            ps.report(accuracy=0.95, loss=1.0)
        assert [e["accuracy"] for e in cluster.coordinator.evals] == [0.95]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sync", "async", "easgd"])
def test_a_second_step_on_the_same_gradients_is_a_job_error(port_block, mode):
    """A review: `ps.step()` twice after one backward pushed the same gradients twice and
    counted the batch twice (1,920 samples for 960 computed), without a word. A step
    after an accumulating backward, or one into gradients set to None, goes on."""
    cfg = config(port_block, mode, **{"train.steps": 10})
    with InProcessCluster(cfg) as cluster:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        ps = psgd.connect(model, config=cfg, rank=0, score=lambda m: 0.5)
        model(torch.randn(8, 4)).pow(2).mean().backward()
        assert ps.step()
        model(torch.randn(8, 4)).pow(2).mean().backward()   # accumulated into the same .grad: a new step
        assert ps.step()
        model.zero_grad(set_to_none=True)
        model(torch.randn(8, 4)).pow(2).mean().backward()   # new .grad tensors
        assert ps.step()
        with pytest.raises(psgd.JobError, match=r"step\(\) again on the gradients of the step before"):
            ps.step()
        assert ps.closed and "worker 0: step() again on the gradients" in cluster.coordinator.abort


@pytest.mark.timeout(60)
def test_an_honest_loop_that_sets_its_gradients_to_none_is_never_taken_for_a_second_step(port_block):
    """A review: torch's zero_grad() sets `.grad` to None, and the next backward's new
    tensor may get the freed one's id() (a review's loop of this one-tensor model was
    refused at its 22nd step where its allocations were a little different): a check by
    id() refused honest steps. The last step's gradients are held by weak reference
    (`test_the_gradients_a_step_took_are_told_from_new_ones_by_identity_not_id`)."""
    cfg = config(port_block, "sync", **{"train.steps": 300})
    with InProcessCluster(cfg):
        torch.manual_seed(0)
        model = nn.Linear(4, 2, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)   # (sync steps on the shards: it only zeroes here)
        ps = psgd.connect(model, opt, config=cfg, rank=0)
        steps = 0
        while True:
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            steps += 1
            if not ps.step():
                break
        ps.close()
    assert steps == 300


@pytest.mark.timeout(30)
def test_the_gradients_a_step_took_are_told_from_new_ones_by_identity_not_id():
    """`Connection._same_gradients`: the same tensors unchanged are a second step's; a
    tensor replaced (whatever its id and version), changed in place, set to None, or one
    freed whose id a new tensor has, is not."""
    from types import SimpleNamespace

    from psgd.connection import Connection
    w, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))
    fake = SimpleNamespace(replica=SimpleNamespace(trainable={"w": w, "b": b}))
    w.grad, b.grad = torch.ones(3), torch.ones(2)
    taken = Connection._gradients(fake)
    assert Connection._same_gradients(fake, taken)
    w.grad.add_(1.0)   # a backward that accumulates
    assert not Connection._same_gradients(fake, taken)
    taken = Connection._gradients(fake)
    w.grad = None   # zero_grad(): the tensor is freed (its id free for the next one's), and the step's hold on
    assert taken[0][0]() is None   # it is a weak reference, now dead: no new tensor can pass for it
    w.grad = torch.ones(3)   # a new tensor, version 0 as the freed one's
    assert not Connection._same_gradients(fake, taken)
    taken = Connection._gradients(fake)
    b.grad = None
    assert not Connection._same_gradients(fake, taken)
    taken = Connection._gradients(fake)
    assert Connection._same_gradients(fake, taken)
