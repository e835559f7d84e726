#!/usr/bin/env bash
# Step 1 (SFT) on one node of 8 GPUs: DS-Chat's
# training/step1_supervised_finetuning/training_scripts/opt/single_node/run_1.3b.sh (and its
# 6.7b/13b/30b/66b siblings), with GPT-2 sizes. `train` runs it with RLHF_NPROC_PER_NODE set, so
# `sft` below starts one rank per GPU (src/ranks.rs); the values are DS-Chat's.
# Usage: single_node.sh OUTPUT_DIR [ZERO_STAGE] [MODEL] [SIZE]
set -euo pipefail
OUTPUT=${1:-./output/actor}
ZERO_STAGE=${2:-2}
MODEL=${3:-gpt2-xl}
SIZE=${4:-$MODEL}
DATA_CACHE="$(dirname -- "$OUTPUT")/data_files"

case "$SIZE" in
  tiny) ARGS=(--data-path demo --data-split 2,6,2 --max-seq-len 48 --per-device-train-batch-size 16 --learning-rate 2e-3
              --num-train-epochs 15 --num-warmup-steps 20 --dropout 0) ;;
  gpt2|gpt2-medium|gpt2-large|gpt2-xl|custom)
    ARGS=(--data-path Dahoas/rm-static Dahoas/full-hh-rlhf Dahoas/synthetic-instruct-gptj-pairwise
          yitingxie/rlhf-reward-datasets --data-split 2,4,4 --max-seq-len 512
          --per-device-train-batch-size 8 --per-device-eval-batch-size 8
          --learning-rate 9.65e-6 --weight-decay 0 --num-train-epochs 16 --num-warmup-steps 0
          --lr-scheduler-type cosine --gradient-accumulation-steps 1) ;;
  *) echo "no step-1 recipe for model size $SIZE" >&2; exit 2 ;;
esac

exec sft --model-name-or-path="$MODEL" --zero-stage="$ZERO_STAGE" --seed "${RLHF_SEED:-1234}" \
  --data-output-path="$DATA_CACHE" --output-dir="$OUTPUT" "${ARGS[@]}"
