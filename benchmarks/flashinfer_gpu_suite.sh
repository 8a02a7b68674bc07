#!/usr/bin/env bash
# Every FlashInfer GPU check in one command: warm the JIT kernels (in parallel), run the
# FlashInfer tests (CPU-side, GPU kernels, conformance kit, model parity), probe kernel
# limits and run the op benchmark. Logs go to $OUT (default /tmp/flashinfer-gpu-suite).
#
#   bash benchmarks/flashinfer_gpu_suite.sh [TOTAL_SECONDS] [--full]   (GPU extras installed)
#
# TOTAL_SECONDS (default 900) bounds the whole run; the benchmark gets what is left.
# BENCH_ARGS adds benchmark arguments (e.g. "--families attention"); TC_COMPARE=1 also
# benchmarks attention with tensor-core decode forced (rows labelled flashinfer-tc).
# The GDN prefill kernel alone takes ~3-4 minutes to compile on a cold cache, so the
# delta tests run last, after the other families.
set -u
TOTAL=${1:-900}
FULL=${2:-}
OUT=${OUT:-/tmp/flashinfer-gpu-suite}
mkdir -p "$OUT" "$OUT/.w"
T0=$(date +%s)
left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*" >> "$OUT/timeline.txt"; }
{ nvidia-smi; python3 -c "import torch; print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
  python3 -m backplane.cli backends; } > "$OUT/env.txt" 2>&1
warm() {  # name, args...
    local name=$1; shift
    python3 -m backplane.cli --log-level info warmup --dtype bfloat16 "$@" > "$OUT/.w/$name.log" 2>&1
    stamp "warmup $name exit $?"
}
# One process per kernel family so nvcc runs in parallel; FlashInfer's file locks make
# processes that need the same kernel wait for one build.
warm delta --delta 2:4:128:128 --delta 16:32:128:128 &
warm attention --attention 8:2:128 --attention 32:8:128 &
warm attention-tc --attention 8:1:128 &
warm attention-window --attention 8:2:128:7 --attention 4:4:128:3 &
warm mla --mla 16 &
warm ssm --ssm 8:64:128:2 --ssm 128:64:128:8 --ssm 4:64:128:2 &
PYTEST="python3 -m pytest -p no:cacheprovider -q -rfEs --durations=15"
FILES="tests/test_flashinfer.py tests/test_flashinfer_gpu.py tests/test_flashinfer_kit.py"
timeout -s INT $(( $(left) * 6 / 10 )) $PYTEST $FILES -k "not delta and not Delta and not qwen3" \
    > "$OUT/pytest-a.log" 2>&1
stamp "pytest (attention, mla, ssm) exit $?"
timeout -s INT $(( $(left) - 120 )) $PYTEST $FILES -k "delta or Delta or qwen3" \
    > "$OUT/pytest-b.log" 2>&1
stamp "pytest (delta) exit $?"
wait
cat "$OUT"/.w/*.log > "$OUT/warmup.log" 2>/dev/null; rm -rf "$OUT/.w"
QUICK=--quick; [ "$FULL" = "--full" ] && QUICK=
B=$(( $(left) - 20 ))
[ "${TC_COMPARE:-0}" = 1 ] && B=$(( B / 2 ))
if [ "$B" -gt 20 ]; then
    timeout -s INT $(( B + 10 )) python3 benchmarks/bench_ops_flashinfer.py $QUICK ${BENCH_ARGS:-} \
        --time-budget "$B" --json "$OUT/bench.jsonl" --md "$OUT/bench.md" > "$OUT/bench.log" 2>&1
    stamp "bench exit $?"
fi
B=$(( $(left) - 15 ))
if [ "${TC_COMPARE:-0}" = 1 ] && [ "$B" -gt 20 ]; then
    BACKPLANE_FLASHINFER_DECODE_TENSOR_CORES=always timeout -s INT $(( B + 10 )) \
        python3 benchmarks/bench_ops_flashinfer.py $QUICK --families attention --backends flashinfer \
        --label=-tc --time-budget "$B" --json "$OUT/bench.jsonl" >> "$OUT/bench.log" 2>&1
    stamp "bench (tensor-core decode) exit $?"
fi
tail -n 5 "$OUT"/pytest-*.log; cat "$OUT/timeline.txt"
