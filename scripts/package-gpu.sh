#!/usr/bin/env bash
# Builds the CUDA binaries on this (GPU-less) machine and packs them for a GPU machine that has no
# Rust toolchain: `train` (also `sft`, `reward`, `ppo` by name), `chat`, the benchmark `bench`,
# the CUDA-against-CPU checks `gpu_check` and the engine library's unit tests `unit-tests` (with
# the CUDA kernels' tests, which need a GPU), stripped, with `run-gpu.sh`, `gpu-check.sh` (every GPU
# check in one command), the benchmark scripts (scripts/bench/) and the CUDA runtime they
# link (lib/libcudart.so.13, 0.7 MiB), in one xz-compressed tarball (under 64 MiB).
#
# Usage: scripts/package-gpu.sh [OUT_DIR]     (default: dist/)
#   FEATURES (default: cuda,nccl, what .ci/run builds; NCCL is needed at run time only once code calls it)
#   CARGO_TARGET_DIR as for any cargo build (default: target/)
#
# On the GPU machine:
#   tar xJf rlhf-gpu-*.tar.xz && cd rlhf-gpu && ./run-gpu.sh train --device cuda ...
#   ./gpu-check.sh /tmp/gpu-check [CPU_REFERENCE_DIR]                # every GPU check, PASS/FAIL
#   ./run-gpu.sh bench-table --device cuda --out BENCHMARKS-gpu.md   # the CPU table's rows on the GPU
#   ./run-gpu.sh bench-gpu --out BENCHMARKS-gpu.md                    # the GPU-sized table vs PyTorch
#   ./run-gpu.sh bench-ppo --work /tmp/ppo-bench                      # step 3 end to end vs PyTorch
# The binaries need the NVIDIA driver (libcuda.so.1) and the CUDA 13 libraries libcublas.so.13,
# libcublasLt.so.13 and libcurand.so.10 (from a CUDA 13 toolkit or the PyPI nvidia-* wheels a
# CUDA 13 PyTorch installs; cuBLAS alone is far over 64 MiB, so they are not packed); run-gpu.sh
# finds them and sets LD_LIBRARY_PATH.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-$root/dist}
features=${FEATURES:-cuda,nccl}
target=${CARGO_TARGET_DIR:-$root/target}

# shellcheck source=cuda-build-env.sh
source "$root/scripts/cuda-build-env.sh" "$root"
(cd "$root" && cargo build --release --features "$features" --bin train --bin chat)
(cd "$root" && cargo build --release -p hybrid-engine --features "$features" --example bench --example gpu_check)
# The unit-test executable's path, from cargo's JSON messages.
unit_tests=$(cd "$root" && cargo test --release -p hybrid-engine --features "$features" --lib --no-run --message-format json \
  | python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["lib"]][-1])')

version=$(git -C "$root" describe --always --dirty 2>/dev/null || echo unknown)
name=rlhf-gpu
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/$name/lib" "$stage/$name/scripts/bench" "$out"
for bin in train chat; do
  strip -o "$stage/$name/$bin" "$target/release/$bin"
done
for ex in bench gpu_check; do
  strip -o "$stage/$name/$ex" "$target/release/examples/$ex"
done
strip -o "$stage/$name/unit-tests" "$unit_tests"
cp "$root/scripts/gpu-check.sh" "$stage/$name/"
cp "$root/scripts/bench/run.sh" "$root/scripts/bench/hf_bench.py" "$root/scripts/bench/gpu_table.py" \
  "$root/scripts/bench/ppo_step3.py" "$root/scripts/bench/nsys_summary.py" \
  "$root/assets/gpt2-tokenizer/tokenizer.json" "$stage/$name/scripts/bench/"
cp -L "$CUDA_HOME/lib/libcudart.so.13" "$stage/$name/lib/"
cat > "$stage/$name/run-gpu.sh" <<'EOF'
#!/usr/bin/env bash
# Runs one of this package's binaries (train, chat, or sft/reward/ppo through train) with the CUDA
# 13 libraries on LD_LIBRARY_PATH: from CUDA_HOME, /usr/local/cuda*, or the PyPI nvidia-* wheels of
# any python3 on PATH (a CUDA 13 PyTorch brings them). Usage: run-gpu.sh train --device cuda ...
# `run-gpu.sh bench-table --device cuda` runs scripts/bench/run.sh with the packaged `bench`
# against the PyTorch on this machine and appends the table to BENCHMARKS.md here (or --out FILE);
# `run-gpu.sh bench-gpu [--out FILE]` the GPU-sized table (scripts/bench/gpu_table.py: bf16, SDPA,
# fused AdamW, torch.compile on the PyTorch side); `run-gpu.sh bench-ppo --work DIR` step 3 end to
# end against a PyTorch loop of the same stages (scripts/bench/ppo_step3.py).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bin=${1:?usage: run-gpu.sh train|chat|sft|reward|ppo|bench|gpu_check|unit-tests|bench-table|bench-gpu|bench-ppo [FLAGS...]}; shift
dirs=()
for d in ${CUDA_HOME:+"$CUDA_HOME/lib64" "$CUDA_HOME/lib"} /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 "$here/lib"; do
  [ -d "$d" ] && dirs+=("$d")
done
for py in python3 python; do
  command -v "$py" >/dev/null || continue
  while IFS= read -r d; do dirs+=("$d"); done < <("$py" - <<'PY' 2>/dev/null || true
import glob, os, site, sysconfig
roots = set(site.getsitepackages() + [site.getusersitepackages(), sysconfig.get_paths()["purelib"]])
want = ("libcublas.so.13", "libcublasLt.so.13", "libcurand.so.10", "libcudart.so.13", "libnvrtc.so.13", "libnccl.so.2")
for r in roots:
    for lib in want:
        for f in glob.glob(os.path.join(r, "nvidia", "**", lib), recursive=True):
            print(os.path.dirname(f))
PY
)
done
ld=$(printf '%s\n' "${dirs[@]}" | awk 'NF && !seen[$0]++' | paste -sd: -)
export LD_LIBRARY_PATH=${ld}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
case "$bin" in
  train|chat|bench|gpu_check|unit-tests) exec "$here/$bin" "$@" ;;
  sft|reward|ppo) exec -a "$bin" "$here/train" "$@" ;;
  bench-table) BENCH_BIN="$here/bench" exec "$here/scripts/bench/run.sh" "$@" ;;
  bench-gpu) exec python3 "$here/scripts/bench/gpu_table.py" --bench "$here/bench" "$@" ;;
  bench-ppo) exec python3 "$here/scripts/bench/ppo_step3.py" --ppo "$here/run-gpu.sh ppo" --tokenizer "$here/scripts/bench/tokenizer.json" "$@" ;;
  *) echo "run-gpu.sh: unknown binary $bin (train, chat, sft, reward, ppo, bench, gpu_check, unit-tests, bench-table, bench-gpu, bench-ppo)" >&2; exit 2 ;;
esac
EOF
chmod +x "$stage/$name/run-gpu.sh"
echo "$version ($features, CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP, built $(date -u +%Y-%m-%dT%H:%MZ))" > "$stage/$name/VERSION"

tarball="$out/$name-$version.tar.xz"
tar -C "$stage" -cf - "$name" | xz -9e -T0 > "$tarball"
size=$(stat -c %s "$tarball")
unpacked=$(du -cb "$stage/$name/train" "$stage/$name/chat" "$stage/$name/bench" | tail -1 | cut -f1)
awk -v t="$tarball" -v s="$size" -v u="$unpacked" \
  'BEGIN { printf "%s: %d bytes (%.1f MiB; train + chat + bench unpacked %.1f MiB)\n", t, s, s / 1048576, u / 1048576 }'
if [ "$size" -ge $((64 * 1024 * 1024)) ]; then
  echo "error: the tarball is over 64 MiB" >&2
  exit 1
fi
