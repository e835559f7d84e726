#!/usr/bin/env bash
# Per-rank peak memory of a whole step-3 run with GPT-2 small (124M, fp32) as the actor, the
# reference, the critic and the reward model: read the four models, roll out and train, save the
# final models and the final checkpoint, as a user's run does. One rank at ZeRO-0 (rollouts of 4
# prompts, micro-batches of 4) against 2 and 4 ranks at ZeRO-3 for both models (the same global
# batches), each rank started by hand with torchrun's variables under /usr/bin/time (its peak
# RSS, start to exit). Prints each run's per-rank peaks, their ratio to the one-rank run's, and
# ZeRO's model states (16 bytes a trained parameter, 4 a frozen one, over the ranks).
# Usage: scripts/bench/ppo-zero3-memory.sh [ROLLOUTS]   (after cargo build --release --workspace)
# PPO=path/to/another/ppo measures another build on the same starting models; EXTRA adds flags to
# every run (e.g. "--actor-lora-dim 8 --critic-lora-dim 8"); RUNS picks among "one two four".
set -euo pipefail
ROLLOUTS=${1:-2}
EXTRA=${EXTRA:-}
RUNS=${RUNS:-one two four}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${BIN:-$ROOT/target/release}
PPO=${PPO:-$BIN/ppo}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# The starting models: a GPT-2 small actor (one pretraining iteration from random weights) and a
# reward model trained from it on four pairs.
"$BIN/sft" --from-scratch --model gpt2 --seq-length 32 --train-iters 1 --micro-batch-size 1 --eval-interval 0 \
  --eval-iters 1 --device cpu --save "$WORK/actor" --output-dir "$WORK/o1" >"$WORK/actor.log" 2>&1 \
  || { cat "$WORK/actor.log"; exit 1; }
for i in 1 2 3 4; do
  echo "{\"prompt\": \"Human: What is $i plus one?\\n\\nAssistant:\", \"chosen\": \" $((i + 1)).\", \"rejected\": \" No.\"}"
done >"$WORK/pairs.jsonl"
"$BIN/reward" --model-name-or-path "$WORK/actor" --data-path "$WORK/pairs.jsonl" --data-split 0,1,0 --no-data-cache \
  --max-seq-len 32 --per-device-train-batch-size 2 --num-train-epochs 1 --device cpu --output-dir "$WORK/reward" \
  >"$WORK/reward.log" 2>&1 || { cat "$WORK/reward.log"; exit 1; }
for i in $(seq 1 64); do
  echo "{\"prompt\": \"Human: Please name a number above $i.\\n\\nAssistant:\", \"chosen\": \" x\", \"rejected\": \" y\"}"
done >"$WORK/prompts.jsonl"
COMMON=(--actor-model-name-or-path "$WORK/actor" --critic-model-name-or-path "$WORK/reward"
  --data-path "$WORK/prompts.jsonl" --data-split 0,0,1 --no-data-cache --max-prompt-seq-len 24
  --max-answer-seq-len 16 --enable-test-mode --test-stop-step "$ROLLOUTS" --device cpu --dist-timeout 900)
run() { # name ranks stage
  local port per=$((4 / $2))
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  for ((r = 0; r < $2; r++)); do
    RANK=$r WORLD_SIZE=$2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=$2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      RAYON_NUM_THREADS=$(($(nproc) / $2 > 0 ? $(nproc) / $2 : 1)) \
      /usr/bin/time -f "%M %e" -o "$WORK/$1-$r.rss" "$PPO" "${COMMON[@]}" --actor-zero-stage "$3" \
      --critic-zero-stage "$3" --per-device-generation-batch-size $per --per-device-training-batch-size $per \
      $EXTRA --output-dir "$WORK/out-$1" >"$WORK/$1-$r.log" 2>&1 &
  done
  wait
}
# shellcheck disable=SC2086 # EXTRA is words
[[ " $RUNS " == *" one "* ]] && run one 1 0
[[ " $RUNS " == *" two "* ]] && run two 2 3
[[ " $RUNS " == *" four "* ]] && run four 4 3
python3 - "$WORK" "$RUNS" <<'PY'
import pathlib, sys
work, runs = pathlib.Path(sys.argv[1]), sys.argv[2].split()
params = 124.44e6  # GPT-2 small; the critic and the reward model add a 768-value head
def peaks(name, ranks):
    rows = [(work / f"{name}-{r}.rss").read_text().split() for r in range(ranks)]
    return [int(row[-2]) / 1024 for row in rows], max(float(row[-1]) for row in rows)
one = peaks("one", 1)[0] if "one" in runs else None
print("| run | peak RSS per rank, load + rollouts + train + save (MiB) | / one rank | ZeRO's model states per rank (MiB) | seconds |")
print("|---|---|---|---|---|")
for name, ranks, stage in [("one", 1, 0), ("two", 2, 3), ("four", 4, 3)]:
    if name not in runs:
        continue
    p, secs = peaks(name, ranks)
    ratio = "%.2fx" % (max(p) / one[0]) if one else "-"
    # Actor and critic: fp32 weights, gradients and two moments; reference and reward: fp32 weights.
    states = (2 * 16 + 2 * 4) * params / 2**20 / (ranks if stage == 3 else 1)
    print(f"| {ranks} rank(s), ZeRO-{stage} | {' / '.join(f'{x:.0f}' for x in p)} | {ratio} | {states:.0f} | {secs:.0f} |")
PY
