"""The CUDA path, checked without a GPU: bench/gpu.sh runs with PY pointing at a stand-in
(that runs the real psgd commands on the CPU, or the real step-1 scripts with CUDA faked),
and the replica's CUDA-only branch runs with torch.cuda's calls stubbed.

- gpu.sh fits the device tool (/work/.library/device/README.md, "Limits"): one command of
  at most 600 s, and from $OUT at most 8 files, none more than 2 folders down;
- it installs the wheels carried in .whl/ (the H200 image has no pyzmq and no package
  index) before it imports psgd, and names a missing dependency as such (exit 3), not as a
  missing GPU (exit 2);
- a replica on cuda:N waits for the copies to its host buffers on cuda:N's stream;
- a straggler's `faults.slow_factor` scales its step's GPU time, which is paid when the
  loss is read (emulated: forward and backward return at once, `.item()` pays), in a
  worker and in the sequential baseline alike.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
import types
import zipfile

import pytest
import torch
from torch import nn

from tests.conftest import free_port_block

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_SH = os.path.join(REPO, "bench", "gpu.sh")

# What the device tool brings back from $OUT: at most 8 files, no more than 2 folders
# down, 64 MiB together; one command at most 600 s.
MAX_FILES, MAX_DEPTH, MAX_BYTES, MAX_COMMAND_S = 8, 2, 64 << 20, 600

# A stand-in for PY: the GPU check passes, the `psgd run --device cuda` steps run the real
# psgd on the CPU (few steps, the port given for the run's folder in FAKE_PORTS), the
# pinned-memory step writes its JSON, gpu.sh's own script writes results.json, and
# bench.throughput leaves in --keep what it leaves there: a `psgd run` folder per variant
# (one a call here; two and three with gpu.sh's --parts). With FAKE_DDP_HANGS set,
# bench.throughput --parts ddp hangs.
FAKE_PY = r'''#!{python}
import json, os, subprocess, sys
REAL = {python!r}
PORTS = json.loads(os.environ["FAKE_PORTS"])
args = sys.argv[1:]
if args[:1] == ["-"]:
    src = sys.stdin.read()
    if "is_available" in src:
        print("fake: torch sees one GPU")
        sys.exit(0)
    if "last_json_line" in src:   # what comes back: the real script
        sys.argv = args
        exec(compile(src, "<stdin>", "exec"), {{"__name__": "__main__"}})
        sys.exit(0)
    if len(args) > 1 and args[1].endswith(".json"):
        open(args[1], "w").write("{{}}")
    sys.exit(0)
if args[:2] == ["-m", "psgd"]:
    out = []
    for a in args:
        a = {{"cuda": "cpu", "model.name=resnet20": "model.name=mlp"}}.get(a, a)
        out.append("train.steps=3" if a.startswith("train.steps=") else a)
    port = PORTS[os.path.basename(args[args.index("--out") + 1])]
    os.execv(REAL, [REAL] + out + ["--set", f"cluster.port={{port}}"])
if args[:2] == ["-m", "bench.throughput"]:
    keep, parts = args[args.index("--keep") + 1], args[args.index("--parts") + 1]
    name = {{"ddp": "vs_ddp_small", "overlap": "overlap"}}.get(parts, "vs_local")
    if name == "vs_ddp_small" and os.environ.get("FAKE_DDP_HANGS"):
        import time
        time.sleep(600)
    subprocess.run([REAL, "-m", "psgd", "run", "--device", "cpu", "--quiet", "--out", os.path.join(keep, name),
                    "--set", "train.steps=3", "--set", "cluster.workers=1", "--set", "cluster.servers=1",
                    "--set", "cluster.evaluator=false", "--set", f"cluster.port={{PORTS[name]}}"], check=True)
    print(json.dumps({{"bench": "throughput", "parts": parts}}))
    sys.exit(0)
sys.exit("fake PY: not a call gpu.sh makes: " + repr(args))
'''

# A stand-in for PY as the lent H200 image has it (a CUDA torch, msgpack, numpy,
# scikit-learn, but no pyzmq): the real step-1 scripts, CUDA faked.
NO_ZMQ_PY = r'''#!{python}
import sys
import torch
torch.cuda.is_available = lambda: True
torch.cuda.get_device_name = lambda i=0: "NVIDIA H200 (fake)"
torch.cuda.device_count = lambda: 1
real_ones = torch.ones
torch.ones = lambda *a, device=None, **k: real_ones(*a, **k)   # (computes, on the CPU)
sys.modules["zmq"] = None   # not installed
if sys.argv[1:2] != ["-"]:
    sys.exit("only step 1 expected")
src = sys.stdin.read()
sys.argv = sys.argv[1:]
exec(compile(src, "<stdin>", "exec"), {{"__name__": "__main__"}})
'''

# A stand-in for PY on a machine with a GPU, pip and no index: pip is the real one; the GPU
# check passes; the import check says where the carried wheel's module came from, and ends
# the script there.
WHEELS_PY = r'''#!{python}
import os, sys
REAL = {python!r}
if sys.argv[1:3] == ["-m", "pip"]:
    os.execv(REAL, [REAL] + sys.argv[1:])
if "is_available" in sys.stdin.read():
    sys.exit(0)
import carried
print("carried", carried.__version__, "from", carried.__file__)
sys.exit("the test ends here")
'''


def _script(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _wheel(folder, name: str, version: str) -> None:
    """A pure-Python wheel of one module, `name`, with its `__version__`."""
    files = {f"{name}/__init__.py": f"__version__ = {version!r}\n",
             f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{name}-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                                                  "Tag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text)}" for path, text in files.items()]
    files[f"{name}-{version}.dist-info/RECORD"] = "\n".join([*record, f"{name}-{version}.dist-info/RECORD,,"]) + "\n"
    os.makedirs(folder, exist_ok=True)
    with zipfile.ZipFile(os.path.join(folder, f"{name}-{version}-py3-none-any.whl"), "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


def _gpu_sh(tmp_path, py: str, script: str = GPU_SH, timeout_s: float = 280, **env) -> subprocess.CompletedProcess:
    """gpu.sh with a stand-in PY; the checkout's own .whl/ (prepared for the device) is
    not installed unless GPU_WHEELS says so."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PY": py, "GPU_WHEELS": str(tmp_path / "no-wheels"), **env}
    env.pop("PYTHONPATH", None)
    return subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_gpu_sh_leaves_in_OUT_no_more_files_than_the_device_tool_brings_back(tmp_path):
    """A review: gpu.sh, meant for the device tool, which returns from $OUT at most 8 files
    none more than 2 folders down, put whole `psgd run` folders (23 files each: logs,
    events, checkpoints, model.pt, ...) and bench.throughput's --keep folders under $OUT,
    about 66 files: the summaries it was run for could be among those left behind."""
    ports = {name: free_port_block(3) for name in ("run-mlp", "run-resnet20", "vs_ddp_small", "vs_local", "overlap")}
    r = _gpu_sh(tmp_path, _script(tmp_path, "fakepy", FAKE_PY), FAKE_PORTS=json.dumps(ports))
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "out"
    files, deep, size = [], [], 0
    for root, _, names in os.walk(out):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), out)
            files.append(rel)
            size += os.path.getsize(os.path.join(root, n))
            if rel.count(os.sep) > MAX_DEPTH:
                deep.append(rel)
    assert len(files) <= MAX_FILES and not deep and size <= MAX_BYTES, (
        f"{len(files)} files under $OUT ({size:,} bytes; {len(deep)} more than {MAX_DEPTH} folders down), "
        f"of which the device tool returns {MAX_FILES}: {sorted(files)[:40]}")
    runs = subprocess.run(["tar", "-tzf", str(out / "runs.tar.gz")], capture_output=True, text=True).stdout.split()
    assert {"runs/run-mlp/summary.json", "runs/run-resnet20/summary.json",
            "runs/throughput-runs/vs_ddp_small/summary.json", "runs/throughput-runs/vs_local/summary.json"} <= set(runs)
    log = (out / "steps.log").read_text()
    assert "== throughput-ddp: exit 0" in log and "== throughput-local: exit 0" in log
    assert "== throughput-overlap: exit 0" in log


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_gpu_sh_still_compares_with_the_plain_loop_when_ddp_hangs(tmp_path):
    """A review: gpu.sh ran bench.throughput's DDP (NCCL) and plain-loop comparisons as one
    step of 200 s; DDP with NCCL hanging (its init, in a VM never tried) used the step's
    time and the plain-loop figures were never measured: results.json had no throughput
    at all. Here the DDP step's timeout is cut to 3 s and the stand-in's DDP hangs."""
    repo = tmp_path / "repo"
    for part in ("bench", "psgd", "servers", "workers"):
        shutil.copytree(os.path.join(REPO, part), repo / part, ignore=shutil.ignore_patterns("__pycache__"))
    script = repo / "bench" / "gpu.sh"
    text, n = re.subn(r"^step throughput-ddp \d+ ", "step throughput-ddp 3 ", script.read_text(), flags=re.M)
    assert n == 1
    script.write_text(text)
    ports = {name: free_port_block(3) for name in ("run-mlp", "run-resnet20", "vs_ddp_small", "vs_local", "overlap")}
    t = time.monotonic()
    r = _gpu_sh(tmp_path, _script(tmp_path, "fakepy", FAKE_PY), script=str(script), FAKE_PORTS=json.dumps(ports),
                FAKE_DDP_HANGS="1")
    assert r.returncode == 1 and "throughput-ddp" in r.stderr.splitlines()[-1], (r.returncode, r.stderr[-2000:])
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["failed"] == ["throughput-ddp"] and results["throughput-ddp"] is None, results
    assert results["throughput-local"] == {"bench": "throughput", "parts": "local,async"}, results
    assert time.monotonic() - t < 200


# A stand-in for PY that runs every command gpu.sh runs as gpu.sh gives it, on the CPU:
# `cuda` -> `cpu` and `nccl` -> `gloo` in the arguments, a tenth of the runs' steps and a
# quarter of the benchmark's; in the scripts it feeds on stdin, torch.cuda's look faked
# (step 1) and the pinned-memory step's CUDA-only calls made the CPU's (pinning, the
# device, synchronize); gpu.sh's results.json script as it is.
ON_THE_CPU_PY = r'''#!{python}
import json, os, sys
REAL = {python!r}
PORTS = json.loads(os.environ["FAKE_PORTS"])
args = sys.argv[1:]
if args[:2] == ["-m", "psgd"]:
    out = [{{"cuda": "cpu"}}.get(a, a) for a in args]
    out = [f"train.steps={{int(a.split('=')[1]) // 10}}" if a.startswith("train.steps=") else a for a in out]
    port = PORTS[os.path.basename(args[args.index("--out") + 1])]
    os.execv(REAL, [REAL] + out + ["--set", f"cluster.port={{port}}"])
if args[:2] == ["-m", "bench.throughput"]:
    os.execv(REAL, [REAL] + [{{"cuda": "cpu", "nccl": "gloo"}}.get(a, a) for a in args] + ["--steps-scale", "0.25"])
if args[:1] != ["-"]:
    sys.exit("stand-in PY: not a call gpu.sh makes: " + repr(args))
src = sys.stdin.read()
sys.argv = args
import torch
if "is_available" in src:
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_name = lambda i=0: "NVIDIA H200 (fake)"
    torch.cuda.device_count = lambda: 1
    real_ones = torch.ones
    torch.ones = lambda *a, device=None, **k: real_ones(*a, **k)
elif "pin_memory" in src:
    real_empty, real_device = torch.empty, torch.device
    torch.empty = lambda *a, pin_memory=False, **k: real_empty(*a, **k)
    torch.Tensor.is_pinned = lambda self: True
    torch.cuda.synchronize = lambda *a, **k: None

    class Device:   # torch.device("cuda", 0) -> the CPU
        def __new__(cls, *a):
            return real_device("cpu")
    torch.device = Device
exec(compile(src, "<stdin>", "exec"), {{"__name__": "__main__"}})
'''


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpu_sh_runs_its_own_commands_on_the_cpu(tmp_path):
    """gpu.sh had never run: its tests' stand-in ran other commands in the place of its
    `psgd run`s (an MLP for the ResNet-20), bench.throughput's and the pinned-memory
    script. Here every command is gpu.sh's own, on the CPU: a flag bench.throughput
    refuses, a config key psgd refuses or a name the pinned-memory script misuses
    (psgd.replica's, psgd.models') fails here, not on the device."""
    ports = {name: free_port_block(3) for name in ("run-mlp", "run-resnet20")}
    r = _gpu_sh(tmp_path, _script(tmp_path, "onthecpu", ON_THE_CPU_PY), FAKE_PORTS=json.dumps(ports))
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["failed"] == []
    assert results["run-mlp"]["model"] == "mlp" and results["run-resnet20"]["model"] == "resnet20", results
    assert results["pinned"]["replica_tables_pinned"] and results["pinned"]["replica_grads_match"], results["pinned"]
    ddp, local = results["throughput-ddp"], results["throughput-local"]
    assert {"ratio_vs_ddp_small", "ratio_vs_ddp_large"} <= set(ddp) and ddp["workers"] == 1, ddp
    assert {"ratio_vs_local", "ratio_async_vs_local", "ratio_async_noprefetch_vs_local"} <= set(local), local
    assert {"ratio_overlap_off", "ratio_overlap_on", "overlap_gain"} <= set(results["throughput-overlap"]), results


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_gpu_sh_names_a_missing_dependency_not_a_missing_gpu(tmp_path):
    """A review: on the lent H200 image python3 has a CUDA torch but no pyzmq; step 1
    failed in `import psgd, zmq`, and gpu.sh said "no usable GPU" and exited 2 (the code
    it documents for no GPU), with "(needs an NVIDIA GPU, its driver, and PY=... with a
    CUDA build of torch)": the GPU was there; what was missing was a wheel to carry."""
    r = _gpu_sh(tmp_path, _script(tmp_path, "nozmq", NO_ZMQ_PY))
    assert "pyzmq" in r.stderr and ".whl" in r.stderr, r.stderr[-2000:]
    assert "no usable GPU" not in r.stderr and r.returncode == 3, (r.returncode, r.stderr[-2000:])


# A stand-in for PY on a machine whose torch sees a GPU it cannot compute on: the real
# step-1 scripts, with torch.cuda's look faked (as torch would see it) and its computing
# real (a CPU torch's, which fails).
SEES_A_GPU_PY = r'''#!{python}
import sys
import torch
torch.cuda.is_available = lambda: True
torch.cuda.get_device_name = lambda i=0: "NVIDIA H200 (fake)"
torch.cuda.device_count = lambda: 1
if sys.argv[1:2] != ["-"]:
    sys.exit("only step 1 expected")
src = sys.stdin.read()
sys.argv = sys.argv[1:]
exec(compile(src, "<stdin>", "exec"), {{"__name__": "__main__"}})
'''


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_gpu_sh_names_a_gpu_torch_sees_and_cannot_use_as_no_usable_gpu(tmp_path):
    """A review: step 1 asked torch.cuda.is_available() only; a GPU it sees but cannot
    make a context or run a kernel on passed, and every step then failed on its own."""
    r = _gpu_sh(tmp_path, _script(tmp_path, "seesgpu", SEES_A_GPU_PY))
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "no usable GPU: torch sees NVIDIA H200 (fake) but cannot compute on it" in r.stderr, r.stderr[-2000:]


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_gpu_sh_says_a_PY_that_is_not_there(tmp_path):
    """A review: PY set to a path that is not there was taken as python3 without a word,
    and gpu.sh went on with that Python (here: said python3 cannot import torch)."""
    r = _gpu_sh(tmp_path, str(tmp_path / "no" / "python"))
    assert r.returncode == 3, (r.returncode, r.stderr[-2000:])
    assert r.stderr.splitlines()[0] == (f"bench/gpu.sh: PY={tmp_path / 'no' / 'python'}: no such command (set PY to "
                                        f"a Python with a CUDA build of torch)"), r.stderr[-2000:]


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_gpu_sh_does_not_wait_for_a_hung_nvidia_smi(tmp_path):
    """A review: step 1 ran nvidia-smi without a timeout: a driver that hangs it hung
    gpu.sh for the rest of the device command, and no step ran."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexec sleep 100\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    t = time.monotonic()
    r = _gpu_sh(tmp_path, _script(tmp_path, "seesgpu", SEES_A_GPU_PY), timeout_s=90,
                PATH=f"{bin_dir}:{os.environ['PATH']}")
    assert r.returncode == 2 and time.monotonic() - t < 60, (r.returncode, r.stderr[-2000:])


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_gpu_sh_installs_the_wheels_carried_in_whl_before_it_imports(tmp_path):
    """A review: the device tool's machine has no package index, so what its Python lacks
    (pyzmq) travels as wheels in .whl/; gpu.sh never installed them."""
    repo = tmp_path / "repo"
    os.makedirs(repo / "bench")
    shutil.copy(GPU_SH, repo / "bench" / "gpu.sh")
    _wheel(repo / ".whl", "carried", "9.1")
    r = _gpu_sh(tmp_path, _script(tmp_path, "wheelspy", WHEELS_PY), script=str(repo / "bench" / "gpu.sh"),
                GPU_WHEELS=".whl")
    gpu_txt = (tmp_path / "out" / "gpu.txt").read_text()
    assert r.returncode == 3 and "the test ends here" in r.stderr, (r.returncode, r.stderr[-2000:])
    assert "carried 9.1 from" in gpu_txt, gpu_txt[-2000:]


@pytest.mark.unit
def test_gpu_sh_ends_within_one_device_command():
    """A review: the device tool runs one command for at most 600 s; gpu.sh's own timeouts
    (step 1's 60 s and each step's, each with its 10 s --kill-after) added up to 670 s, so
    a slow run was cut before the last step (throughput) wrote its figures."""
    text = open(GPU_SH).read()
    steps = [int(s) for s in re.findall(r"^step \S+ (\d+) ", text, re.M)]
    kill_after = [int(s) for s in re.findall(r"--kill-after=(\d+)", text)]
    others = [int(s) for s in re.findall(r"\btimeout (\d+) ", text)]   # wheels, nvidia-smi, GPU, imports, results
    assert steps and others and len(kill_after) == 1, "gpu.sh's layout changed: update this test"
    worst = sum(steps) + sum(others) + len(steps) * kill_after[0]
    assert worst <= MAX_COMMAND_S - 60, f"gpu.sh may run {worst} s; one device command may run {MAX_COMMAND_S} s"


@pytest.mark.unit
def test_a_replica_on_another_gpu_waits_for_the_copies_of_its_own(monkeypatch):
    """A review: Replica._tables copies each table to its pinned host buffer with
    non_blocking=True on the stream of the table's device (the replica's, cuda:N), then
    waited with torch.cuda.current_stream().synchronize(): the stream of the *current*
    device, cuda:0 unless someone set it, and nothing in psgd does. A worker on cuda:1
    (`--device auto`, LOCAL_RANK=1, on a machine of two GPUs) then sent host buffers whose
    copies might not have landed. Here the CUDA calls are stubbed and the replica's device
    is set to cuda:1."""
    from psgd.replica import Replica
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    rep = Replica(model, 2, torch.device("cpu"))
    model(torch.randn(5, 4)).sum().backward()
    rep.grads()   # the buffers, made on the CPU; give each table a host buffer of its own, as on CUDA
    rep._bufs = {k: (dev, dev.clone()) for k, (dev, _) in rep._bufs.items()}
    rep.device = torch.device("cuda", 1)
    waited = []

    class Stream:
        def __init__(self, device):
            self.device = device

        def synchronize(self):
            waited.append(self.device)

    def current_stream(device=None):
        return Stream(torch.device("cuda", 0) if device is None else torch.device(device))

    def synchronize(device=None):
        waited.append(torch.device("cuda", 0) if device is None else torch.device(device))

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    rep.grads()
    assert torch.device("cuda", 1) in waited, f"waited for {waited}: not for the replica's device cuda:1"


GPU_S = 0.2   # the emulated GPU time of a training step's forward and backward


@pytest.fixture
def gpu_time_at_item(monkeypatch):
    """A training loss as on CUDA: forward and backward only queue their kernels, and the
    GPU's time (GPU_S) is paid when the loss's value is read (`.item()`). (An evaluation's
    loss, reduction="sum", reads at once.)"""
    real_item, real_ce = torch.Tensor.item, nn.functional.cross_entropy

    def item(self):
        if getattr(self, "_emulated_gpu", False):
            time.sleep(GPU_S)
        return real_item(self)

    def cross_entropy(*a, **k):
        out = real_ce(*a, **k)
        out._emulated_gpu = k.get("reduction", "mean") == "mean"
        return out
    monkeypatch.setattr(torch.Tensor, "item", item)
    monkeypatch.setattr(nn.functional, "cross_entropy", cross_entropy)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_slow_workers_slow_factor_counts_the_gpu_time_of_its_step(gpu_time_at_item):
    """A review: `faults.slow_factor = f` makes the slow rank "take f times as long to
    compute each step" (it sleeps (f - 1) x its measured forward/backward time), but
    Worker.compute measured that time before `loss.item()`: on CUDA, only the kernels'
    launches, and the straggler was barely slower."""
    from psgd.config import load
    from psgd.replica import Replica
    from psgd.workers.worker import Jitter, Worker
    factor = 3.0
    w = Worker.__new__(Worker)
    w.cfg = load(None, ["faults.slow_rank=0", f"faults.slow_factor={factor}"], env={})
    w.rank, w.clock, w.samples, w.device = 0, 0, 0, torch.device("cpu")
    w.jitter = Jitter(0.0, 0.0, 0, 0)
    w.replica = Replica(nn.Linear(4, 3), 1, torch.device("cpu"))
    w.batches = types.SimpleNamespace(next=lambda: (torch.randn(8, 4), torch.randint(0, 3, (8,))))
    w.compute()   # (the first backward of a process pays its own set-up)
    t0 = time.perf_counter()
    w.compute()
    took = time.perf_counter() - t0
    assert took >= 0.9 * factor * GPU_S, (f"a step of {GPU_S} s of GPU work took {took:.2f} s with slow_factor "
                                          f"{factor}: expected about {factor * GPU_S:.1f} s")


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_the_baselines_slow_factor_counts_the_gpu_time_of_its_step(gpu_time_at_item):
    """A review: the sequential baseline's straggler (`faults.slow_rank=0`) measured its
    step before `loss.item()`, as the worker did: on CUDA, only the kernels' launches."""
    from psgd.baseline import run_baseline
    from psgd.config import load
    factor, steps = 3.0, 2
    cfg = load(None, [f"train.steps={steps}", "faults.slow_rank=0", f"faults.slow_factor={factor}"], env={})
    s = run_baseline(cfg, device="cpu", steps=steps)
    assert s["wall_s"] >= 0.9 * factor * GPU_S * steps, (f"{steps} steps of {GPU_S} s of GPU work took "
                                                         f"{s['wall_s']:.2f} s with slow_factor {factor}")


@pytest.mark.unit
@pytest.mark.parametrize("device", ["hpu", "mps", "xpu", "meta"])
def test_a_device_psgd_does_not_train_on_is_one_error(tmp_path, capsys, device):
    """A review: `psgd run --device hpu` (a name torch.device takes, whose backend module
    this torch lacks) ended in a traceback from the device check (ModuleNotFoundError: No
    module named 'torch.hpu'). And a device torch can compute on that is neither cpu nor
    cuda (mps, xpu; meta here) passed the check: its tables stayed there, and the worker
    failed at its first send ("can't convert meta device type tensor to numpy")."""
    from psgd.cli import main
    assert main(["run", "--device", device, "--out", str(tmp_path / "job")]) == 2
    err = capsys.readouterr().err
    assert f"--device {device!r}: psgd trains on cpu or cuda (cuda or cuda:N), not on {device}" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.unit
@pytest.mark.parametrize("role", ["worker", "evaluator"])
def test_a_daemon_on_a_device_torch_cannot_use_says_so_before_it_joins(role, monkeypatch):
    """A review: `psgd worker --device D` started by hand or by Slurm (psgd run checks
    --device first; a worker node's PSGD_DEVICE is checked for its spelling only) loaded
    the data, registered with the coordinator and only then found that torch cannot use
    D (`cuda` on a node without a GPU, cuda:N past the last): the coordinator waited
    cluster.timeout_s for a worker that was gone. The evaluator registered first too.
    "meta" stands for such a device: torch takes its name, and psgd cannot train on it."""
    from psgd.config import ConfigError, load
    from psgd.workers import evaluator, worker

    class Registered(Exception):
        pass

    def registers(*a, **k):
        raise Registered(f"the {role} registered with the coordinator before checking its device")
    module = worker if role == "worker" else evaluator
    monkeypatch.setattr(module, "CoordinatorLink", registers)
    cfg = load(None, [], env={})
    daemon = worker.Worker(cfg, None, "meta") if role == "worker" else evaluator.Evaluator(cfg, None, "meta")
    with pytest.raises(ConfigError, match="--device 'meta': psgd trains on cpu or cuda"):
        daemon.run()


@pytest.mark.unit
def test_a_worker_on_another_gpu_makes_it_the_current_device(monkeypatch):
    """A review: torch's Adam and AdamW steps ask the current stream of the *current*
    device (torch.accelerator.current_stream(), for their graph-capture check: shown
    here with the accelerator stubbed); a worker on cuda:1 (`--device auto`, LOCAL_RANK=1)
    never set it, so each worker on a GPU other than 0 running a local Adam (easgd,
    diloco, ltfb) opened a CUDA context on cuda:0 too."""
    from psgd.workers import worker
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))
    asked = []
    monkeypatch.setattr(torch.accelerator, "current_stream",
                        lambda device=None: asked.append(device) or types.SimpleNamespace(is_capturing=lambda: False))
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    torch.optim.Adam([p]).step()
    assert asked == [None], asked   # the current device's stream: it must be the worker's

    class Attached(Exception):
        pass

    class Link:   # the coordinator's answer to the registration: rank 0 of the job
        def __init__(self, cfg, *a, **k):
            self.config = cfg.to_dict()

        def register(self, *a, **k):
            return {"assigned_rank": 0, "config": self.config}

        def take_job_config(self, answer):
            from psgd.config import Config
            return Config.from_dict(answer["config"])

    def replica(model, shards, device, flat=False, placement="balanced"):   # where the model goes to the device
        raise Attached
    current = []
    monkeypatch.setattr(worker, "check_device", lambda spec, rank=0: torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.append(torch.device(d)))
    monkeypatch.setattr(worker, "CoordinatorLink", Link)
    monkeypatch.setattr(worker, "Replica", replica)
    from psgd.config import load
    with pytest.raises(Attached):
        worker.Worker(load(None, [], env={}), None, "auto").run()
    assert current == [torch.device("cuda", 1)], f"the current CUDA device was set to {current}, not cuda:1"


@pytest.mark.unit
def test_a_script_whose_model_is_on_another_gpu_makes_it_the_current_device(monkeypatch):
    """A review: `psgd worker --device cuda:1` made cuda:1 the current device (above), but
    a script's `psgd.connect(model)` with its model on cuda:1 did not: a local Adam (its
    own or psgd's) then asked cuda:0's stream, and opened a context there. connect hands
    attach the model's device (`next(model.parameters()).device`), as _train hands it
    `--device`'s: called here as connect calls it, with the replica stubbed."""
    from psgd.config import load
    from psgd.connection import Connection
    from psgd.workers import worker

    class Attached(Exception):
        pass

    def replica(model, shards, device, flat=False, placement="balanced"):
        raise Attached
    current = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.append(torch.device(d)))
    monkeypatch.setattr(worker, "Replica", replica)
    conn = Connection.__new__(Connection)
    conn.cfg, conn.rank = load(None, [], env={}), 0
    with pytest.raises(Attached):
        conn.attach(nn.Linear(4, 3), torch.device("cuda", 1))
    assert current == [torch.device("cuda", 1)], f"the current CUDA device was set to {current}, not cuda:1"


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_gpu_modes_sh_runs_its_jobs_on_the_cpu(tmp_path):
    """bench/gpu_modes.sh (every mode's CUDA path and a script job on the GPU, first run on
    the device tool's H200) checked here on the CPU, two of its jobs: a mode with its own
    optimizer (ltfb) and a script whose model is on psgd.device() (diloco)."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "DEVICE": "cpu", "ONLY": "ltfb,script-diloco", "TMPDIR": str(tmp_path),
           "PY": sys.executable}
    r = subprocess.run(["bash", os.path.join(REPO, "bench", "gpu_modes.sh")], env=env, capture_output=True,
                       text=True, timeout=220)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log = (out / "log.txt").read_text()
    assert log.count("\nexit 0\n") == 2 and "failed: none" in log, log
    assert "== ltfb\n" in log and "== script-diloco\n" in log and "mode diloco" in log, log
    assert sorted(os.listdir(out)) == ["log.txt", "runs.tar.gz"]
