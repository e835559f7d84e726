#!/usr/bin/env bash
# Step 1 (SFT) of the demo (`train`, `train --demo`) in every deployment: the embedded capitals
# data (assets/demo), a 7M-parameter GPT-2 from scratch. The global batch is the demo's in every
# deployment: each of the RLHF_DATA_PARALLEL_SIZE data-parallel ranks `train` starts takes its
# share, so N ranks follow the one-process run. Split 2,6,2: the reward model needs the pairs
# more than PPO needs the prompts. 15 epochs: the eval loss still fell at 10 (perplexity 1.42 ->
# 1.30), and the 10-epoch actor almost never sampled the capital of some confusable countries,
# which no step-3 algorithm can then reinforce (docs/RLHF-INVESTIGATION.md, section 15).
# Usage: demo.sh OUTPUT_DIR [ZERO_STAGE] [MODEL] [SIZE]   (what `train` passes)
set -euo pipefail
OUTPUT=${1:-./output/actor}
ZERO_STAGE=${2:-0}
MODEL=${3:-tiny}
DATA_CACHE="$(dirname -- "$OUTPUT")/data_files"
DP=${RLHF_DATA_PARALLEL_SIZE:-1}

exec sft --model-name-or-path="$MODEL" --zero-stage="$ZERO_STAGE" --seed "${RLHF_SEED:-1234}" \
  --data-output-path="$DATA_CACHE" --output-dir="$OUTPUT" \
  --data-path demo --data-split 2,6,2 --max-seq-len 48 \
  --per-device-train-batch-size $((16 / DP)) --per-device-eval-batch-size $((32 / DP)) \
  --learning-rate 2e-3 --weight-decay 0 --num-train-epochs 15 --num-warmup-steps 20 \
  --lr-scheduler-type cosine --dropout 0 --gradient-accumulation-steps 1 \
  --eval-prompts demo --num-eval-prompts 4 --log-interval 50
