#!/usr/bin/env bash
# Step 3 of the demo in every deployment: the embedded capitals prompts; sampled rollouts (top-k
# 2: the SFT actor's two likeliest tokens, which on a confusable country are the capital and the
# classic mistake; a wider sample finds the reward model's outliers), the scores normalised by
# their running moments (the demo's reward model scores right answers above
# --clip-reward-value 5, where clipping erased what separates them), KL coefficient 0.3;
# learning rates for a 7M-parameter model; two PPO epochs, so that the second pass over a
# rollout shows PPO's ratio and clipping at work. docs/RLHF-INVESTIGATION.md measures each
# choice. A rollout and a PPO micro-batch are the demo's on RLHF_DATA_PARALLEL_SIZE ranks.
# Usage: demo.sh OUTPUT_DIR [ACTOR_ZERO_STAGE] [ACTOR_PATH] [SIZE] [CRITIC_PATH] [CRITIC_ZERO_STAGE]
set -euo pipefail
OUTPUT=${1:-./output/step3}
ACTOR_ZERO_STAGE=${2:-0}
ACTOR=${3:-./output/actor}
CRITIC=${5:-./output/reward}
CRITIC_ZERO_STAGE=${6:-0}
DATA_CACHE="$(dirname -- "$OUTPUT")/data_files"
DP=${RLHF_DATA_PARALLEL_SIZE:-1}
# `train --algorithm` sets it: ppo (DS-Chat, with a critic), grpo, rloo or reinforce_pp (no critic).
ALGORITHM=${RLHF_ALGORITHM:-ppo}

ARGS=(--data-path demo --data-split 2,6,2 --max-prompt-seq-len 24 --max-answer-seq-len 16
      --per-device-generation-batch-size $((16 / DP)) --per-device-training-batch-size $((16 / DP))
      --generation-batches 1 --ppo-epochs 2
      --actor-learning-rate 2e-4 --num-warmup-steps 10 --kl-ctl 0.3 --normalize-reward
      --do-sample --print-answers-interval 25 --eval-prompts demo)
case "$ALGORITHM" in
  ppo) ARGS+=(--top-k 2 --num-train-epochs 3 --critic-zero-stage="$CRITIC_ZERO_STAGE" --critic-learning-rate 5e-4) ;;
  # No critic: 4 answers per prompt, compared with each other. GRPO one pass (3200 answers, PPO's
  # three passes 2400), RLOO two (its gain on seed 1234 rose from +0.10 to +0.16; GRPO's did not
  # move): docs/RLHF-INVESTIGATION.md, section 10.
  grpo) ARGS+=(--top-k 2 --algorithm grpo --num-samples-per-prompt 4 --num-train-epochs 1) ;;
  rloo) ARGS+=(--top-k 2 --algorithm rloo --num-samples-per-prompt 4 --num-train-epochs 2) ;;
  # No critic and no groups: one answer per prompt, PPO's three passes. Sampled from the whole
  # distribution: its only brake is the KL penalty on the sampled tokens, which top-k 2 never
  # lets reach the tail (KL to SFT 2-44 nats with it, 0.3-0.4 without: section 19).
  reinforce_pp) ARGS+=(--algorithm reinforce_pp --num-train-epochs 3) ;;
  *) echo "no step-3 recipe for algorithm $ALGORITHM (ppo, grpo, rloo, reinforce_pp)" >&2; exit 2 ;;
esac

# The critic's path also names the reward model, which every algorithm reads.
exec ppo --actor-model-name-or-path="$ACTOR" --critic-model-name-or-path="$CRITIC" \
  --actor-zero-stage="$ACTOR_ZERO_STAGE" --seed "${RLHF_SEED:-1234}" \
  --data-output-path="$DATA_CACHE" --output-dir="$OUTPUT" "${ARGS[@]}"
