#!/usr/bin/env bash
# The one-GPU runs behind docs/speculative.md's and docs/models.md's figures, in parts that
# each fit one call of a machine that compiles every kernel afresh (Triton, mamba-ssm and fla
# kernels compile on first use; the parts of one call share the compiled kernels).
#
#   PART=tests bash benchmarks/spec_quant_gpu.sh OUT_DIR   # GPU tests of speculation and quantisation
#   PART=spec  bash benchmarks/spec_quant_gpu.sh OUT_DIR   # speculation: ngram on the 1B shape, MTP
#   PART=quant bash benchmarks/spec_quant_gpu.sh OUT_DIR   # FP8 and Q4_K at batch 1, the GGUF kernel
#   PART=mix   bash benchmarks/spec_quant_gpu.sh OUT_DIR   # the 8B ShareGPT-like mix, bf16 and FP8
#   PART=kernels bash benchmarks/spec_quant_gpu.sh OUT_DIR # one-row projections of the 8B shape, profiles
#   PART=startup bash benchmarks/spec_quant_gpu.sh OUT_DIR # engine start-up per phase, warm and cold
#
# Each step has a time limit (seconds, LIMIT_* below), so a stuck or slow step costs its
# limit and the rest still run; OUT_DIR/timeline.txt says how long each took and how it
# ended. The random weights are saved once under WEIGHTS_DIR.
set -uo pipefail

OUT=${1:?usage: PART=tests|spec|quant|mix|kernels|startup bash benchmarks/spec_quant_gpu.sh OUT_DIR}
PART=${PART:?set PART to tests, spec, quant, mix, kernels or startup}
W=${WEIGHTS_DIR:-/tmp/backplane-weights}
LIMIT_TEST=${LIMIT_TEST:-150}
LIMIT_BENCH=${LIMIT_BENCH:-200}
LIMIT_MTP=${LIMIT_MTP:-540}
mkdir -p "$OUT" "$W"
T0=$(date +%s)
mark() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$OUT/timeline.txt"; }

# run NAME LIMIT COMMAND...: the command's output in OUT/NAME.log, its end in the timeline
run() {
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    mark "rc=$? $name: $(tail -n 1 "$OUT/$name.log")"
}

latency() {
    local name=$1
    shift
    run "$name" "$LIMIT_BENCH" backplane bench latency --weights-dir "$W" --batch-sizes 1 \
        --attention triton --transformers none --json "$OUT/$name.json" "$@"
}

case $PART in
tests)
    for t in test_verify_graph test_verify_graph_hybrid_gpu test_spec_decode_gpu \
        test_spec_graph_gpu test_hybrid_prefix_gpu test_fp8_kv_gpu test_fp8_gemv_gpu \
        test_fp8_fused_gpu test_qgemv_gpu test_bench_startup_gpu test_fp8_act_quant_gpu \
        test_moe_gemv_gpu; do
        run "$t" "$LIMIT_TEST" python3 -m pytest -q -rfE -m gpu -p no:cacheprovider "tests/$t.py"
    done
    ;;
spec)
    ngram='{"method": "ngram", "num_speculative_tokens": 4}'
    latency ngram_llama32_1b --shapes llama-3.2-1b --workload rewrite --speculative-config "$ngram"
    # its first forward compiles the delta-rule and expert kernels: minutes on a fresh machine
    LIMIT_BENCH=$LIMIT_MTP latency mtp_qwen3_next --shapes qwen3-next-1b-mtp --cuda-graphs on \
        --repeats 2 --new-tokens 96 \
        --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'
    ;;
quant)
    latency fp8_llama31_8b --shapes llama-3.1-8b --quantization fp8
    latency q4k_llama31_8b --shapes llama-3.1-8b --weights-format gguf-q4_k
    run qgemv "$LIMIT_BENCH" python3 benchmarks/qgemv.py --json "$OUT/qgemv.json"
    ;;
mix)
    for q in none fp8; do
        run "mix_$q" "$LIMIT_BENCH" backplane bench throughput --model llama-3.1-8b \
            --weights-dir "$W" --num-prompts 1000 --request-rate inf --decode-batch-sizes none \
            --no-transformers --quantization "$q" --json "$OUT/mix_$q.json"
    done
    ;;
kernels)
    run gemv_8b "$LIMIT_BENCH" python3 benchmarks/gemv.py --model llama-8b --rows 1 \
        --json "$OUT/gemv_8b.json"
    run fused_8b "$LIMIT_BENCH" python3 benchmarks/gemv.py --fused --model llama-8b \
        --json "$OUT/fused_8b.json"
    run fused_fp8_8b "$LIMIT_BENCH" python3 benchmarks/gemv.py --fused --fp8 channel \
        --model llama-8b --json "$OUT/fused_fp8_8b.json"
    run qgemv_sweep "$LIMIT_BENCH" python3 benchmarks/qgemv.py --sweep --json "$OUT/qgemv.json"
    for q in none fp8; do
        extra=()
        [[ $q == fp8 ]] && extra=(--quantization fp8)
        run "profile_8b_$q" "$LIMIT_BENCH" python3 benchmarks/profile_decode.py \
            --shape llama-3.1-8b --attention triton --json "$OUT/profile_8b_$q.json" "${extra[@]}"
    done
    ;;
startup)
    run startup "$LIMIT_BENCH" backplane bench startup --shapes llama-3.2-1b,llama-3.1-8b \
        --weights-dir "$W" --attention triton --cold --json "$OUT/startup.json"
    ;;
*)
    echo "unknown PART=$PART (tests, spec, quant, mix, kernels or startup)" >&2
    exit 2
    ;;
esac
