#!/usr/bin/env bash
# Every FlashInfer GPU check in one command: warm the JIT kernels (in parallel), run the
# FlashInfer tests (CPU-side, GPU kernels, conformance kit), probe kernel limits and run
# the op benchmark. Logs go to $OUT (default /tmp/flashinfer-gpu-suite).
#
#   source .gpu/env.sh && bash benchmarks/flashinfer_gpu_suite.sh [TOTAL_SECONDS] [--full]
#
# TOTAL_SECONDS (default 900) bounds the whole run; the benchmark gets what is left.
set -u
TOTAL=${1:-900}
FULL=${2:-}
OUT=${OUT:-/tmp/flashinfer-gpu-suite}
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
{ nvidia-smi; python3 -c "import torch; print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())"; } > "$OUT/device.txt" 2>&1
python3 -m backplane.cli backends > "$OUT/backends.txt" 2>&1
warm() {  # name, args...
    local name=$1; shift
    local t=$(date +%s)
    python3 -m backplane.cli --log-level info warmup --dtype bfloat16 "$@" > "$OUT/warmup-$name.log" 2>&1
    echo "exit $? after $(( $(date +%s) - t ))s" >> "$OUT/warmup-$name.log"
}
# One process per kernel family so nvcc runs in parallel; FlashInfer's file locks make
# processes that need the same kernel wait for one build.
warm attention --attention 8:2:128 --attention 32:8:128 &
warm attention-tc --attention 8:1:128 &
warm attention-window --attention 8:2:128:7 --attention 4:4:128:3 &
warm mla --mla 16 &
warm ssm --ssm 8:64:128:2 --ssm 128:64:128:8 --ssm 4:64:128:2 &
(warm delta --delta 2:4:128:128 --delta 16:32:128:128; python3 benchmarks/flashinfer_probe.py gdn > "$OUT/probe-gdn.log" 2>&1) &
python3 benchmarks/flashinfer_probe.py mla ssu > "$OUT/probe-mla-ssu.log" 2>&1 &
timeout -s INT $(( $(left) * 6 / 10 )) python3 -m pytest -p no:cacheprovider -q -rfEs --durations=25 \
    tests/test_flashinfer.py tests/test_flashinfer_gpu.py tests/test_flashinfer_kit.py \
    > "$OUT/pytest.log" 2>&1
echo "pytest exit $? at $(( $(date +%s) - T0 ))s" >> "$OUT/pytest.log"
wait
echo "warmup/probes done at $(( $(date +%s) - T0 ))s" > "$OUT/timeline.txt"
QUICK=--quick; [ "$FULL" = "--full" ] && QUICK=
B=$(( $(left) - 25 ))
if [ "$B" -gt 20 ]; then
    timeout -s INT $(( B + 15 )) python3 benchmarks/bench_ops_flashinfer.py $QUICK --time-budget "$B" \
        --json "$OUT/bench.jsonl" --md "$OUT/bench.md" > "$OUT/bench.log" 2>&1
    echo "bench exit $? at $(( $(date +%s) - T0 ))s" >> "$OUT/timeline.txt"
fi
tail -n 30 "$OUT/pytest.log"
