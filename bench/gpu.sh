#!/usr/bin/env bash
# The GPU checks, as one prepared script for a machine with one NVIDIA GPU (never run in CI;
# first run on the device tool's H200 on 2026-12-04: its results are in docs/performance.md).
#
#   bash bench/gpu.sh                      # from the repository root; results in ./out
#   OUT=/tmp/gpu PY=/opt/venv/bin/python bash bench/gpu.sh
#
# PY must be a Python with a CUDA build of torch and psgd's dependencies (pyzmq, msgpack,
# numpy, scikit-learn); the checkout is put on PYTHONPATH. Those missing there can travel as
# wheels in .whl/ at the repository root: when that folder exists, its wheels are installed
# into a scratch folder on PYTHONPATH first. On the device tool's H200 (Python 3.12, a CUDA
# torch, no pyzmq, nothing to download), prepare them here, once, from the repository root:
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl pyzmq==$(.venv/bin/python -c 'import zmq; print(zmq.__version__)')
#
# and run it there with: run(command="bash bench/gpu.sh", carry=[".whl"], timeout_s=300).
# Steps, each with its own timeout, all within DEADLINE_S (default 270 s: a session's 15
# minutes of device time, start-up included, then leave room for a rerun; they took 77-91 s
# on an H200): a step is given at most what is left of it, less 25 s for the results, and
# one with under 10 s left is skipped, noted as failed. A step that fails or runs out of
# time is noted and the next one runs:
#   1. the GPU and torch's view of it, then psgd's imports        -> $OUT/gpu.txt
#   2. psgd's CUDA worker path: `psgd run --device cuda` (MLP default job, then ResNet-20 on
#      synthetic 3x32x32 data, evaluator on the GPU too)
#   3. pinned-memory transfers: pageable vs pinned device->host copies, and that
#      psgd.replica.Replica stages its tables in pinned buffers, gathers the gradients
#      exactly and loads tables into the model and reads them back unchanged
#   4. bench/throughput.py's comparisons on the GPU, as two steps: psgd sync vs DDP with NCCL
#      (one GPU: one DDP rank, W=1; its `workers` is 1, not the CPU goal's W=2 figure), then
#      psgd sync/async vs a plain loop
#   5. bench/throughput.py's `overlap` part on the GPU: ResNet-20 sync W=1 S=2 with its pushes sent
#      after backward, and from backward's hooks (`wire.overlap`), each against DDP with NCCL
# $OUT holds four files, as few as the device tool brings back (8, none in subfolders deeper
# than 2): gpu.txt; steps.log (every step's output, appended as each ends); results.json (the
# steps that failed, the two runs' summary.json, the pinned-memory figures, the three
# throughput steps' JSON); runs.tar.gz (the run folders, made in a scratch folder, without
# their .pt files).
# Exit status: 2 if there is no usable GPU, 3 if PY cannot import torch, psgd or a dependency (all
# said on stderr), 1 if a step failed, 0 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
rm -f "$OUT/gpu.txt" "$OUT/steps.log" "$OUT/results.json" "$OUT/runs.tar.gz"   # (an earlier run's)
if [ -z "${PY:-}" ]; then   # the checkout's .venv, else python3 (the device's: no .venv travels)
    PY=.venv/bin/python
    [ -x "$PY" ] || PY=python3
elif ! command -v "$PY" >/dev/null; then   # (a path or a command name on PATH) given, and not there
    echo "bench/gpu.sh: PY=$PY: no such command (set PY to a Python with a CUDA build of torch)" \
        | tee "$OUT/gpu.txt" >&2
    exit 3
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/psgd-gpu.XXXXXX")   # run folders, step logs, wheels: not under $OUT
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/runs" "$WORK/logs"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
failed=()
END=$(( $(date +%s) + ${DEADLINE_S:-270} ))
step() {  # step NAME SECONDS COMMAND...: run with a timeout, append its log to $OUT/steps.log, note failures
    local name=$1 secs=$2 log="$WORK/logs/$1.log" code=0 left; shift 2
    left=$(( END - $(date +%s) - 25 ))   # (25 s kept for the results)
    if [ "$left" -lt 10 ]; then
        echo "== $name: skipped, DEADLINE_S spent" | tee -a "$OUT/steps.log" >&2
        failed+=("$name")
        return
    fi
    [ "$secs" -le "$left" ] || secs=$left
    echo "== $name (up to ${secs} s)" >&2
    timeout --kill-after=5 "$secs" "$@" >"$log" 2>&1 || code=$?
    { echo "== $name: exit $code"; cat "$log"; } >>"$OUT/steps.log"
    if [ "$code" = 0 ]; then
        echo "   ok" >&2
    else
        echo "   FAILED (exit $code): tail of its log (all of it in $OUT/steps.log):" >&2
        tail -n 15 "$log" >&2
        failed+=("$name")
    fi
}
missing_dependency() {  # missing_dependency WHAT: exit 3, saying what PY lacks and how to bring it
    echo "bench/gpu.sh: $1" >&2
    echo "(the GPU is there: carry the missing packages as wheels in .whl/, see this script's header)" >&2
    exit 3
}

# 0. Wheels carried to a machine with no package index (GPU_WHEELS: another folder of them).
WHEELS=${GPU_WHEELS:-.whl}
if [ -d "$WHEELS" ]; then
    export PYTHONPATH="$PYTHONPATH:$WORK/site"
    timeout 20 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$WORK/site" "$WHEELS"/*.whl >>"$OUT/gpu.txt" 2>&1 \
        || missing_dependency "installing $WHEELS/*.whl failed: $(tail -n 1 "$OUT/gpu.txt")"
fi

# 1. Is there a GPU that torch can use, and can PY import psgd and what it needs?
{ command -v nvidia-smi >/dev/null && timeout 15 nvidia-smi; } >>"$OUT/gpu.txt" 2>&1   # (a hung driver hangs it)
code=0
timeout 40 "$PY" - >>"$OUT/gpu.txt" 2>&1 <<'EOF' || code=$?
import sys
try:
    import torch
except ImportError as e:
    print(f"{sys.executable} cannot import torch ({e})")
    sys.exit(3)
print("torch", torch.__version__, "cuda build", torch.version.cuda)
if not torch.cuda.is_available():
    sys.exit(f"no CUDA device visible to torch {torch.__version__} (cuda build: {torch.version.cuda})")
print("device 0:", torch.cuda.get_device_name(0), "count", torch.cuda.device_count())
try:   # seen is not usable: a context, and a kernel on it
    float(torch.ones(1, device="cuda").sum())
except Exception as e:
    sys.exit(f"torch sees {torch.cuda.get_device_name(0)} but cannot compute on it "
             f"({(str(e).strip().splitlines() or [type(e).__name__])[0][:200]})")
EOF
if [ "$code" = 3 ]; then   # a dependency missing, not the GPU (not looked at without torch)
    echo "bench/gpu.sh: $(tail -n 1 "$OUT/gpu.txt")" >&2
    echo "(set PY to a Python with a CUDA build of torch; PY=$PY)" >&2
    exit 3
elif [ "$code" != 0 ]; then
    echo "bench/gpu.sh: no usable GPU: $(tail -n 1 "$OUT/gpu.txt")" >&2
    echo "(needs an NVIDIA GPU, its driver, and PY=$PY with a CUDA build of torch)" >&2
    exit 2
fi
if ! timeout 30 "$PY" - >>"$OUT/gpu.txt" 2>&1 <<'EOF'
import importlib
import sys
missing = []
for module, package in (("zmq", "pyzmq"), ("msgpack", "msgpack"), ("numpy", "numpy"), ("sklearn", "scikit-learn"),
                        ("psgd", "psgd (this checkout)")):
    try:
        print(module, getattr(importlib.import_module(module), "__version__", ""))
    except ImportError as e:
        missing.append(f"{package} ({e})")
if missing:
    sys.exit(f"{sys.executable} cannot import: {'; '.join(missing)}")
EOF
then
    missing_dependency "$(tail -n 1 "$OUT/gpu.txt")"
fi
cat "$OUT/gpu.txt" >&2

# 2. The CUDA worker path, end to end.
step run-mlp 60 "$PY" -m psgd run --device cuda --quiet --out "$WORK/runs/run-mlp" --set train.steps=300
step run-resnet20 80 "$PY" -m psgd run --device cuda --quiet --out "$WORK/runs/run-resnet20" \
    --set model.name=resnet20 --set data.name=synthetic --set "data.shape=[3,32,32]" --set train.steps=100

# 3. Pinned host buffers: bandwidth, and psgd's replica uses them.
step pinned 30 "$PY" - "$WORK/pinned.json" <<'EOF'
import json, sys, time
import torch
from psgd.models import build_model
from psgd.replica import Replica

def gbps(dst, src, n=20):
    dst.copy_(src, non_blocking=True); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return n * src.numel() * 4 / (time.perf_counter() - t) / 1e9

dev = torch.device("cuda", 0)
x = torch.randn(64 << 18, device=dev)  # 64 MiB
out = {"bytes": x.numel() * 4,
       "d2h_pageable_GBps": gbps(torch.empty(x.numel()), x),
       "d2h_pinned_GBps": gbps(torch.empty(x.numel(), pin_memory=True), x),
       "h2d_pinned_GBps": gbps(x, torch.empty(x.numel(), pin_memory=True))}
model = build_model("resnet20", (3, 32, 32), 10, 0)
rep = Replica(model, 2, dev)
model(torch.randn(8, 3, 32, 32, device=dev)).sum().backward()
grads = rep.grads()
out["replica_tables_pinned"] = all(g.is_pinned() for g in grads)
out["replica_grads_match"] = all(torch.equal(g, rep.map.gather({n: p.grad for n, p in model.named_parameters()},
                                                              i, "params").cpu()) for i, g in enumerate(grads))
sent = [t + 1 for t in rep.params()]   # pageable tables, as the shards' answers come: host -> GPU -> pinned host
rep.load(sent)
out["replica_load_roundtrip"] = all(torch.equal(a, b) for a, b in zip(rep.params(), sent))
print(json.dumps(out))
json.dump(out, open(sys.argv[1], "w"), indent=1)
sys.exit(0 if out["replica_tables_pinned"] and out["replica_grads_match"] and out["replica_load_roundtrip"] else 1)
EOF

# 4. The throughput comparisons on the GPU (NCCL allows one rank per GPU: W=1 here), in two
#    steps: DDP with NCCL (the likeliest to hang, at its init) does not take the plain loop's
#    comparisons down with it.
step throughput-ddp 90 "$PY" -m bench.throughput --parts ddp --backend nccl --device cuda --workers 1 \
    --repeats 1 --keep "$WORK/runs/throughput-runs"
step throughput-local 80 "$PY" -m bench.throughput --parts local,async --device cuda --repeats 1 \
    --keep "$WORK/runs/throughput-runs"
# 5. Pushes from backward's hooks against pushes after it, on the GPU (last: the one never run there)
step throughput-overlap 45 "$PY" -m bench.throughput --parts overlap --backend nccl --device cuda --workers 1 \
    --repeats 1 --keep "$WORK/runs/throughput-runs"

# What comes back: the figures in one JSON, the run folders in one archive.
if ! timeout 20 "$PY" - "$OUT/results.json" "$WORK" "${failed[@]}" <<'EOF'
import json, os, sys
path, work, failed = sys.argv[1], sys.argv[2], sys.argv[3:]

def read_json(p):
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None

def last_json_line(p):   # (a warning printed after it, at exit: torch's, NCCL's, a leaked semaphore's)
    try:
        with open(p) as f:
            lines = f.read().splitlines()
    except (OSError, ValueError):
        return None
    for line in reversed(lines):
        try:
            got = json.loads(line)
        except ValueError:
            continue
        if isinstance(got, dict):
            return got
    return None

out = {"failed": failed,
       "run-mlp": read_json(os.path.join(work, "runs", "run-mlp", "summary.json")),
       "run-resnet20": read_json(os.path.join(work, "runs", "run-resnet20", "summary.json")),
       "pinned": read_json(os.path.join(work, "pinned.json")),
       "throughput-ddp": last_json_line(os.path.join(work, "logs", "throughput-ddp.log")),
       "throughput-local": last_json_line(os.path.join(work, "logs", "throughput-local.log")),
       "throughput-overlap": last_json_line(os.path.join(work, "logs", "throughput-overlap.log"))}
with open(path, "w") as f:
    json.dump(out, f, indent=1)
EOF
then
    echo "bench/gpu.sh: could not write $OUT/results.json" >&2
    failed+=(results)
fi
tar -czf "$OUT/runs.tar.gz" -C "$WORK" --exclude='*.pt' runs

echo "results in $OUT${failed[*]:+; failed: ${failed[*]}}" >&2
[ ${#failed[@]} = 0 ]
