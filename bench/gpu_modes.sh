#!/usr/bin/env bash
# Every mode's CUDA path, as a user runs it: `psgd run --device cuda` in ssp, async, easgd,
# diloco and ltfb (Adam with its state exchanged too), async with topk and sync with bfloat16
# on the wire, and a training script of the user's own (bench/gpu_script.py, its model on
# psgd.device()) in sync, ltfb and diloco. A companion of bench/gpu.sh (which runs sync and
# the benchmarks), for the device tool, from the repository root:
#
#   run(command="bash bench/gpu_modes.sh", carry=[".whl"], timeout_s=300)
#
# (.whl/ as gpu.sh's header prepares it). Every job within DEADLINE_S (default 270 s; a job
# gets at most what is left, less 15 s, and one with under 10 s left is skipped, noted as
# failed). About 2 minutes on an H200 (each job's start-up,
# CUDA's initialisation in each process, is most of it). Results: every job's summary line,
# its exit status and a few summary.json fields on stdout and in $OUT/log.txt, the run
# folders (without .pt files) in $OUT/runs.tar.gz. Exit 1 if a job failed.
#   DEVICE=cpu ONLY=ltfb,script-diloco bash bench/gpu_modes.sh   # a CPU check of the script itself
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
if [ -z "${PY:-}" ]; then PY=.venv/bin/python; [ -x "$PY" ] || PY=python3; fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/psgd-gpu-modes.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
if [ -d .whl ] && ! "$PY" -c "import zmq" 2>/dev/null; then   # (the device's Python has no pyzmq)
    timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl \
        || { echo "bench/gpu_modes.sh: installing .whl/*.whl failed" >&2; exit 3; }
    export PYTHONPATH="$PYTHONPATH:$WORK/site"
fi
failed=()
END=$(( $(date +%s) + ${DEADLINE_S:-270} ))
one() {  # one NAME SECONDS ARGS...: a psgd run job on $DEVICE, its lines and its summary's figures
    local n=$1 s=$2 code=0 left; shift 2
    [ -z "${ONLY:-}" ] || [[ ",$ONLY," == *",$n,"* ]] || return 0
    left=$(( END - $(date +%s) - 15 ))
    if [ "$left" -lt 10 ]; then echo "== $n: skipped, DEADLINE_S spent"; failed+=("$n"); return 0; fi
    [ "$s" -le "$left" ] || s=$left
    echo "== $n"
    timeout --kill-after=5 "$s" "$PY" -m psgd run --device "$DEVICE" --quiet --out "$WORK/runs/$n" "$@" \
        >"$WORK/$n.log" 2>&1 || code=$?
    grep -v "busy processes" "$WORK/$n.log" | tail -n 4
    echo "exit $code"
    [ "$code" = 0 ] || failed+=("$n")
    timeout 20 "$PY" -c "import json, sys; d = json.load(open(sys.argv[1])); print({k: d.get(k) for k in ('mode', \
'samples_per_s', 'final_accuracy', 'time_to_target_s', 'staleness', 'max_clock_gap', 'dropped_gradients', \
'rejected', 'startup_s')})" "$WORK/runs/$n/summary.json" 2>&1 | cut -c1-600
}
{
for m in ssp async easgd diloco; do one "$m" 60 --mode "$m" --set train.steps=300; done
one ltfb 60 --mode ltfb --set train.steps=300 --set mode.round_steps=50
one ltfb-adam-opt 60 --mode ltfb --set train.steps=300 --set mode.round_steps=50 --set optimizer.name=adam \
    --set optimizer.lr=0.001 --set mode.exchange=weights+optimizer
one async-topk 60 --mode async --set train.steps=300 --set wire.compression=topk
one sync-bf16 60 --mode sync --set train.steps=300 --set wire.dtype=bfloat16
for m in sync ltfb diloco; do
    one "script-$m" 90 --script bench/gpu_script.py --mode "$m" --workers 2 --set train.steps=200 \
        --set mode.round_steps=50
done
echo "failed: ${failed[*]:-none}"
} 2>&1 | tee "$OUT/log.txt"
tar -czf "$OUT/runs.tar.gz" -C "$WORK" --exclude='*.pt' runs 2>/dev/null
grep -q "^failed: none$" "$OUT/log.txt"
