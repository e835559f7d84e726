#!/usr/bin/env bash
# Starts 2 ranks of step 1 with the real launchers of PyTorch and DeepSpeed, and checks that each
# run saves the weights one process saves: torchrun (its elastic agent's TCPStore on MASTER_PORT,
# the config read from a DeepSpeed JSON), torch.distributed.launch (which passes --local-rank=N)
# and DeepSpeed's `deepspeed` (which passes --local_rank=N). Not part of CI (it downloads torch
# and deepspeed, about 4 GB with their CUDA wheels); CI starts the ranks with each launcher's
# environment instead (tests/distributed.rs).
#
#   bash scripts/check-real-launchers.sh            # builds target/release/sft first
#   VENV=/tmp/venv bash scripts/check-real-launchers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/rlhf-launchers-venv}
TORCH=${TORCH:-torch==2.5.1}
DEEPSPEED=${DEEPSPEED:-deepspeed==0.15.4}
cargo build --release -p sft --bin sft >/dev/null
SFT=$PWD/target/release/sft
if [ ! -x "$VENV/bin/deepspeed" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "$TORCH" "$DEEPSPEED" numpy
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
# DeepSpeed's CPU accelerator counts NUMA nodes with `numactl --hardware`; a stand-in where it is
# not installed.
if ! command -v numactl >/dev/null; then
  mkdir -p bin
  printf '#!/bin/sh\necho "available: 1 nodes (0)"\necho "node 0 cpus: 0"\necho "node 0 size: 1000 MB"\n' > bin/numactl
  chmod +x bin/numactl
  export PATH=$WORK/bin:$PATH
fi
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
COMMON=(--data-path demo --data-split 1,8,1 --max-seq-len 48 --learning-rate 2e-3 --num-train-epochs 1
  --dropout 0 --device cpu --dist-timeout 60 --adam-eps 1e-2 --gradient-clipping 0)
# 8 rows an optimizer step: 4 x 2 accumulated in one process, 2 x 2 on each of 2 ranks.
"$SFT" "${COMMON[@]}" --per-device-train-batch-size 4 --gradient-accumulation-steps 2 --output-dir single > single.log 2>&1
echo '{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}' > ds.json
timeout 600 "$VENV/bin/torchrun" --nproc_per_node 2 --master_port "$(port)" --no-python \
  "$SFT" --deepspeed --deepspeed_config ds.json "${COMMON[@]}" --output-dir torchrun > torchrun.log 2>&1
printf 'import os, sys\nos.execv("%s", ["%s"] + sys.argv[1:])\n' "$SFT" "$SFT" > exec_sft.py
RANKS=(--per-device-train-batch-size 2 --gradient-accumulation-steps 2)
timeout 600 "$VENV/bin/python" -m torch.distributed.launch --nproc_per_node 2 --master_port "$(port)" exec_sft.py \
  "${COMMON[@]}" "${RANKS[@]}" --zero-stage 1 --output-dir launch > launch.log 2>&1
timeout 600 "$VENV/bin/deepspeed" --num_gpus 2 --master_port "$(port)" --no_python "$SFT" --deepspeed \
  "${COMMON[@]}" "${RANKS[@]}" --zero_stage 3 --output_dir deepspeed > deepspeed.log 2>&1
"$VENV/bin/python" - <<'EOF'
import json, struct, numpy as np
def load(path):
    data = open(path + "/model.safetensors", "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    return {k: np.frombuffer(data[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]], dtype=np.float32)
            for k, v in header.items() if k != "__metadata__"}
single = load("single")
for run in ["torchrun", "launch", "deepspeed"]:
    got = load(run)
    diff = max(float(np.abs(single[k] - got[k]).max()) for k in single)
    print(f"{run}: 2 ranks, {len(got)} tensors, largest difference from one process {diff:.2e}")
    assert diff < 1e-5, run
EOF
"$VENV/bin/python" -c 'import torch, deepspeed; print("torch", torch.__version__, "deepspeed", deepspeed.__version__)'
