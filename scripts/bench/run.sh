#!/usr/bin/env bash
# CPU benchmark of our GPT-2 (hybrid-engine, candle) against Hugging Face transformers (PyTorch
# eager): builds `hybrid-engine/examples/bench.rs` in release, runs each configuration below with
# both implementations, one process per configuration and implementation (so peak RSS is per
# configuration), prints a Markdown table and appends it, with the machine and versions, to
# BENCHMARKS.md: train-step tokens/s and MFU (against the machine's measured f32 matmul peak,
# the larger of candle's and torch's) for tiny, gpt2 and gpt2-medium, and generation tokens/s
# at batch 1 and 32 with 128 new tokens. Takes ~15-30 minutes on 2 cores; run it on a quiet
# machine.
#
# Usage: scripts/bench/run.sh [--smoke] [--out FILE] [--device cuda[:N]]
#   --smoke     tiny configurations only, 1 warmup + 2 steps: checks the scripts (~1 minute);
#               appends nothing unless --out is given.
#   --out FILE  where to append the results (default BENCHMARKS.md at the repository root).
#   --device D  run both sides on D (default cpu): the GPU table. On a GPU machine without a Rust
#               toolchain, set BENCH_BIN to a prebuilt `bench` (scripts/package-gpu.sh packs one,
#               built with --features cuda, and this script beside it).
# The build honours CARGO_TARGET_DIR; with BENCH_BIN set nothing is built.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
INVOCATION="scripts/bench/run.sh${*:+ $*}"

SMOKE=0
OUT=BENCHMARKS.md
DEVICE=cpu
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1; OUT=""; shift ;;
    --out) OUT=${2:?--out needs a file}; shift 2 ;;
    --device) DEVICE=${2:?--device needs cpu, cuda or cuda:N}; shift 2 ;;
    *) echo "error: unknown argument $1 (usage: scripts/bench/run.sh [--smoke] [--out FILE] [--device D])" >&2; exit 2 ;;
  esac
done

# One configuration per line: a label, then the arguments both bench programs take.
if [ "$SMOKE" = 1 ]; then
  PEAK_ARGS="peak --size 512 --reps 2"
  CONFIGS=(
    "train tiny B8 T128|train --model tiny --batch 8 --seq 128 --warmup 1 --steps 2"
    "train tiny B8 T128 ckpt|train --model tiny --batch 8 --seq 128 --warmup 1 --steps 2 --checkpoint-activations"
    "generate tiny B1 P16+128|generate --model tiny --batch 1 --prompt-len 16 --new-tokens 128 --warmup 1 --reps 1"
    "generate tiny B32 P16+128|generate --model tiny --batch 32 --prompt-len 16 --new-tokens 128 --warmup 1 --reps 1"
  )
else
  PEAK_ARGS="peak --size 2048 --reps 10"
  CONFIGS=(
    "train tiny B8 T128|train --model tiny --batch 8 --seq 128 --warmup 2 --steps 8"
    "train gpt2 B4 T128|train --model gpt2 --batch 4 --seq 128 --warmup 1 --steps 4"
    "train gpt2 B1 T512|train --model gpt2 --batch 1 --seq 512 --warmup 1 --steps 4"
    "train gpt2 B1 T512 ckpt|train --model gpt2 --batch 1 --seq 512 --warmup 1 --steps 4 --checkpoint-activations"
    "train gpt2-medium B1 T128|train --model gpt2-medium --batch 1 --seq 128 --warmup 1 --steps 3"
    "generate tiny B1 P16+128|generate --model tiny --batch 1 --prompt-len 16 --new-tokens 128 --warmup 1 --reps 3"
    "generate tiny B32 P16+128|generate --model tiny --batch 32 --prompt-len 16 --new-tokens 128 --warmup 1 --reps 3"
    "generate gpt2 B1 P16+128|generate --model gpt2 --batch 1 --prompt-len 16 --new-tokens 128 --warmup 1 --reps 2"
    "generate gpt2 B32 P16+128|generate --model gpt2 --batch 32 --prompt-len 16 --new-tokens 128 --warmup 1 --reps 2"
    "generate gpt2-medium B1 P16+128|generate --model gpt2-medium --batch 1 --prompt-len 16 --new-tokens 128 --warmup 1 --reps 2"
  )
fi

if [ -n "${BENCH_BIN:-}" ]; then
  BIN=$BENCH_BIN
else
  echo "building the bench example (release)..." >&2
  cargo build --release --quiet -p hybrid-engine --example bench
  TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
  case "$TARGET" in /*) ;; *) TARGET="$ROOT/$TARGET" ;; esac
  BIN="$TARGET/release/examples/bench"
fi
HF=(python3 scripts/bench/hf_bench.py)

RESULTS=$(mktemp)
trap 'rm -f "$RESULTS"' EXIT
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
START=$(date +%s)
# The machine's measured peak first: an f32 matmul on each side (same arguments).
for entry in "peak|$PEAK_ARGS" "${CONFIGS[@]}"; do
  label=${entry%%|*}
  read -r -a args <<<"${entry#*|} --device $DEVICE"
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
LOAD_AFTER=$(cut -d' ' -f1-3 /proc/loadavg)

TABLE=$(python3 - "$RESULTS" <<'EOF'
import json, sys
rows = {}
for line in open(sys.argv[1]):
    label, impl, args, result = line.rstrip("\n").split("\t", 3)
    rows.setdefault(label, {"args": args})[impl] = json.loads(result)
peak_row = rows.pop("peak")
peaks = {impl: peak_row[impl].get("gflops_best") for impl in ("ours", "hf")}
known = [p for p in peaks.values() if p]
peak = max(known) if known else None
def fmt(r, key, spec):
    return "failed" if r.get("failed") else format(r[key], spec)
def mfu(r):
    if r.get("failed") or "flops_per_token" not in r or not peak:
        return "-"
    return f"{100 * r['tokens_per_s'] * r['flops_per_token'] / (peak * 1e9):.1f}%"
def show(p):
    return f"{p:.1f}" if p else "failed"
print(f"Measured peak (f32 matmul, best of the reps): ours (candle/gemm) {show(peaks['ours'])} GFLOP/s, "
      f"PyTorch {show(peaks['hf'])} GFLOP/s; MFU is against the larger, {show(peak)} GFLOP/s.")
print()
print("| Configuration | Ours tokens/s | HF tokens/s | Ours / HF | Ours MFU | HF MFU | Ours peak RSS MiB | HF peak RSS MiB |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for label, r in rows.items():
    ours, hf = r["ours"], r["hf"]
    ok = not (ours.get("failed") or hf.get("failed"))
    ratio = f"{ours['tokens_per_s'] / hf['tokens_per_s']:.2f}" if ok else "n/a"
    print(f"| {label} | {fmt(ours, 'tokens_per_s', '.1f')} | {fmt(hf, 'tokens_per_s', '.1f')} | {ratio} | "
          f"{mfu(ours)} | {mfu(hf)} | {fmt(ours, 'peak_rss_mib', '.0f')} | {fmt(hf, 'peak_rss_mib', '.0f')} |")
print()
print("Training step phases, medians in ms (forward+backward / optimizer: norm, clip, AdamW):")
print()
for label, r in rows.items():
    ours, hf = r["ours"], r["hf"]
    if label.startswith("train") and not (ours.get("failed") or hf.get("failed")):
        def ph(x):
            return f"{x['ms_forward_backward']:.0f} / {x['ms_optimizer']:.0f}"
        print(f"- {label}: ours {ph(ours)}, HF {ph(hf)}")
print()
print("Arguments of each row (given to both `bench` and `hf_bench.py`):")
print()
print(f"- peak: `{peak_row['args']}`")
for label, r in rows.items():
    print(f"- {label}: `{r['args']}`")
EOF
)

CPU=$(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -n 1)
CORES=$(nproc)
RUSTC=$(rustc --version 2>/dev/null || echo "prebuilt $(basename "$BIN")")
if [ "$DEVICE" = cpu ]; then
  WHERE=CPU
  GPU_LINE=""
else
  WHERE=GPU
  GPU_LINE="
- GPU (\`--device $DEVICE\` on both sides): $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1 || echo unknown)."
fi
PYVERS=$(python3 -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")')
REPORT="## $(date -u '+%Y-%m-%d %H:%M UTC'): ${WHERE} training and generation throughput

- Machine: ${CPU}, ${CORES} cores (\`nproc\`); threads: candle's default (all cores), \`torch.set_num_threads(${CORES})\`.${GPU_LINE}
- Versions: ${RUSTC}; ${PYVERS}; git $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (dirty tree)').
- Command: \`${INVOCATION}\` (took ${ELAPSED} s); load average (1, 5, 15 min) before
  ${LOAD_BEFORE}, after ${LOAD_AFTER} (other processes may have shared the cores).
- Both sides: float32, random init, vocabulary padded to 50304, random token ids. Training:
  median step time (forward with dropout 0.1, backward, clip to norm 1.0, AdamW), tokens/s =
  B*T / step. MFU = tokens/s x model FLOPs per token / the measured peak below, with FLOPs per
  token = 6N + 12*L*H*Q*T (PaLM appendix B, nanoGPT's estimate_mfu; N = all parameters but the
  position embedding, the tied token embedding counting as the LM head; T the sequence length).
  Generation: greedy, KV cache, 16-token prompts, 128 new tokens per row (EOS disabled),
  tokens/s = B*128 / call, prefill included. Peak RSS: whole process (HF includes the Python
  interpreter, torch and transformers).

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
