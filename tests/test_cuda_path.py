"""The CUDA paths, reviewed by reading (no GPU here): each defect made observable on the CPU
(torch.cuda's answers stubbed where the CPU build has none), with the fix's test."""
from __future__ import annotations

import pytest
import torch

from psgd.config import ConfigError


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_cuda_with_a_cpu_only_torch_says_the_build_is_the_cause(tmp_path, capsys, monkeypatch):
    """A review: `psgd run --device cuda` (or PSGD_DEVICE=cuda) on a GPU machine whose torch
    is a CPU-only build (a plain `pip install torch` gives one on some platforms: this
    checkout's .venv has 2.13.0+cpu) said "CUDA is not available on this machine", and the
    user, whose nvidia-smi shows the GPU, looked for a driver problem. The error names the
    build; a CUDA build that sees no GPU is told apart."""
    from psgd.cli import main
    from psgd.replica import pick_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert main(["run", "--device", "cuda", "--out", str(tmp_path / "job")]) == 2
    err = capsys.readouterr().err
    assert f"--device cuda: CUDA is not available on this machine (torch {torch.__version__} is a CPU-only " \
           f"build: install a CUDA build of torch" in err, err
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    with pytest.raises(ConfigError, match=r"PSGD_DEVICE cuda:0: CUDA is not available on this machine \(torch "
                                          r".* \(CUDA 12\.4\) sees no GPU"):
        pick_device("cuda:0", name="PSGD_DEVICE")


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_script_model_spread_over_devices_is_refused_before_it_is_moved():
    """A review: psgd.connect(model) with a model split over devices (a model-parallel one
    on cuda:0 and cuda:1, or an embedding kept on the CPU beside layers on the GPU) was
    moved whole, without a word, to its first parameter's device (Replica's
    `model.to(device)`): the script's forward, which moves activations between its
    layers' devices, then failed inside torch ("Expected all tensors to be on the same
    device"), or cuda:0 ran out of memory. "meta" stands for the second device here: the
    CPU torch has no other. Refused in one line before registering, as a lazy layer is."""
    from torch import nn

    from psgd.connection import _model_problem
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2, device="meta"))
    problem = _model_problem(model)
    assert problem.startswith("the model's tensors are on 2 devices (0.weight on cpu, 2.weight on meta): psgd "
                              "keeps one copy of the model on one device"), problem
    assert _model_problem(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))) == ""
