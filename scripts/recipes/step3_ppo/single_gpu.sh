#!/usr/bin/env bash
# Step 3 (PPO) in one process: DS-Chat's
# training/step3_rlhf_finetuning/training_scripts/opt/single_gpu/run_1.3b.sh, with GPT-2 sizes
# (gpt2-xl actor for opt-1.3b, gpt2-medium critic for opt-350m). `tiny`: the demo's values in one process (the demo itself, `train`, runs demo.sh).
# Usage: single_gpu.sh OUTPUT_DIR [ACTOR_ZERO_STAGE] [ACTOR_PATH] [SIZE] [CRITIC_PATH] [CRITIC_ZERO_STAGE]
set -euo pipefail
OUTPUT=${1:-./output/step3}
ACTOR_ZERO_STAGE=${2:-0}
ACTOR=${3:-./output/actor}
SIZE=${4:-gpt2-xl}
CRITIC=${5:-./output/reward}
CRITIC_ZERO_STAGE=${6:-0}
DATA_CACHE="$(dirname -- "$OUTPUT")/data_files"
# `train --algorithm` sets it: ppo (DS-Chat, with a critic), grpo, rloo or reinforce_pp (no critic).
ALGORITHM=${RLHF_ALGORITHM:-ppo}

case "$SIZE" in
  tiny)
    # The demo: the embedded capitals prompts; sampled rollouts (top-k 2: the SFT actor's two
    # likeliest tokens, which on a confusable country are the capital and the classic mistake;
    # a wider sample finds the reward model's outliers), the scores normalised by their running
    # moments (the demo's reward model scores right answers above --clip-reward-value 5, where
    # clipping erased what separates them), KL coefficient 0.3; learning rates for a
    # 7M-parameter model; two PPO epochs, so that the second pass over a rollout shows PPO's
    # ratio and clipping at work. docs/RLHF-INVESTIGATION.md measures each choice.
    ARGS=(--data-path demo --data-split 2,6,2 --max-prompt-seq-len 24 --max-answer-seq-len 16
          --per-device-generation-batch-size 16 --per-device-training-batch-size 16
          --generation-batches 1 --ppo-epochs 2 --num-train-epochs 3
          --actor-learning-rate 2e-4 --num-warmup-steps 10 --kl-ctl 0.3 --normalize-reward
          --do-sample --print-answers-interval 25 --eval-prompts demo)
    CRITIC_ARGS=(--critic-learning-rate 5e-4) ;;
  gpt2|gpt2-medium|gpt2-large|gpt2-xl|custom)
    # DS-Chat single GPU (its --actor-lora-dim 128 and --only-optimize-lora arrive with LoRA).
    ARGS=(--data-path Dahoas/rm-static --data-split 2,4,4 --max-prompt-seq-len 256 --max-answer-seq-len 256
          --per-device-generation-batch-size 16 --per-device-training-batch-size 16
          --generation-batches 1 --ppo-epochs 1 --num-train-epochs 1
          --actor-learning-rate 9.65e-6 --num-warmup-steps 100
          --actor-dropout 0 --gradient-accumulation-steps 1 --enable-ema)
    CRITIC_ARGS=(--critic-learning-rate 5e-6) ;;
  *) echo "no step-3 recipe for model size $SIZE" >&2; exit 2 ;;
esac

case "$ALGORITHM" in
  ppo) ARGS+=(--critic-zero-stage="$CRITIC_ZERO_STAGE" "${CRITIC_ARGS[@]}") ;;
  # No critic: each prompt answered 4 times, the answers compared with each other.
  grpo|rloo) ARGS+=(--algorithm "$ALGORITHM" --num-samples-per-prompt 4 --do-sample)
    # The demo: 4 answers per prompt, GRPO one pass (3200 answers, PPO's three passes 2400),
    # RLOO two (its gain on seed 1234 rose from +0.10 to +0.16; GRPO's did not move):
    # docs/RLHF-INVESTIGATION.md, section 10.
    if [ "$SIZE" = tiny ]; then
      if [ "$ALGORITHM" = rloo ]; then ARGS+=(--num-train-epochs 2); else ARGS+=(--num-train-epochs 1); fi
    fi ;;
  # No critic and no groups: one answer per prompt (the demo: PPO's three passes).
  reinforce_pp) ARGS+=(--algorithm reinforce_pp)
    if [ "$SIZE" = tiny ]; then ARGS+=(--num-train-epochs 3); fi ;;
  *) echo "no step-3 recipe for algorithm $ALGORITHM (ppo, grpo, rloo, reinforce_pp)" >&2; exit 2 ;;
esac
# The demo samples top-k 2 but for REINFORCE++, whose only brake is the KL penalty on the sampled
# tokens, which top-k 2 never lets reach the tail (docs/RLHF-INVESTIGATION.md, section 19).
if [ "$SIZE" = tiny ] && [ "$ALGORITHM" != reinforce_pp ]; then ARGS+=(--top-k 2); fi

# The critic's path also names the reward model, which every algorithm reads.
exec ppo --actor-model-name-or-path="$ACTOR" --critic-model-name-or-path="$CRITIC" \
  --actor-zero-stage="$ACTOR_ZERO_STAGE" --seed "${RLHF_SEED:-1234}" \
  --data-output-path="$DATA_CACHE" --output-dir="$OUTPUT" "${ARGS[@]}"
