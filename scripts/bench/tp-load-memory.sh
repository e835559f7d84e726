#!/usr/bin/env bash
# Peak memory of a tensor-parallel rank that loads a model: `chat --prompt` on GPT-2 medium
# (355M, fp32 safetensors) whole, and split over 2 and 4 ranks (--tensor-model-parallel-size),
# under /usr/bin/time (its peak RSS: the largest of the command and the ranks it starts).
# Prints the peaks, their ratio to the whole model's, and the weights' share per rank.
# Usage: scripts/bench/tp-load-memory.sh   (after cargo build --release --workspace)
# CHAT=path/to/another/chat measures another build on the same model.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${BIN:-$ROOT/target/release}
CHAT=${CHAT:-$BIN/chat}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# The model: one pretraining iteration of GPT-2 medium from random weights, saved as a checkpoint.
"$BIN/sft" --from-scratch --model gpt2-medium --seq-length 16 --train-iters 1 --micro-batch-size 1 \
  --eval-interval 0 --eval-iters 1 --device cpu --save "$WORK/model" --output-dir "$WORK/o" >"$WORK/model.log" 2>&1 \
  || { cat "$WORK/model.log"; exit 1; }
for size in 1 2 4; do
  /usr/bin/time -f "%M %e" -o "$WORK/tp$size.rss" "$CHAT" --path "$WORK/model" --prompt "Hello there" --greedy \
    --max-new-tokens 4 --device cpu --tensor-model-parallel-size $size >"$WORK/tp$size.log" 2>&1 \
    || { cat "$WORK/tp$size.log"; exit 1; }
done
python3 - "$WORK" <<'PY'
import pathlib, sys
work = pathlib.Path(sys.argv[1])
weights = (work / "model").glob("iter_*/model.safetensors")
mib = next(weights).stat().st_size / 2**20
rows = {s: (work / f"tp{s}.rss").read_text().split() for s in (1, 2, 4)}
whole = int(rows[1][0]) / 1024
print("| ranks | peak RSS of a rank (MiB) | / whole | the weights' share per rank (MiB) | seconds |")
print("|---|---|---|---|---|")
for s, (kib, secs) in rows.items():
    print(f"| {s} | {int(kib) / 1024:.0f} | {int(kib) / 1024 / whole:.2f}x | {mib / s:.0f} | {float(secs):.1f} |")
PY
