#!/usr/bin/env bash
# The GPU runs behind docs/distributed.md's figures, on one host of GPUS (2 or 4) GPUs:
#
# 1. parity: tests/test_tensor_parallel_gpu.py (greedy output against transformers with
#    CUDA graphs on, at TP=2 and, with four GPUs, TP=4 and two replicas of TP=2), one test
#    at a time: two engines on the same GPUs would time-slice their NCCL kernels;
# 2. the Llama-3.1-8B shape (random bf16 weights, saved once) at TP=1, 2 (and 4):
#    `bench latency` at batch 1, `benchmarks/profile_decode.py` (the all-reduce share of a
#    batch-1 step), and `bench throughput` on 1,000 ShareGPT-like requests at once, each
#    alone on the host.
#
#   GPUS=4 bash benchmarks/tensor_parallel_gpu.sh OUT_DIR
#   GPUS=2 SIZES=2 STEPS="latency" bash benchmarks/tensor_parallel_gpu.sh OUT_DIR
#
# STEPS picks the parts (default "parity latency profile throughput"), SIZES the
# tensor-parallel sizes measured (default "1 2", or "1 2 4" with four GPUs); ONE_SHOT=1
# measures latency at TP > 1 with --custom-all-reduce.
#
# Each step has a time limit (seconds, LIMIT_* below), so a stuck step costs its limit and
# the rest still run; OUT_DIR/timeline.txt says how long each took.
set -uo pipefail

OUT=${1:?usage: GPUS=4 bash benchmarks/tensor_parallel_gpu.sh OUT_DIR}
GPUS=${GPUS:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
W=${WEIGHTS_DIR:-/tmp/backplane-tp-weights}
LIMIT_TEST=${LIMIT_TEST:-240}
LIMIT_BENCH=${LIMIT_BENCH:-200}
STEPS=" ${STEPS:-parity latency profile throughput} "
mkdir -p "$OUT" "$W"
T0=$(date +%s)
mark() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$OUT/timeline.txt"; }

wants() { [[ $STEPS == *" $1 "* ]]; }

T=tests/test_tensor_parallel_gpu.py
ids=""
wants parity && ids=$(python3 -m pytest -q --collect-only -p no:cacheprovider "$T" | grep '::')
for id in $ids; do
    case $id in
        *-4\]|*replicas*) [[ $GPUS -ge 4 ]] || continue ;;
    esac
    timeout "$LIMIT_TEST" python3 -m pytest -q -p no:cacheprovider -rA "$id" >>"$OUT/parity.log" 2>&1
    mark "rc=$? $id"
done

python3 - "$W" <<'PY'
import sys, torch
from backplane.cli.bench.latency.shapes import shape_config
from backplane.cli.bench.latency.weights import save_random_weights
save_random_weights("llama-3.1-8b", shape_config("llama-3.1-8b"), f"{sys.argv[1]}/llama-3.1-8b-bfloat16", torch.bfloat16)
PY
mark "weights saved"

sizes="1 2"
[[ $GPUS -ge 4 ]] && sizes="1 2 4"
sizes=${SIZES:-$sizes}
# ONE_SHOT=1: the TP > 1 latency runs sum small all-reduces with the one-shot kernel
one_shot() { [[ -n ${ONE_SHOT:-} && $1 -gt 1 ]] && echo --custom-all-reduce; }
for tp in $sizes; do
    if wants latency; then
        timeout "$LIMIT_BENCH" backplane bench latency \
            --shapes llama-3.1-8b --batch-sizes 1 --attention triton --transformers none \
            --repeats 3 --weights-dir "$W" -tp "$tp" $(one_shot "$tp") \
            --json "$OUT/latency_tp$tp.json" \
            >"$OUT/latency_tp$tp.log" 2>&1
        mark "rc=$? latency tp=$tp"
    fi
    if wants profile; then
        timeout "$LIMIT_BENCH" python3 benchmarks/profile_decode.py \
            --model "$W/llama-3.1-8b-bfloat16" --attention triton --prompt-len 512 -tp "$tp" \
            --json "$OUT/profile_tp$tp.json" >"$OUT/profile_tp$tp.log" 2>&1
        mark "rc=$? profile tp=$tp"
    fi
    wants throughput || continue
    timeout "$LIMIT_BENCH" backplane bench throughput --model llama-3.1-8b --weights-dir "$W" \
        --num-prompts 1000 --request-rate inf --decode-batch-sizes 256 --no-transformers \
        -tp "$tp" --json "$OUT/throughput_tp$tp.json" >"$OUT/throughput_tp$tp.log" 2>&1
    mark "rc=$? throughput tp=$tp"
done
