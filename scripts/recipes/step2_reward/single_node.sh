#!/usr/bin/env bash
# Step 2 (reward model) on one node of 8 GPUs: DS-Chat's
# training/step2_reward_model_finetuning/training_scripts/opt/single_node/run_350m.sh, with
# GPT-2 sizes. `train` runs it with RLHF_NPROC_PER_NODE set, so `reward` below starts one rank
# per GPU (src/ranks.rs). The values are DS-Chat's.
# Usage: single_node.sh OUTPUT_DIR [ZERO_STAGE] [MODEL] [SIZE]
set -euo pipefail
OUTPUT=${1:-./output/reward}
ZERO_STAGE=${2:-0}
MODEL=${3:-gpt2-medium}
SIZE=${4:-$MODEL}
DATA_CACHE="$(dirname -- "$OUTPUT")/data_files"

case "$SIZE" in
  tiny) ARGS=(--data-path demo --data-split 2,6,2 --max-seq-len 48 --per-device-train-batch-size 16
              --learning-rate 1e-3 --weight-decay 0.1 --num-train-epochs 8 --num-warmup-steps 50 --dropout 0) ;;
  gpt2|gpt2-medium|gpt2-large|gpt2-xl|custom)
    ARGS=(--data-path Dahoas/rm-static Dahoas/full-hh-rlhf Dahoas/synthetic-instruct-gptj-pairwise
          yitingxie/rlhf-reward-datasets --data-split 2,4,4 --max-seq-len 512
          --per-device-train-batch-size 8 --per-device-eval-batch-size 8
          --learning-rate 5e-5 --weight-decay 0.1 --num-train-epochs 1 --num-warmup-steps 0
          --lr-scheduler-type cosine --dropout 0 --gradient-accumulation-steps 1) ;;
  *) echo "no step-2 recipe for model size $SIZE" >&2; exit 2 ;;
esac

exec reward --model-name-or-path="$MODEL" --zero-stage="$ZERO_STAGE" --seed "${RLHF_SEED:-1234}" \
  --data-output-path="$DATA_CACHE" --output-dir="$OUTPUT" "${ARGS[@]}"
