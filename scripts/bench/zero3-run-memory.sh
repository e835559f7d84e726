#!/usr/bin/env bash
# Per-rank peak memory of a whole pretraining run of GPT-2 small (124M, fp32, 64-token blocks):
# load a checkpoint, train, save one, as a user's run does. One rank at ZeRO-0 (micro-batch 4)
# against 2 and 4 ranks at ZeRO-3 (micro-batches 2 and 1: the same global batch), each rank
# started by hand with torchrun's variables under /usr/bin/time (its peak RSS, start to exit).
# Prints each run's per-rank peaks, their ratio to the one-rank run's, and ZeRO's model states
# (16 bytes a parameter over the ranks) for comparison.
# Usage: scripts/bench/zero3-run-memory.sh [ITERATIONS]   (after cargo build --release)
# Environment: EXTRA (more flags for every run, e.g. "--reduce-bucket-size 5000000").
set -euo pipefail
ITERS=${1:-2}
EXTRA=${EXTRA:-}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SFT=${SFT:-$ROOT/target/release/sft}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
COMMON=(--from-scratch --model gpt2 --seq-length 64 --eval-interval 0 --eval-iters 1 --log-interval 1
  --device cpu --dist-timeout 900)
# The checkpoint every run loads: one iteration of one rank.
"$SFT" "${COMMON[@]}" --train-iters 1 --micro-batch-size 4 --save "$WORK/start" --output-dir "$WORK/o" \
  >"$WORK/start.log" 2>&1 || { cat "$WORK/start.log"; exit 1; }
run() { # name ranks stage micro-batch
  local port
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  for ((r = 0; r < $2; r++)); do
    # shellcheck disable=SC2086 # EXTRA is words
    RANK=$r WORLD_SIZE=$2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=$2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      RAYON_NUM_THREADS=$(( $(nproc) / $2 > 0 ? $(nproc) / $2 : 1 )) \
      /usr/bin/time -f %M -o "$WORK/$1-$r.rss" "$SFT" "${COMMON[@]}" --load "$WORK/start" --save "$WORK/$1" \
      --train-iters $((1 + ITERS)) --zero-stage "$3" --micro-batch-size "$4" --output-dir "$WORK/out-$1" $EXTRA \
      >"$WORK/$1-$r.log" 2>&1 &
  done
  wait
}
run one 1 0 4
run two 2 3 2
run four 4 3 1
python3 - "$WORK" <<'PY'
import pathlib, re, sys
work = pathlib.Path(sys.argv[1])
params = float(re.search(r"parameters: ([\d.]+)M", (work / "one-0.log").read_text())[1]) * 1e6
def peaks(name, ranks):
    return [int((work / f"{name}-{r}.rss").read_text().split()[-1]) / 1024 for r in range(ranks)]
def training(name, ranks):
    logs = [(work / f"{name}-{r}.log").read_text() for r in range(ranks)]
    return [float(re.search(r"peak memory in training \(RSS\):? ([\d.]+) MiB", log)[1]) for log in logs]
def plan_and_ms(name):
    log = (work / f"{name}-0.log").read_text()
    ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", log)][1:]
    return float(re.search(r"estimated total ([\d.]+) MiB", log)[1]), sum(ms) / max(len(ms), 1)
def comm_share(name, ranks):
    logs = [(work / f"{name}-{r}.log").read_text() for r in range(ranks)]
    shares = [re.search(r"communication: .* = ([\d.]+)% of", log) for log in logs]
    return " / ".join(f"{float(m[1]):.0f}%" for m in shares if m) or "-"
one = peaks("one", 1)[0]
print("| run | peak RSS per rank, load + train + save (MiB) | / one rank | of which in training (MiB) | memory plan (MiB) | ZeRO's model states per rank (MiB) | ms per iteration | communication's share of training time |")
print("|---|---|---|---|---|---|---|---|")
for name, ranks, stage in [("one", 1, 0), ("two", 2, 3), ("four", 4, 3)]:
    p, t = peaks(name, ranks), training(name, ranks)
    states = 16 * params / ranks / 2**20
    plan, ms = plan_and_ms(name)
    print(f"| {ranks} rank(s), ZeRO-{stage} | {' / '.join(f'{x:.0f}' for x in p)} | {max(p) / one:.2f}x | {' / '.join(f'{x:.0f}' for x in t)} | {plan:.0f} | {states:.0f} | {ms:.0f} | {comm_share(name, ranks)} |")
PY
