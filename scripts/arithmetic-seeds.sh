#!/usr/bin/env bash
# The arithmetic task over seeds (docs/RLHF-INVESTIGATION.md, section 18c): for each seed,
# `train --task arithmetic` (step 1, then GRPO), then step 3 again as RLOO and REINFORCE++ on the
# same SFT actor; each run's summary line (task score on the 89 held-out phrasings, SFT -> RL,
# and the KL to SFT) and the greedy answers to the 11 held-out pairs (`prompt_eval --prompts
# arithmetic`: operand pairs no row holds), then mean, sample standard deviation and range over
# the seeds.
# Usage: scripts/arithmetic-seeds.sh [OUT_DIR] [SEED...]   (default: arithmetic-seeds, seeds 11-15)
# Needs `cargo build --release` first; python3 for the summary.
set -euo pipefail
OUT=${1:-arithmetic-seeds}
shift || true
if [ $# -gt 0 ]; then SEEDS=("$@"); else SEEDS=(11 12 13 14 15); fi
BIN="$(cd "$(dirname -- "$0")/.." && pwd)/target/release"
mkdir -p "$OUT"
LINES="$OUT/summary-lines.txt"
: > "$LINES"
for seed in "${SEEDS[@]}"; do
  dir="$OUT/seed-$seed"
  for alg in grpo rloo reinforce_pp; do
    # GRPO runs steps 1 and 3; the others step 3 alone, on GRPO's SFT actor.
    steps=(--step 3 --algorithm "$alg")
    [ "$alg" = grpo ] && steps=()
    t0=$(date +%s)
    rc=0
    "$BIN/train" --task arithmetic --seed "$seed" --output-dir "$dir" "${steps[@]}" > "$dir-$alg.log" 2>&1 || rc=$?
    wall=$(( $(date +%s) - t0 ))
    # The launcher always writes OUT/step3.
    if [ -d "$dir/step3" ]; then rm -rf "$dir/step3-$alg"; mv "$dir/step3" "$dir/step3-$alg"; fi
    summary=$(grep -m1 '^held-out prompts.*SFT actor' "$dir-$alg.log" || echo "no summary line")
    echo "seed $seed $alg (rc $rc, process wall $wall s): $summary" | tee -a "$LINES"
    "$BIN/prompt_eval" --model-name-or-path-baseline "$dir/actor" --model-name-or-path-finetune "$dir/step3-$alg/actor" \
      --prompts arithmetic --num-prompts 11 --max-new-tokens 4 > "$OUT/pairs-$seed-$alg.txt" 2>&1
  done
done
python3 - "$LINES" "$OUT" <<'PY'
import re, statistics, sys
lines, out = sys.argv[1], sys.argv[2]
def pairs_right(path):
    """(SFT right, RL right) on prompt_eval's greedy answers to the held-out pairs: right when the
    answer's only number is the sum (builtin:arithmetic's rule)."""
    right = lambda q, answer: re.findall(r"\d+", answer) == [str(sum(map(int, re.findall(r"\d+", q))))]
    sft = rl = 0
    for block in open(path).read().split("==========prompt=========")[1:]:
        question, rest = block.split("==========baseline========")
        baseline, finetuned = rest.split("==========finetuned=======")
        question = question.split("Human:")[1].split("Assistant:")[0]
        sft += right(question, baseline.strip().splitlines()[0])
        rl += right(question, finetuned.strip().splitlines()[0])
    return sft, rl
runs = {}
for line in open(lines):
    # The launcher's summary ("SFT actor 0.652 -> GRPO actor 0.989; KL to SFT 0.374 nats") or
    # step 3's own line ("SFT 0.652 -> GRPO 0.989; answer length ...; KL to SFT 0.374 nats").
    m = re.match(r"seed (\d+) (\w+) .*task score SFT(?: actor)? ([\d.]+) -> \S+(?: actor)? ([\d.]+);.*KL to SFT ([\d.]+)", line)
    if m:
        pairs = pairs_right(f"{out}/pairs-{m[1]}-{m[2]}.txt")
        runs.setdefault(m[2], []).append((m[1], *(float(x) for x in m.group(3, 4, 5)), *pairs))
def cell(values):
    """mean ± sample standard deviation [min, max]."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f} [{min(values):.3f}, {max(values):.3f}]"
names = {"grpo": "GRPO", "rloo": "RLOO", "reinforce_pp": "REINFORCE++"}
for alg, rows in runs.items():
    seeds, sft, rl, kl, pairs_sft, pairs_rl = zip(*rows)
    gain = [b - a for a, b in zip(sft, rl)]
    per_seed = " / ".join(f"{a:.3f} -> {b:.3f}" for a, b in zip(sft, rl))
    pairs = " / ".join(f"{a} -> {b}" for a, b in zip(pairs_sft, pairs_rl))
    print(f"{names.get(alg, alg)} (n={len(rows)}, seeds {' / '.join(seeds)}): SFT {cell(sft)} -> RL {cell(rl)}; "
          f"improvement {cell(gain)}; KL {cell(kl)}; every seed >= +0.15: {all(g >= 0.15 for g in gain)}")
    print(f"  held-out phrasings per seed: {per_seed}")
    print(f"  held-out pairs right (of 11) per seed: {pairs}; mean SFT {statistics.mean(pairs_sft):.1f} -> RL {statistics.mean(pairs_rl):.1f}")
PY
