#!/usr/bin/env bash
# Make `cargo build --release --features cuda[,nccl]` (candle 0.11.1 / cudarc 0.19.10) compile and
# link on a GPU-less Debian 12 x86_64 machine that reaches only PyPI/crates.io/apt: the CUDA
# toolchain from PyPI, no system CUDA installation, no GPU, no driver.
#
# Usage (bash):   source scripts/cuda-build-env.sh [PROJECT_DIR]   (default: this script's repository)
#                 cargo build --release --features cuda            (or cuda,nccl)
#   CUDA_CARGO_FEATURES (default "--features cuda,nccl") the features cargo metadata resolves to find cudarc
#   CUDA_VENV (default ~/.cache/cuda-13.0-venv) where the PyPI CUDA 13.0 toolchain goes (created if missing)
#   CUDA_LIBS=stub|real       stub (default): link against generated stub .so files (~100 MB download, ~300 MB on disk);
#                             real: also the real cuBLAS/cuRAND/NVRTC/NCCL (~750 MB more download, 1.5 GB on disk)
# Exports: PATH CUDA_HOME CUDA_PATH CUDA_ROOT CUDA_COMPUTE_CAP CUDAFORGE_THREADS CUDA_STUBS
#
# Why CUDA 13.0 exactly: our H100/H200 test machines run driver 580.159 (= CUDA 13.0). candle loads
# its kernels as PTX, and the driver cannot JIT PTX from a newer nvcc (13.5 emits `.version 9.5`).
# Why stubs at all: candle-core 0.11 turns on cudarc's `dynamic-linking`, so the final link needs
# libcuda.so, libnvrtc.so, libcurand.so, libcublas.so, libcublasLt.so (and libnccl.so with nccl)
# by name; PyPI has no libcuda at all and ships the others only as versioned .so.N files.
# The stubs are for the link only: the binary needs the real NVIDIA driver (libcuda.so.1) and the
# CUDA 13 libraries it links (libcublas.so.13 with its libcublasLt.so.13, libcurand.so.10,
# libcudart.so.13; NVRTC and NCCL are dropped by the linker while nothing calls them) on the machine
# that runs it. With "$CUDA_STUBS:$CUDA_HOME/lib" on LD_LIBRARY_PATH it also starts here, and
# `--device cuda` then fails with one line (CUDA_ERROR_STUB_LIBRARY): scripts/cuda-smoke.sh.
case $- in *e*) _had_e=1;; *) _had_e=;; esac
set -e
_proj=${1:-$(dirname "${BASH_SOURCE[0]}")/..}
CUDA_VENV=${CUDA_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/cuda-13.0-venv}
CUDA_LIBS=${CUDA_LIBS:-stub}

# 1. the compiler toolchain (nvcc, cicc, ptxas, headers, cudart) from PyPI, pinned to 13.0
if [ ! -x "$CUDA_VENV/bin/python" ]; then python3 -m venv "$CUDA_VENV"; fi
_pkgs="nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
       nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85"
if [ "$CUDA_LIBS" = real ]; then
  _pkgs="$_pkgs nvidia-cuda-nvrtc==13.0.88 nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 nvidia-nccl-cu13==2.30.7"
fi
"$CUDA_VENV/bin/pip" install -q --disable-pip-version-check $_pkgs
_sp=$("$CUDA_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
export CUDA_HOME="$_sp/nvidia/cu13" CUDA_PATH="$_sp/nvidia/cu13" CUDA_ROOT="$_sp/nvidia/cu13"
export PATH="$CUDA_HOME/bin:$PATH"
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}      # no nvidia-smi here: H100/H200 = sm_90(a)
export CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-$(nproc)}  # cudaforge would use 1 of 2 cores
export CUDA_STUBS="$CUDA_HOME/lib/stubs"             # never put this on LD_LIBRARY_PATH of a GPU box

# 2. unversioned names the linker asks for (-lcudart ...), like a real toolkit's lib/
cd "$CUDA_HOME/lib"
ln -sf libcudart.so.13 libcudart.so
if [ "$CUDA_LIBS" = real ]; then
  ln -sf libnvrtc.so.13 libnvrtc.so; ln -sf libcurand.so.10 libcurand.so
  ln -sf libcublas.so.13 libcublas.so; ln -sf libcublasLt.so.13 libcublasLt.so
  ln -sf ../../nccl/lib/libnccl.so.2 libnccl.so
fi
cd - >/dev/null

# 3. stub libraries (same SONAME as the real ones, every function returns 34 =
#    CUDA_ERROR_STUB_LIBRARY), symbol lists taken from cudarc's own bindings
_cudarc=$(cd "$_proj" && cargo metadata --format-version 1 ${CUDA_CARGO_FEATURES:---features cuda,nccl} 2>/dev/null \
  | python3 -c 'import json,sys,os; d=json.load(sys.stdin); print(next(os.path.dirname(p["manifest_path"]) for p in d["packages"] if p["name"]=="cudarc"))' || true)
[ -n "$_cudarc" ] || _cudarc=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.* | sort -V | tail -1)
echo "cudarc sources: $_cudarc"
mkdir -p "$CUDA_STUBS"
_stub() { # soname  link-name  cudarc-sys-dir
  grep -ohP '^pub unsafe fn \K\w+' "$_cudarc/src/$3/sys/mod.rs" | sort -u \
    | sed 's/.*/int &(void){return 34;}/' > "$CUDA_STUBS/$2.c"
  gcc -shared -fPIC -O1 -Wl,-soname,$1 -o "$CUDA_STUBS/lib$2.so" "$CUDA_STUBS/$2.c"
  rm -f "$CUDA_STUBS/$2.c"
  ln -sf "lib$2.so" "$CUDA_STUBS/$1"   # SONAME link: lets a cuda-featured binary start on a GPU-less box
}
_stub libcuda.so.1 cuda driver
if [ "$CUDA_LIBS" = stub ]; then
  _stub libnvrtc.so.13 nvrtc nvrtc
  _stub libcurand.so.10 curand curand
  _stub libcublas.so.13 cublas cublas
  _stub libcublasLt.so.13 cublasLt cublaslt
  _stub libnccl.so.2 nccl nccl
fi
echo "CUDA_HOME=$CUDA_HOME ($(nvcc --version | grep -o 'release [0-9.]*')) stubs: $(ls "$CUDA_STUBS" | tr '\n' ' ')"
[ -n "$_had_e" ] || set +e
