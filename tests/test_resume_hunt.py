"""Resuming a job from its shard checkpoints: files in the checkpoint folder that are not
this job's shard checkpoints (a model.pt copied in, a learned model changed since) are
not resumed, in part or whole, and say why."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from psgd.config import Config, load
from psgd.launcher import LocalJob
from psgd.servers.shard_server import ShardServer
from psgd.shard import Shard
from psgd.sharding import model_layout
from tests.conftest import free_port_block

pytestmark = pytest.mark.unit


def a_models_state_dict(path) -> None:
    """What a user finds at hand to put there: a job's model.pt (the model's state_dict)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(nn.Linear(4, 2).state_dict(), path)


@pytest.mark.timeout(60)
def test_a_models_state_dict_in_the_checkpoint_folder_is_not_resumed(tmp_path, capsys):
    """A user's run into an interrupted job's --out whose checkpoints/shard-I.pt were a
    model.pt (a dict, as a checkpoint is): `psgd run` said "resuming the unfinished job
    ... its training goes on from them", then every shard died at its start with
    `KeyError: 'sizes'` and a traceback, was restarted five times, and the job failed
    ("server-0 keeps dying"). It is not resumed now, said so, and the job starts afresh;
    with the other shard's checkpoint whole, none is resumed (not a part of the model)."""
    port = free_port_block(3)
    cfg = load(None, [f"cluster.port={port}"], env={})
    folder = tmp_path / "checkpoints"
    for i in range(2):
        a_models_state_dict(str(folder / f"shard-{i}.pt"))
    LocalJob(cfg, str(tmp_path), quiet=True).stop()
    err = capsys.readouterr().err
    assert "resuming the unfinished" not in err, err
    assert (f"not resuming from the shard checkpoints in {folder} (shard-0.pt: it is not a psgd shard checkpoint"
            in err), err
    # each shard, as psgd run starts them (the launcher left them: this job's replace them)
    server = ShardServer(cfg, 0, str(tmp_path))
    fresh = Shard(cfg, 0)
    assert not server._resume(fresh, str(folder / "shard-0.pt"), whole_set=True) and fresh.version == 0
    assert "it is not a psgd shard checkpoint" in capsys.readouterr().err
    assert not server.afresh   # (psgd run said it: not again from the coordinator)
    assert not server._resume(fresh, str(folder / "shard-0.pt")) and fresh.version == 0   # restarted during a job
    # one shard's whole, the other's a model's state_dict: neither resumed, both moved aside
    Shard(cfg, 0).save(str(folder / "shard-0.pt"))
    LocalJob(cfg, str(tmp_path), quiet=True).stop()
    err = capsys.readouterr().err
    assert "only 1 of the 2 shard checkpoints" in err and "shard-1.pt: it is not a psgd shard checkpoint" in err, err
    assert not (folder / "shard-0.pt").exists() and (folder / "shard-0.pt.earlier").exists()


class Net(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.a = nn.Linear(40, 25)      # 1,000 weights: shard 0's alone (each tensor one piece)
        self.b = nn.Linear(25, width)   # the rest on shard 1


@pytest.mark.timeout(60)
def test_a_learned_model_changed_since_its_checkpoints_is_not_resumed_in_part(tmp_path, capsys):
    """A factory's model (`model.name = "pkg.mod:factory"`, whose code the shards never
    import) changed between the interrupted job and the next run into its --out: the
    training config is the same, so each shard took the set as resumable; a shard whose
    tables kept their size resumed its trained values, one whose tables changed started
    from the initial ones: one model of two versions (seen: both refused, each on its own,
    with `psgd run` saying it resumed them). At a job's start a shard now checks the
    other shards' checkpoints against the sizes the new layout gives them."""
    cfg = Config().replace(**{"cluster.servers": 2, "cluster.workers": 1, "model.name": "facmod:model"})
    folder = tmp_path / "checkpoints"
    before, after = model_layout(Net(10)), model_layout(Net(12))
    for i in range(2):
        earlier = Shard(cfg, i, before)
        earlier.version = 7
        earlier.save(str(folder / f"shard-{i}.pt"))
    sizes = [[Shard(cfg, i, lay).P for i in range(2)] for lay in (before, after)]
    changed = [i for i in range(2) if sizes[0][i] != sizes[1][i]]
    kept = [i for i in range(2) if sizes[0][i] == sizes[1][i]]
    assert changed and kept, sizes   # (the case: one shard's tables changed, the other's did not)
    server = ShardServer(cfg, kept[0], str(tmp_path))
    fresh = Shard(cfg, kept[0], after)
    assert not server._resume(fresh, str(folder / f"shard-{kept[0]}.pt"), whole_set=True)
    assert fresh.version == 0
    assert "it is of a model of another layout" in capsys.readouterr().err   # (its own: the map's digest)
    assert "of another layout" in server.afresh   # (the coordinator says it: psgd run could not check it)
    server = ShardServer(cfg, changed[0], str(tmp_path))
    fresh = Shard(cfg, changed[0], after)
    assert not server._resume(fresh, str(folder / f"shard-{changed[0]}.pt"), whole_set=True)
    assert "it is of a model of another layout" in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name,said", [("facmod:model", "facmod:model"), ("script", "the script's model")])
def test_psgd_run_says_a_learned_models_resume_depends_on_its_layout(tmp_path, capsys, name, said):
    """`psgd run` said "resuming the unfinished job ...: its training goes on from them" of
    a factory's model whose code had changed since, where each shard then started afresh
    (its log said why): the launcher never sees the layout, so it says that it depends."""
    cfg = Config().replace(**{"cluster.servers": 2, "cluster.workers": 1, "model.name": name,
                              "cluster.port": free_port_block(3)})
    for i in range(2):
        Shard(cfg, i, model_layout(Net(10))).save(str(tmp_path / "checkpoints" / f"shard-{i}.pt"))
    LocalJob(cfg, str(tmp_path), quiet=True).stop()
    err = capsys.readouterr().err
    assert f"its training goes on from them, if {said}'s layout is the same (each shard checks it" in err, err


class Renamed(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.first = nn.Linear(40, 25)   # Net's `a`, renamed: the same sizes
        self.b = nn.Linear(25, width)


@pytest.mark.timeout(60)
def test_a_learned_model_renamed_since_its_checkpoints_with_the_same_sizes_is_not_resumed(tmp_path, capsys):
    """A layer renamed in a factory's model since an interrupted job's checkpoints keeps
    every shard's table sizes: the checkpoints were resumed, their values read into
    whichever tensors now hold those places. A checkpoint now carries its map's digest."""
    cfg = Config().replace(**{"cluster.servers": 2, "cluster.workers": 1, "model.name": "facmod:model"})
    folder = tmp_path / "checkpoints"
    before, after = model_layout(Net(10)), model_layout(Renamed(10))
    for i in range(2):
        Shard(cfg, i, before).save(str(folder / f"shard-{i}.pt"))
    assert [Shard(cfg, i, before).P for i in range(2)] == [Shard(cfg, i, after).P for i in range(2)]
    fresh = Shard(cfg, 0, after)
    assert not ShardServer(cfg, 0, str(tmp_path))._resume(fresh, str(folder / "shard-0.pt"), whole_set=True)
    assert "names or sizes are not this job's model's" in capsys.readouterr().err
    same = Shard(cfg, 0, before)   # the unchanged model resumes them
    assert ShardServer(cfg, 0, str(tmp_path))._resume(same, str(folder / "shard-0.pt"), whole_set=True)
    other = cfg.replace(**{"optimizer.lr": cfg.optimizer.lr / 2})   # another training config: psgd run said why
    server = ShardServer(other, 0, str(tmp_path))
    assert not server._resume(Shard(other, 0, before), str(folder / "shard-0.pt"), whole_set=True)
    assert "optimizer.lr" in capsys.readouterr().err and not server.afresh
