#!/usr/bin/env bash
# Starts 2 ranks of step 1 with the real launchers of PyTorch and DeepSpeed, and checks that each
# run saves the weights one process saves: torchrun (its elastic agent's TCPStore on MASTER_PORT,
# the config read from a DeepSpeed JSON), torch.distributed.launch (which passes --local-rank=N)
# and DeepSpeed's `deepspeed` (which passes --local_rank=N). Not part of CI (it downloads torch
# and deepspeed, about 4 GB with their CUDA wheels); CI starts the ranks with each launcher's
# environment instead (tests/distributed.rs). Then DS-Chat's opt/single_node scripts of steps 1-3
# run through `deepspeed` on 2 ranks, with only `main.py`, the model, the datasets and the lengths
# changed, each writing its log and TensorBoard events into its output directory, which must
# still hold them (and a user's file) after the step saved there.
#
#   bash scripts/check-real-launchers.sh            # builds target/release/sft first
#   VENV=/tmp/venv bash scripts/check-real-launchers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/rlhf-launchers-venv}
TORCH=${TORCH:-torch==2.5.1}
DEEPSPEED=${DEEPSPEED:-deepspeed==0.15.4}
cargo build --release -p sft -p reward -p ppo 2>/dev/null
SFT=$PWD/target/release/sft
BIN=$PWD/target/release
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

# DS-Chat's scripts (step 3's run_1.3b.sh as it is, but for the test mode that stops it after 3 steps).
DS=("$VENV/bin/deepspeed" --num_gpus 2 --no_python)
mkdir -p out1 out2 out3 && echo "a user's notes" > out1/NOTES.txt
"${DS[@]}" --master_port "$(port)" "$BIN/sft" --data_path demo --data_split 2,4,4 --model_name_or_path tiny \
  --per_device_train_batch_size 8 --per_device_eval_batch_size 8 --max_seq_len 64 --learning_rate 9.65e-6 \
  --weight_decay 0. --num_train_epochs 1 --gradient_accumulation_steps 1 --lr_scheduler_type cosine \
  --num_warmup_steps 0 --seed 1234 --zero_stage 2 --deepspeed --enable_tensorboard --tensorboard_path out1 \
  --output_dir out1 &> out1/training.log
"${DS[@]}" --master_port "$(port)" "$BIN/reward" --data_path demo --data_split 2,4,4 --model_name_or_path tiny \
  --num_padding_at_beginning 1 --per_device_train_batch_size 4 --per_device_eval_batch_size 4 --max_seq_len 64 \
  --learning_rate 5e-5 --weight_decay 0.1 --num_train_epochs 1 --disable_dropout --gradient_accumulation_steps 1 \
  --lr_scheduler_type cosine --num_warmup_steps 0 --seed 1234 --zero_stage 0 --deepspeed --enable_tensorboard \
  --tensorboard_path out2 --output_dir out2 &> out2/training.log
"${DS[@]}" --master_port "$(port)" "$BIN/ppo" --data_path demo --data_split 2,4,4 --actor_model_name_or_path out1 \
  --critic_model_name_or_path out2 --num_padding_at_beginning 1 --per_device_generation_batch_size 4 \
  --per_device_training_batch_size 4 --generation_batches 1 --ppo_epochs 1 --max_answer_seq_len 16 \
  --max_prompt_seq_len 32 --actor_learning_rate 9.65e-6 --critic_learning_rate 5e-6 --num_train_epochs 1 \
  --lr_scheduler_type cosine --gradient_accumulation_steps 1 --actor_dropout 0.0 --num_warmup_steps 100 \
  --deepspeed --seed 1234 --enable_hybrid_engine --actor_zero_stage 2 --critic_zero_stage 2 --enable_ema \
  --enable_test_mode --test_stop_step 3 --output_dir out3 --enable_tensorboard --tensorboard_path out3 \
  &> out3/training.log
for out in out1 out2 out3; do
  grep -q "exits successfully" $out/training.log && ls $out/events.out.tfevents.* >/dev/null
done
test -f out1/NOTES.txt && test -f out1/model.safetensors && test -f out3/actor/model.safetensors
echo "DS-Chat's single_node scripts of steps 1-3 ran through deepspeed on 2 ranks; logs, events and notes kept"
