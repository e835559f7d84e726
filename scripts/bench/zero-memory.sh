#!/usr/bin/env bash
# Per-rank memory and communication of ZeRO stages 0-3 (BENCHMARKS.md, "ZeRO on CPU ranks"):
# pretrains GPT-2 small (124M) for a few iterations as 2 rank processes on this machine at each
# stage and prints, per stage, the memory plan's per-rank model states (DeepSpeed's accounting)
# and its total (with the activations of a micro-batch), each rank's measured peak RSS over
# training and the largest against the plan's total, the saving against stage 0 (measured and
# predicted), and the bytes and time the ranks spent communicating.
# Usage: scripts/bench/zero-memory.sh [ITERATIONS] [RANKS]   (after cargo build --release)
# Environment: DTYPE (fp32), STAGES ("0 1 2 3"), EXTRA (more flags, e.g. "--reduce-bucket-size
# 5000000"), SEQ (128), MICRO (2), MODEL (gpt2; or tiny, ...), TRAIN (the binary: another build
# to compare with).
set -euo pipefail
ITERS=${1:-3}
RANKS=${2:-2}
DTYPE=${DTYPE:-fp32}
STAGES=${STAGES:-0 1 2 3}
EXTRA=${EXTRA:-}
SEQ=${SEQ:-128}
MICRO=${MICRO:-2}
MODEL=${MODEL:-gpt2}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
TRAIN=${TRAIN:-$ROOT/target/release/train}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
ln -s "$TRAIN" "$WORK/sft"
for STAGE in $STAGES; do
  # shellcheck disable=SC2086 # EXTRA is words
  RLHF_NPROC_PER_NODE=$RANKS RLHF_RANK_LOG_DIR="$WORK/logs-$STAGE" "$WORK/sft" --from-scratch --model "$MODEL" \
    --seq-length "$SEQ" --micro-batch-size "$MICRO" --train-iters "$ITERS" --eval-interval 0 --eval-iters 1 \
    --log-interval 1 --device cpu --dtype "$DTYPE" --zero-stage "$STAGE" $EXTRA --output-dir "$WORK/out-$STAGE" >"$WORK/stdout-$STAGE" 2>&1 \
    || { cat "$WORK/stdout-$STAGE"; exit 1; }
done
python3 - "$WORK" "$RANKS" "$ITERS" $STAGES <<'PY'
import re, sys, pathlib
work, ranks, iters = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rows = {}
for stage in map(int, sys.argv[4:]):
    log0 = (work / f"logs-{stage}" / "rank-0.log").read_text()
    plan = re.search(r"model states ([\d.]+) MiB", log0)
    total = float(re.search(r"estimated total ([\d.]+) MiB", log0)[1])
    peaks, comm, share = [], [], []
    for r in range(ranks):
        line = re.search(r"peak memory in training \(RSS\) ([\d.]+) MiB \| communication: ([\d.]+) MiB sent in \d+ collectives, [\d.]+ s = ([\d.]+)%",
                         (work / f"logs-{stage}" / f"rank-{r}.log").read_text())
        peaks.append(float(line[1])); comm.append(float(line[2])); share.append(float(line[3]))
    ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", (work / f"logs-{stage}" / "rank-0.log").read_text())]
    ms = ms[1:] or ms  # the first iteration also pays for warming up the allocator
    rows[stage] = (float(plan[1]), peaks, sum(comm) / ranks / iters, sum(share) / ranks, sum(ms) / len(ms), total)
print(f"| stage | model states per rank, plan (MiB) | plan's total (MiB) | peak RSS per rank, measured (MiB) | largest peak / plan's total | saving vs stage {min(rows)}: measured / plan (MiB) | sent per rank per iteration (MiB) | ms per iteration | time communicating |")
print("|---|---|---|---|---|---|---|---|---|")
base = rows[min(rows)]
for stage, (plan, peaks, comm, share, ms, total) in rows.items():
    saved_plan = base[0] - plan
    saved = max(base[1]) - max(peaks)
    ratio = f" ({saved / saved_plan:.2f}x)" if saved_plan > 0 else ""
    print(f"| {stage} | {plan:.0f} | {total:.0f} | {' / '.join(f'{p:.0f}' for p in peaks)} | {max(peaks) / total:.2f} | {saved:.0f} / {saved_plan:.0f}{ratio} | {comm:.0f} | {ms:.0f} | {share:.1f}% |")
PY
