#!/usr/bin/env bash
# The GPU runs behind docs/benchmarks/throughput.md: `backplane bench throughput` on the
# ~1.1B Llama shape (32 prompts x 512 tokens, 128 new) and the Nemotron-H 0.85B shape
# (32 x 512, 64 new) with the Triton and the FlashInfer attention backends, each with
# transformers on the same batch and decode-only throughput at batch 64, 128 and 256
# against the HBM floor, then the ShareGPT-like mix (1000 requests, all at once) on the
# Llama shape with both backends.
#
#   bash benchmarks/throughput_gpu.sh OUT_DIR
#
# Writes OUT_DIR/NAME.json, NAME.png and NAME.log per run. The random weights are saved
# in a temporary folder (WEIGHTS_DIR to keep them elsewhere) and loaded by both sides.
set -euo pipefail

OUT=${1:?usage: bash benchmarks/throughput_gpu.sh OUT_DIR}
mkdir -p "$OUT"
if [[ -n "${WEIGHTS_DIR:-}" ]]; then
    W=$WEIGHTS_DIR
else
    W=$(mktemp -d -t bench-throughput-weights-XXXXXX)
    trap 'rm -rf "$W"' EXIT
fi

run() {
    local name=$1
    shift
    echo "== $name"
    backplane --log-level info bench throughput --weights-dir "$W" --max-num-seqs 256 \
        --json "$OUT/$name.json" --plot "$OUT/$name.png" "$@" 2>&1 | tee "$OUT/$name.log"
}

for attn in triton flashinfer; do
    run "llama1b_32x512_128_$attn" --model llama-1b --backend "attention=$attn" \
        --num-prompts 32 --input-len 512 --output-len 128 --request-rate inf \
        --decode-batch-sizes 64,128,256
    run "nemotronh085b_32x512_64_$attn" --model nemotron-h-0.85b --backend "attention=$attn" \
        --num-prompts 32 --input-len 512 --output-len 64 --request-rate inf \
        --decode-batch-sizes 64,128,256
done
for attn in triton flashinfer; do
    run "llama1b_sharegpt_inf_$attn" --model llama-1b --backend "attention=$attn" \
        --num-prompts 1000 --request-rate inf --decode-batch-sizes none
done
echo "wrote $OUT"
