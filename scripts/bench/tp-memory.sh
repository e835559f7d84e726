#!/usr/bin/env bash
# Per-rank memory and communication of tensor parallelism (BENCHMARKS.md, "Tensor parallelism on
# CPU ranks"): pretrains GPT-2 medium (355M) for a few iterations as T rank processes on this
# machine, one TP group of T (T = 1, 2, 4), and prints per T the memory plan's per-rank model
# states and total, each rank's measured peak RSS over training, and the bytes each rank sent
# per step inside its TP group.
# Usage: scripts/bench/tp-memory.sh [ITERATIONS] [MODEL] [SIZES]   (after cargo build --release)
set -euo pipefail
ITERS=${1:-2}
MODEL=${2:-gpt2-medium}
SIZES=${3:-"1 2 4"}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
TRAIN=${TRAIN:-$ROOT/target/release/train}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
ln -s "$TRAIN" "$WORK/sft"
for T in $SIZES; do
  RLHF_NPROC_PER_NODE=$T RLHF_RANK_LOG_DIR="$WORK/logs-$T" "$WORK/sft" --from-scratch --model "$MODEL" \
    --seq-length 128 --micro-batch-size 1 --train-iters "$ITERS" --eval-interval 0 --eval-iters 1 \
    --log-interval 1 --device cpu --tensor-model-parallel-size "$T" --output-dir "$WORK/out-$T" \
    >"$WORK/stdout-$T" 2>&1 || { cat "$WORK/stdout-$T"; exit 1; }
  rm -rf "$WORK/out-$T"
done
python3 - "$WORK" "$SIZES" <<'PY'
import re, sys, pathlib
work, sizes = pathlib.Path(sys.argv[1]), [int(t) for t in sys.argv[2].split()]
print("| T | parameters per rank | model states per rank, plan (MiB) | total per rank, plan (MiB) | peak RSS per rank, measured (MiB) | TP traffic per rank per step (MiB) | ms per iteration |")
print("|---|---|---|---|---|---|---|")
for t in sizes:
    logs = [(work / f"logs-{t}" / f"rank-{r}.log").read_text() for r in range(t)] if t > 1 else [(work / f"stdout-{t}").read_text()]
    log0 = logs[0]
    total = float(re.search(r"estimated total ([\d.]+) MiB", log0)[1])
    states = sum(float(re.search(rf"allocating ([\d.]+) MiB for {w}", log0)[1]) for w in ["parameters", "gradients", "AdamW"])
    held = re.search(r"([\d.]+)M parameters per rank", log0)
    held = held[1] + "M" if held else re.search(r"parameters: ([\d.]+M)", log0)[1]
    peaks = [float(re.search(r"peak memory in training \(RSS\):? ([\d.]+) MiB", l)[1]) for l in logs]
    tp = re.search(r"tensor parallel ([\d.]+) MiB", log0)
    ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", log0)]
    ms = ms[1:] or ms
    print(f"| {t} | {held} | {states:.0f} | {total:.0f} | {' / '.join(f'{p:.0f}' for p in peaks)} | {tp[1] if tp else '-'} | {sum(ms)/len(ms):.0f} |")
PY
