#!/usr/bin/env bash
# Checks a CUDA build on a machine without a GPU, on the stub libraries of cuda-build-env.sh:
# `--device cuda` is one `error:` line and exit code 2 (no panic), and `--device auto` falls back
# to the CPU with one note and trains. Needs CUDA_STUBS (source scripts/cuda-build-env.sh first).
# Usage: scripts/cuda-smoke.sh [BIN_DIR]   (default: $CARGO_TARGET_DIR/release or target/release)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin=${1:-${CARGO_TARGET_DIR:-$root/target}/release}
: "${CUDA_STUBS:?source scripts/cuda-build-env.sh first}"
# The stubs (driver, cuBLAS, cuRAND, ...) and the toolchain's real libcudart.so.13.
export LD_LIBRARY_PATH=$CUDA_STUBS:$CUDA_HOME/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "cuda-smoke: $*" >&2; exit 1; }

# --device cuda / cuda:N, for each kind of binary: one error line naming the way out, exit 2.
expect_one_line_error() { # label, command...
  local label=$1 rc=0 err
  shift
  "$@" >"$tmp/stdout" 2>"$tmp/stderr" || rc=$?
  err=$(cat "$tmp/stderr")
  echo "$label: exit $rc: $err"
  [ "$rc" = 2 ] || fail "$label: exit code $rc, want 2"
  [ "$(wc -l <"$tmp/stderr")" = 1 ] || fail "$label: want one line on stderr"
  grep -q -- '--device cpu' <<<"$err" || fail "$label: the error does not say to use --device cpu"
  ! grep -qi panick <<<"$err" || fail "$label: panicked"
}
ln -s "$bin/train" "$tmp/ppo" # train is ppo under that name
expect_one_line_error "sft --device cuda" "$bin/sft" --device cuda --output-dir "$tmp/out"
expect_one_line_error "ppo --device cuda:1" "$tmp/ppo" --device cuda:1 --output-dir "$tmp/out"
expect_one_line_error "chat --device cuda" "$bin/chat" --path "$tmp" --device cuda
expect_one_line_error "train --device cuda" "$bin/train" --step 1 --device cuda --output-dir "$tmp/out"

# --device auto: a note, then a short pretraining run on the CPU.
"$bin/sft" --from-scratch --model tiny --seq-length 32 --micro-batch-size 2 --train-iters 2 \
  --eval-interval 2 --eval-iters 1 --log-interval 1 --output-dir "$tmp/auto" --device auto \
  >"$tmp/stdout" 2>"$tmp/stderr" || fail "sft --device auto failed: $(cat "$tmp/stderr")"
grep -q '^note: --device auto: .*running on the CPU' "$tmp/stderr" || fail "no fallback note: $(cat "$tmp/stderr")"
grep -q '^device: cpu$' "$tmp/stdout" || fail "sft --device auto did not run on the CPU"
echo "sft --device auto: $(cat "$tmp/stderr") -> device: cpu, trained"
echo "cuda-smoke: ok"
