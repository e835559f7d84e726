#!/usr/bin/env bash
# Step 3 of the arithmetic task (`train --task arithmetic`): GRPO on the rule reward alone
# (`builtin:arithmetic`, 1 for the sum, else 0; no reward model, so step 2 is skipped), 4 sampled
# answers per prompt, KL 0.05, one pass over step 3's 352 training prompts. The held-out task score is
# measured greedily on `arithmetic-phrasings`, for the SFT actor and the trained one
# (docs/RLHF-INVESTIGATION.md, section 18b: 0.52-0.56 -> 0.95-1.00 on seeds 1234, 2 and 3). One
# rank: the batches are the one-process run's (`train` refuses more).
# Usage: arithmetic.sh OUTPUT_DIR [ACTOR_ZERO_STAGE] [ACTOR_PATH]   (step binaries on PATH; RLHF_SEED)
set -euo pipefail
OUTPUT=${1:-./output/step3}
ACTOR_ZERO_STAGE=${2:-0}
ACTOR=${3:-./output/actor}
DATA_CACHE="$(dirname -- "$OUTPUT")/data_files"
# On N data-parallel ranks (`train` sets it) each takes 1/N of every batch: the one-process run's.
DP=${RLHF_DATA_PARALLEL_SIZE:-1}
# `train --algorithm` sets it: grpo (the default), rloo or reinforce_pp, none with a critic.
ALGORITHM=${RLHF_ALGORITHM:-grpo}

case "$ALGORITHM" in
  # RLOO with GRPO's settings: 0.563 -> 1.000 on seed 1234's SFT actor too (section 18b).
  grpo | rloo) ARGS=(--algorithm "$ALGORITHM" --num-samples-per-prompt 4 --num-train-epochs 1) ;;
  # No groups: one answer per prompt, so four passes make GRPO's number of answers.
  reinforce_pp) ARGS=(--algorithm reinforce_pp --num-train-epochs 4) ;;
  *) echo "no arithmetic step-3 recipe for algorithm $ALGORITHM (grpo, rloo, reinforce_pp): PPO's critic would start from a reward model, and the task has none" >&2; exit 2 ;;
esac

# No critic and --no-reward-model: no critic path (ppo refuses one it would not read).
exec ppo --actor-model-name-or-path="$ACTOR" \
  --actor-zero-stage="$ACTOR_ZERO_STAGE" --seed "${RLHF_SEED:-1234}" \
  --data-output-path="$DATA_CACHE" --output-dir="$OUTPUT" \
  --data-path arithmetic --data-split 6,1,3 --max-prompt-seq-len 24 --max-answer-seq-len 8 \
  --per-device-generation-batch-size $((16 / DP)) --per-device-training-batch-size $((16 / DP)) --generation-batches 1 \
  --ppo-epochs 1 --actor-learning-rate 2e-4 --num-warmup-steps 5 --kl-ctl 0.05 --do-sample \
  --no-reward-model --reward-fn builtin:arithmetic "${ARGS[@]}" \
  --print-answers-interval 10 --eval-prompts arithmetic-phrasings
