#!/usr/bin/env bash
# Step 2 as DPO in one process (`train --algorithm dpo`): the step-1 actor trained directly on
# the preference pairs against its frozen copy, instead of a reward model and PPO. TRL's
# DPOTrainer defaults (beta 0.1, sigmoid loss) on step 2's data; `tiny`: the demo's values in one process (the demo itself, `train`, runs demo.sh).
# Usage: single_gpu.sh OUTPUT_DIR [ZERO_STAGE] [ACTOR] [SIZE]   (what `train` passes)
set -euo pipefail
OUTPUT=${1:-./output/dpo}
ZERO_STAGE=${2:-0}
MODEL=${3:-./output/actor}
SIZE=${4:-gpt2-xl}
DATA_CACHE="$(dirname -- "$OUTPUT")/data_files"

case "$SIZE" in
  tiny)
    # The demo: the embedded capitals pairs (2400 training pairs), two epochs at a learning
    # rate for a 7M-parameter model; beta 2: the easy (mistake, wrong city) pairs saturate the
    # sigmoid within a few nats and the (capital, mistake) pairs take over (beta 0.1 raised the
    # mistake; docs/RLHF-INVESTIGATION.md, section 8).
    ARGS=(--data-path demo --data-split 2,6,2 --max-seq-len 48
          --per-device-train-batch-size 16 --per-device-eval-batch-size 32
          --learning-rate 1e-4 --num-train-epochs 2 --num-warmup-steps 10 --beta 2.0
          --lr-scheduler-type cosine --dropout 0 --log-interval 50) ;;
  gpt2|gpt2-medium|gpt2-large|gpt2-xl|custom)
    ARGS=(--data-path Dahoas/rm-static --data-split 2,4,4 --max-seq-len 512
          --per-device-train-batch-size 8 --per-device-eval-batch-size 8
          --learning-rate 5e-7 --num-train-epochs 1 --num-warmup-steps 100
          --lr-scheduler-type cosine --dropout 0 --gradient-accumulation-steps 2) ;;
  *) echo "no DPO recipe for model size $SIZE" >&2; exit 2 ;;
esac

exec reward --algorithm dpo --beta 0.1 --model-name-or-path="$MODEL" --zero-stage="$ZERO_STAGE" --seed "${RLHF_SEED:-1234}" \
  --data-output-path="$DATA_CACHE" --output-dir="$OUTPUT" "${ARGS[@]}"
