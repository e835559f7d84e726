#!/usr/bin/env bash
# Step 2 (reward model) of the demo in every deployment: pairs of the embedded capitals data,
# the reward model started from the step-1 actor (InstructGPT's choice; a random 7M-parameter
# trunk learns the pairs too slowly for a CPU demo), which `train` passes as MODEL. Split
# 2,6,2: 2400 training pairs. 8 epochs at 1e-3 (not 4 at 2e-3): the reward model then ranks the
# capital first among all 64 cities in 83% of the held-out probes instead of 60%, and PPO has
# less to exploit (docs/RLHF-INVESTIGATION.md). The global batch is the demo's on
# RLHF_DATA_PARALLEL_SIZE ranks.
# Usage: demo.sh OUTPUT_DIR [ZERO_STAGE] [MODEL] [SIZE]   (what `train` passes)
set -euo pipefail
OUTPUT=${1:-./output/reward}
ZERO_STAGE=${2:-0}
MODEL=${3:-$(dirname -- "$OUTPUT")/actor}
DATA_CACHE="$(dirname -- "$OUTPUT")/data_files"
DP=${RLHF_DATA_PARALLEL_SIZE:-1}
echo "step 2 starts from the step-1 actor, $MODEL (the demo's recipe)"

exec reward --model-name-or-path="$MODEL" --zero-stage="$ZERO_STAGE" --seed "${RLHF_SEED:-1234}" \
  --data-output-path="$DATA_CACHE" --output-dir="$OUTPUT" \
  --data-path demo --data-split 2,6,2 --max-seq-len 48 \
  --per-device-train-batch-size $((16 / DP)) --per-device-eval-batch-size $((32 / DP)) \
  --learning-rate 1e-3 --weight-decay 0.1 --num-train-epochs 8 --num-warmup-steps 50 \
  --lr-scheduler-type cosine --dropout 0 --gradient-accumulation-steps 1 --log-interval 50
