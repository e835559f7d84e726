#!/usr/bin/env bash
# CPU benchmark of our GPT-2 (hybrid-engine, candle) against Hugging Face transformers (PyTorch
# eager): builds `hybrid-engine/examples/bench.rs` in release, runs each configuration below with
# both implementations, one process per configuration and implementation (so peak RSS is per
# configuration), prints a Markdown table and appends it, with the machine and versions, to
# BENCHMARKS.md. Takes ~20 minutes on 2 cores; run it on a quiet machine.
#
# Usage: scripts/bench/run.sh [--smoke] [--out FILE]
#   --smoke     tiny configurations only, 1 warmup + 2 steps: checks the scripts (~1 minute);
#               appends nothing unless --out is given.
#   --out FILE  where to append the results (default BENCHMARKS.md at the repository root).
# The build honours CARGO_TARGET_DIR.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
INVOCATION="scripts/bench/run.sh${*:+ $*}"

SMOKE=0
OUT=BENCHMARKS.md
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1; OUT=""; shift ;;
    --out) OUT=${2:?--out needs a file}; shift 2 ;;
    *) echo "error: unknown argument $1 (usage: scripts/bench/run.sh [--smoke] [--out FILE])" >&2; exit 2 ;;
  esac
done

# One configuration per line: a label, then the arguments both bench programs take.
if [ "$SMOKE" = 1 ]; then
  CONFIGS=(
    "train tiny B8 T128|train --model tiny --batch 8 --seq 128 --warmup 1 --steps 2"
    "train tiny B8 T128 ckpt|train --model tiny --batch 8 --seq 128 --warmup 1 --steps 2 --checkpoint-activations"
    "generate tiny B1 P16+64|generate --model tiny --batch 1 --prompt-len 16 --new-tokens 64 --warmup 1 --reps 1"
    "generate tiny B8 P16+64|generate --model tiny --batch 8 --prompt-len 16 --new-tokens 64 --warmup 1 --reps 1"
  )
else
  CONFIGS=(
    "train tiny B8 T128|train --model tiny --batch 8 --seq 128 --warmup 3 --steps 10"
    "train gpt2 B4 T128|train --model gpt2 --batch 4 --seq 128 --warmup 2 --steps 5"
    "train gpt2 B1 T512|train --model gpt2 --batch 1 --seq 512 --warmup 2 --steps 5"
    "train gpt2 B1 T512 ckpt|train --model gpt2 --batch 1 --seq 512 --warmup 2 --steps 5 --checkpoint-activations"
    "generate tiny B1 P16+64|generate --model tiny --batch 1 --prompt-len 16 --new-tokens 64 --warmup 1 --reps 5"
    "generate tiny B8 P16+64|generate --model tiny --batch 8 --prompt-len 16 --new-tokens 64 --warmup 1 --reps 5"
    "generate gpt2 B1 P16+64|generate --model gpt2 --batch 1 --prompt-len 16 --new-tokens 64 --warmup 1 --reps 3"
    "generate gpt2 B8 P16+64|generate --model gpt2 --batch 8 --prompt-len 16 --new-tokens 64 --warmup 1 --reps 3"
  )
fi

echo "building the bench example (release)..." >&2
cargo build --release --quiet -p hybrid-engine --example bench
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
case "$TARGET" in /*) ;; *) TARGET="$ROOT/$TARGET" ;; esac
BIN="$TARGET/release/examples/bench"
HF=(python3 scripts/bench/hf_bench.py)

RESULTS=$(mktemp)
trap 'rm -f "$RESULTS"' EXIT
START=$(date +%s)
for entry in "${CONFIGS[@]}"; do
  label=${entry%%|*}
  read -r -a args <<<"${entry#*|}"
  for impl in ours hf; do
    echo "[$(( $(date +%s) - START ))s] $label: $impl" >&2
    if [ "$impl" = ours ]; then cmd=("$BIN" "${args[@]}"); else cmd=("${HF[@]}" "${args[@]}"); fi
    # A failed run (e.g. out of memory) is recorded and the benchmark goes on.
    if line=$("${cmd[@]}" | tail -n 1) && [ -n "$line" ]; then
      echo "$line" >&2
    else
      echo "FAILED: ${cmd[*]}" >&2
      line='{"failed": true}'
    fi
    printf '%s\t%s\t%s\t%s\n' "$label" "$impl" "${entry#*|}" "$line" >>"$RESULTS"
  done
done
ELAPSED=$(( $(date +%s) - START ))

TABLE=$(python3 - "$RESULTS" <<'EOF'
import json, sys
rows = {}
for line in open(sys.argv[1]):
    label, impl, args, result = line.rstrip("\n").split("\t", 3)
    rows.setdefault(label, {"args": args})[impl] = json.loads(result)
def num(r, key, fmt):
    return "failed" if r.get("failed") else format(r[key], fmt)
print("| Configuration | Ours tokens/s | HF tokens/s | Ours / HF | Ours peak RSS MiB | HF peak RSS MiB |")
print("|---|---:|---:|---:|---:|---:|")
for label, r in rows.items():
    ours, hf = r["ours"], r["hf"]
    ok = not (ours.get("failed") or hf.get("failed"))
    ratio = f"{ours['tokens_per_s'] / hf['tokens_per_s']:.2f}" if ok else "n/a"
    print(f"| {label} | {num(ours, 'tokens_per_s', '.1f')} | {num(hf, 'tokens_per_s', '.1f')} | "
          f"{ratio} | {num(ours, 'peak_rss_mib', '.0f')} | {num(hf, 'peak_rss_mib', '.0f')} |")
print()
print("Arguments of each row (given to both `bench` and `hf_bench.py`):")
print()
for label, r in rows.items():
    print(f"- {label}: `{r['args']}`")
EOF
)

CPU=$(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -n 1)
CORES=$(nproc)
RUSTC=$(rustc --version)
PYVERS=$(python3 -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")')
REPORT="## $(date -u '+%Y-%m-%d %H:%M UTC'): CPU training and generation throughput

- Machine: ${CPU}, ${CORES} cores (\`nproc\`); threads: candle's default (all cores), \`torch.set_num_threads(${CORES})\`.
- Versions: ${RUSTC}; ${PYVERS}; git $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (dirty tree)').
- Command: \`${INVOCATION}\` (took ${ELAPSED} s).
- Both sides: float32, random init, vocabulary padded to 50304, random token ids. Training:
  median step time (forward with dropout 0.1, backward, clip to norm 1.0, AdamW), tokens/s =
  B*T / step. Generation: greedy, KV cache, 16-token prompts, 64 new tokens per row (EOS
  disabled), tokens/s = B*64 / call, prefill included. Peak RSS: whole process (HF includes the
  Python interpreter, torch and transformers).

${TABLE}
"

echo
echo "$REPORT"
if [ -n "$OUT" ]; then
  if [ ! -f "$OUT" ]; then
    printf '%s\n\n%s\n\n' "# Benchmarks" \
      "Measurements appended by \`scripts/bench/run.sh\` (our Rust engine vs Hugging Face transformers on the same machine); newest last." >"$OUT"
  fi
  printf '%s\n' "$REPORT" >>"$OUT"
  echo "appended to $OUT" >&2
fi
