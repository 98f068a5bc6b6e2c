#!/usr/bin/env bash
# The GPU checks, as one prepared script for a machine with one NVIDIA GPU (never run in CI;
# not yet run anywhere: no GPU was available when it was written, see docs/performance.md).
#
#   bash bench/gpu.sh                      # from the repository root; results in ./out
#   OUT=/tmp/gpu PY=/opt/venv/bin/python bash bench/gpu.sh
#
# PY must be a Python with a CUDA build of torch and psgd's dependencies (pyzmq, msgpack,
# numpy, scikit-learn); the checkout is put on PYTHONPATH. Steps, each with its own timeout
# (60 + 90 + 120 + 60 + 300 s: at most about 11 minutes; less when they end sooner):
#   1. the GPU and torch's view of it                  -> $OUT/gpu.txt
#   2. psgd's CUDA worker path: `psgd run --device cuda` (MLP default job, then ResNet-20 on
#      synthetic 3x32x32 data, evaluator on the GPU too) -> $OUT/run-*/summary.json, run-*.log
#   3. pinned-memory transfers: pageable vs pinned device->host copies, and that
#      psgd.replica.Replica stages its tables in pinned buffers -> $OUT/pinned.json
#   4. bench/throughput.py's comparisons on the GPU: psgd sync vs DDP with NCCL (one GPU: one
#      DDP rank, W=1), psgd sync/async vs a plain loop -> $OUT/throughput.txt (last line JSON;
#      its `workers` is 1: not the CPU goal's W=2 figure), its runs' logs in $OUT/throughput-runs
# Exit status: 2 if there is no usable GPU (said on stderr), 1 if a step failed, 0 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
PY=${PY:-.venv/bin/python}
command -v "$PY" >/dev/null || PY=python3   # (a path or a command name on PATH)
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
failed=0
step() {  # step NAME SECONDS COMMAND...: run with a timeout, log to $OUT/NAME.log, note failures
    local name=$1 secs=$2; shift 2
    echo "== $name (up to ${secs} s)" >&2
    if timeout --kill-after=10 "$secs" "$@" >"$OUT/$name.log" 2>&1; then
        echo "   ok" >&2
    else
        echo "   FAILED (exit $?): tail of $OUT/$name.log:" >&2
        tail -n 15 "$OUT/$name.log" >&2
        failed=1
    fi
}

# 1. Is there a GPU that torch can use?
{ command -v nvidia-smi >/dev/null && nvidia-smi; } >"$OUT/gpu.txt" 2>&1
if ! timeout 60 "$PY" - >>"$OUT/gpu.txt" 2>&1 <<'EOF'
import sys
import torch
print("torch", torch.__version__, "cuda build", torch.version.cuda)
if not torch.cuda.is_available():
    sys.exit(f"no CUDA device visible to torch {torch.__version__} (cuda build: {torch.version.cuda})")
print("device 0:", torch.cuda.get_device_name(0), "count", torch.cuda.device_count())
import psgd, zmq  # noqa: E401,F401  psgd and its dependencies import
EOF
then
    echo "bench/gpu.sh: no usable GPU: $(tail -n 1 "$OUT/gpu.txt")" >&2
    echo "(needs an NVIDIA GPU, its driver, and PY=$PY with a CUDA build of torch)" >&2
    exit 2
fi
cat "$OUT/gpu.txt" >&2

# 2. The CUDA worker path, end to end.
step run-mlp 90 "$PY" -m psgd run --device cuda --quiet --out "$OUT/run-mlp" --set train.steps=300
step run-resnet20 120 "$PY" -m psgd run --device cuda --quiet --out "$OUT/run-resnet20" \
    --set model.name=resnet20 --set data.name=synthetic --set "data.shape=[3,32,32]" --set train.steps=100

# 3. Pinned host buffers: bandwidth, and psgd's replica uses them.
step pinned 60 "$PY" - "$OUT/pinned.json" <<'EOF'
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
print(json.dumps(out))
json.dump(out, open(sys.argv[1], "w"), indent=1)
sys.exit(0 if out["replica_tables_pinned"] and out["replica_grads_match"] else 1)
EOF

# 4. The throughput comparisons on the GPU (NCCL allows one rank per GPU: W=1 here).
step throughput 300 "$PY" -m bench.throughput --parts ddp,local,async --backend nccl --device cuda --workers 1 \
    --repeats 1 --keep "$OUT/throughput-runs"
cp "$OUT/throughput.log" "$OUT/throughput.txt" 2>/dev/null

echo "results in $OUT" >&2
exit $failed
