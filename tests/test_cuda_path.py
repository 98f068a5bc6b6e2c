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


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_gpu_sh_keeps_a_throughput_json_that_a_warning_follows(tmp_path):
    """A review: gpu.sh's results.json took each throughput step's figures from the last
    line of its log (stdout and stderr together); a line printed after bench.throughput's
    JSON (a warning at exit: torch's, NCCL's, multiprocessing's leaked semaphores) lost the
    figures of the one GPU run. Its results script, run here as gpu.sh runs it."""
    import json
    import os
    import re
    import subprocess
    import sys
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "gpu.sh")).read()
    script = re.search(r'"\$OUT/results.json" "\$WORK" "\$\{failed\[@\]\}" <<\'EOF\'\n(.*?)\nEOF\n', text, re.S)
    assert script, "gpu.sh's results script moved: update this test"
    logs = tmp_path / "logs"
    logs.mkdir()
    figures = {"bench": "throughput", "ratio_vs_ddp_small": 0.5}
    (logs / "throughput-ddp.log").write_text("progress: psgd sync\n" + json.dumps(figures) + "\n"
                                             "/usr/lib/python3.12/multiprocessing/resource_tracker.py:254: "
                                             "UserWarning: resource_tracker: There appear to be 1 leaked semaphore "
                                             "objects to clean up at shutdown\n  warnings.warn('resource_tracker: '\n")
    (logs / "throughput-local.log").write_text("no JSON: the step failed\n")
    out = tmp_path / "results.json"
    subprocess.run([sys.executable, "-", str(out), str(tmp_path)], input=script.group(1), text=True, check=True,
                   timeout=30)
    results = json.loads(out.read_text())
    assert results["throughput-ddp"] == figures and results["throughput-local"] is None, results


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_device_cuda_without_an_index_is_the_ranks_gpu_as_auto_picks_it(monkeypatch):
    """Found on the device tool's H200: `psgd.device()` under `psgd run --device cuda` was
    `cuda` with no index, so a script's check that its model lay on psgd.device() failed
    (its parameters were on cuda:0), and every worker of `--device cuda` on a machine of
    several GPUs took cuda:0. `cuda` is now the GPU LOCAL_RANK % GPUs, as auto picks it."""
    from psgd.replica import pick_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [pick_device("cuda", r) for r in (0, 1, 5)] == [torch.device("cuda", i) for i in (0, 1, 1)]
    assert pick_device("cuda:3", 1) == torch.device("cuda", 3)   # an index given is kept
    assert pick_device("auto", 2) == torch.device("cuda", 2)
