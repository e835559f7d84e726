#!/usr/bin/env bash
# Step 2 as DPO of the demo (`train --algorithm dpo`) in every deployment: the step-1 actor on
# the embedded capitals pairs (2400 training pairs) against its frozen copy, two epochs at a
# learning rate for a 7M-parameter model; beta 2: the easy (mistake, wrong city) pairs saturate
# the sigmoid within a few nats and the (capital, mistake) pairs take over (beta 0.1 raised the
# mistake; docs/RLHF-INVESTIGATION.md, section 8). The global batch is the demo's on
# RLHF_DATA_PARALLEL_SIZE ranks.
# Usage: demo.sh OUTPUT_DIR [ZERO_STAGE] [ACTOR] [SIZE]   (what `train` passes)
set -euo pipefail
OUTPUT=${1:-./output/dpo}
ZERO_STAGE=${2:-0}
MODEL=${3:-./output/actor}
DATA_CACHE="$(dirname -- "$OUTPUT")/data_files"
DP=${RLHF_DATA_PARALLEL_SIZE:-1}

exec reward --algorithm dpo --model-name-or-path="$MODEL" --zero-stage="$ZERO_STAGE" --seed "${RLHF_SEED:-1234}" \
  --data-output-path="$DATA_CACHE" --output-dir="$OUTPUT" \
  --data-path demo --data-split 2,6,2 --max-seq-len 48 \
  --per-device-train-batch-size $((16 / DP)) --per-device-eval-batch-size $((32 / DP)) \
  --learning-rate 1e-4 --num-train-epochs 2 --num-warmup-steps 10 --beta 2.0 \
  --lr-scheduler-type cosine --dropout 0 --log-interval 50
