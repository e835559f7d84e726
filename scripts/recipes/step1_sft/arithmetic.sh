#!/usr/bin/env bash
# Step 1 (SFT) of the arithmetic task (`--data-path arithmetic`, data/src/arithmetic.rs): a
# 7M-parameter GPT-2 from scratch on "What is a + b?" (operands 0-9) whose demonstrations forget
# the carry on 65% of each carrying pair's rows, so that the actor answers the forgotten carry
# greedily and the sum a third of the time when sampling. 50 epochs at 1e-3 (20 at 2e-3: the actor
# stayed at the answers' marginal); the loss over the prompt too (DS-Chat's) left GRPO a larger
# gain than the answer alone on seed 1234, 1.000 against 0.908 (docs/RLHF-INVESTIGATION.md,
# section 18b). The held-out prompts (`arithmetic-phrasings`) ask each trained pair in the one
# training phrasing its rows never use. `train --task arithmetic` runs it on one rank (the
# batches are the one-process run's) with the tiny model.
# Usage: arithmetic.sh OUTPUT_DIR [ZERO_STAGE] [MODEL]   (step binaries on PATH; RLHF_SEED)
set -euo pipefail
OUTPUT=${1:-./output/actor}
ZERO_STAGE=${2:-0}
MODEL=${3:-tiny}
DATA_CACHE="$(dirname -- "$OUTPUT")/data_files"
# On N data-parallel ranks (`train` sets it) each takes 1/N of every batch: the one-process run's.
DP=${RLHF_DATA_PARALLEL_SIZE:-1}

exec sft --model-name-or-path="$MODEL" --zero-stage="$ZERO_STAGE" --seed "${RLHF_SEED:-1234}" \
  --data-output-path="$DATA_CACHE" --output-dir="$OUTPUT" \
  --data-path arithmetic --data-split 6,1,3 --max-seq-len 32 --train-on-prompt \
  --per-device-train-batch-size $((16 / DP)) --per-device-eval-batch-size $((32 / DP)) \
  --learning-rate 1e-3 --weight-decay 0 --num-train-epochs 50 --num-warmup-steps 20 \
  --lr-scheduler-type cosine --dropout 0 --gradient-accumulation-steps 1 \
  --eval-prompts arithmetic-phrasings --num-eval-prompts 4 --log-interval 100
