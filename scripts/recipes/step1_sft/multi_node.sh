#!/usr/bin/env bash
# Step 1 (SFT) on several nodes of 8 GPUs (64 GPUs): DS-Chat's
# training/step1_supervised_finetuning/training_scripts/opt/multi_node/run_66b.sh (and its
# smaller siblings), with GPT-2 sizes. `train --deployment-type multi_node` runs it with the
# hostfile's hosts in RLHF_NODES, so `sft` below starts the ranks of every host over ssh or srun
# (src/nodes.rs), as DeepSpeed's launcher does for DS-Chat; the values are DS-Chat's.
# Usage: multi_node.sh OUTPUT_DIR [ZERO_STAGE] [MODEL] [SIZE]
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
          --per-device-train-batch-size 4 --per-device-eval-batch-size 4
          --learning-rate 9.65e-6 --weight-decay 0 --num-train-epochs 16 --num-warmup-steps 0
          --lr-scheduler-type cosine --gradient-accumulation-steps 1) ;;
  *) echo "no step-1 recipe for model size $SIZE" >&2; exit 2 ;;
esac

exec sft --model-name-or-path="$MODEL" --zero-stage="$ZERO_STAGE" --seed "${RLHF_SEED:-1234}" \
  --data-output-path="$DATA_CACHE" --output-dir="$OUTPUT" "${ARGS[@]}"
