#!/usr/bin/env bash
# The demo's algorithms side by side (issue 15): for each seed, steps 1 and 2 once, then step 3
# as PPO, GRPO, RLOO and REINFORCE++ on the same SFT actor and reward model, and DPO (step 2 --algorithm dpo)
# on the same SFT actor; every actor scored by `policy_eval` on the held-out prompts (reward-model
# score, task score on the held-out phrasings and on the held-out countries, KL to the SFT model,
# answer length), then mean, standard deviation and range over the seeds.
# Usage: scripts/compare-algorithms.sh [OUT_DIR] [SEED...]   (default: compare-out, seeds 1 2 3)
# ALGORITHMS="ppo grpo" runs only those (of ppo grpo rloo reinforce_pp dpo, the default all);
# TABLE_ONLY=1 runs nothing and prints the table of the seeds already in OUT_DIR.
# Needs `cargo build --release` first; python3 for the table.
set -euo pipefail
OUT=${1:-compare-out}
shift || true
if [ $# -gt 0 ]; then SEEDS=("$@"); else SEEDS=(1 2 3); fi
read -r -a ALGS <<< "${ALGORITHMS:-ppo grpo rloo reinforce_pp dpo}"
for alg in "${ALGS[@]}"; do
  case "$alg" in ppo|grpo|rloo|reinforce_pp|dpo) ;; *) echo "ALGORITHMS: unknown $alg (ppo grpo rloo reinforce_pp dpo)" >&2; exit 2 ;; esac
done
BIN="$(cd "$(dirname -- "$0")/.." && pwd)/target/release"
mkdir -p "$OUT"
secs() { local t0=$1; echo $(( $(date +%s) - t0 )); }
for seed in "${SEEDS[@]}"; do
  [ -n "${TABLE_ONLY:-}" ] && break
  dir="$OUT/seed-$seed"
  times="$dir/times.txt"
  mkdir -p "$dir"; : > "$times"
  t0=$(date +%s); "$BIN/train" --seed "$seed" --step 1 2 --actor-model tiny --reward-model "$dir/actor" --output-dir "$dir" > "$dir/steps12.log" 2>&1
  echo "sft+rm $(secs "$t0")" >> "$times"
  actors=()
  for alg in "${ALGS[@]}"; do
    t0=$(date +%s)
    if [ "$alg" = dpo ]; then
      "$BIN/train" --seed "$seed" --step 2 --algorithm dpo --output-dir "$dir" > "$dir/dpo.log" 2>&1
      actors+=(--actor dpo="$dir/dpo")
    else
      "$BIN/train" --seed "$seed" --step 3 --algorithm "$alg" --output-dir "$dir" > "$dir/step3-$alg.log" 2>&1
      rm -rf "$dir/step3-$alg"; mv "$dir/step3" "$dir/step3-$alg"
      actors+=(--actor "$alg=$dir/step3-$alg/actor")
    fi
    echo "$alg $(secs "$t0")" >> "$times"
  done
  "$BIN/policy_eval" --reference "$dir/actor" --reward-model "$dir/reward" "${actors[@]}" --json "$dir/eval.json" \
    --probe-demo-reward-model | tee "$dir/eval.md"
done
python3 - "$OUT" "${SEEDS[@]}" <<'PY'
import json, statistics, sys
out, seeds = sys.argv[1], sys.argv[2:]
evals = {s: json.load(open(f"{out}/seed-{s}/eval.json")) for s in seeds}
times = {s: dict(l.split() for l in open(f"{out}/seed-{s}/times.txt")) for s in seeds}
def cell(values, fmt="{:.3f}"):
    """mean ± sample standard deviation [min, max] over the seeds."""
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return (fmt + " ± " + fmt + " [" + fmt + ", " + fmt + "]").format(statistics.mean(values), sd, min(values), max(values))
print(f"seeds: {' / '.join(seeds)}; mean ± sd [min, max] over the seeds")
print("| actor | task score, held-out phrasings | per seed | gain over SFT | held-out countries | per seed | gain over SFT | reward-model score | KL to SFT (nats) | answer length | wall time (s) |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for name in ["sft", "ppo", "grpo", "rloo", "reinforce_pp", "dpo"]:
    if any(name not in evals[s] for s in seeds):
        continue
    rows = [evals[s][name] for s in seeds]
    sft = [evals[s]["sft"] for s in seeds]
    task = [r["task_success"] for r in rows]
    countries = [r["heldout_country_task_success"] for r in rows]
    gain = [r["task_success"] - b["task_success"] for r, b in zip(rows, sft)]
    countries_gain = [r["heldout_country_task_success"] - b["heldout_country_task_success"] for r, b in zip(rows, sft)]
    wall = [float(times[s].get(name if name != "sft" else "sft+rm", "nan")) for s in seeds]
    per_seed = lambda v: " / ".join(f"{t:.3f}" for t in v)
    print(f"| {name} | {cell(task)} | {per_seed(task)} | {cell(gain) if name != 'sft' else ''} | "
          f"{cell(countries)} | {per_seed(countries)} | {cell(countries_gain) if name != 'sft' else ''} | "
          f"{cell([r['reward_mean'] for r in rows])} | {cell([r['kl_to_reference'] for r in rows])} | "
          f"{cell([r['answer_len_mean'] for r in rows], '{:.1f}')} | {cell(wall, '{:.0f}')} |")
PY
