#!/usr/bin/env bash
# Every GPU check of the CUDA path in one command, on a GPU machine without a Rust toolchain:
# run it from the unpacked package of scripts/package-gpu.sh (which packs this script).
#
#   0. unit-tests: the engine library's unit tests built with the CUDA feature; then gpu-tests,
#      its tests that need a GPU (ignored elsewhere; here run with --ignored): the CUDA kernels'
#      own tests against the CPU (kernels::ops::*::cuda_tests), AdamW's and ZeRO's on the GPU,
#      the decoding graph, NCCL's watchdog;
#   1. gpu_check: fp32 logits, loss and every gradient of the same gpt2 weights on CUDA against
#      the CPU (1e-4), bf16/fp16 logits, greedy generation with the KV cache, NCCL at one rank;
#   2. pretraining gpt2 from scratch for 50 iterations in fp32, fp16 and bf16 on CUDA (the
#      embedded Shakespeare, micro-batch 4 x 128 tokens): each loss curve against the CPU's fp32
#      curve in REFERENCE_DIR/pretrain-fp32/metrics.jsonl when given (the CPU run of the same
#      command: `sft ... --device cpu`), else against the CUDA fp32 curve;
#   3. the three-step demo (`train --device cuda`), then gpu_check on its SFT actor and `chat`
#      on its step-3 actor; with REFERENCE_DIR/demo (the CPU's `train --output-dir` at the same
#      build) each step's training curve against the CPU's (how many steps agree to 1e-4) and
#      both held-out summaries;
#   4. ranks: 2 ranks sharing the GPU over the TCP ring (--distributed-backend gloo) at ZeRO
#      stages 1-3 against one rank (loss curves).
# Five measuring stages run only when named in STAGES:
#   nsys: Nsight Systems (when the machine has `nsys`) over a gpt2 B8 T1024 bf16 training run (3
#      steps) and gpt2 B32 P16+64 generation with and without the CUDA graph: per run the GPU's
#      kernel time and launches, the host's time in the CUDA API calls that cost most (launches,
#      graph launches, synchronisations, allocations), the largest kernels (WORK_DIR/nsys-*.csv);
#   graph: generation with the decoding step replayed from a CUDA graph (HYBRID_ENGINE_DECODE_GRAPH=1)
#      against the host's loop, alternating, two rounds: gpt2 B32 P16+128 and gpt2-medium B16
#      P256+256 in bf16, greedy and (gpt2) sampled; tokens/s, ms and host ms a token step, steps
#      replayed (0: the capture failed, its warning in the log);
#   ab: gpt2 B8 T1024 bf16 training as built against the same build with AB_ENV set (default
#      HYBRID_ENGINE_CUBLASLT=0: the linears without cuBLASLt's epilogues; HYBRID_ENGINE_PACKED_ROWS=0
#      without the packed LayerNorm and cross-entropy kernels, CANDLE_UPSTREAM_BINARY_GRID=1 candle's binary
#      ops on upstream's grid), alternating, AB_ROUNDS
#      times (default 2): each run's tokens/s, its phases, the host's and the GPU's times at the
#      step's marks (bench's `timeline`), the matmuls with and without the epilogues; then the
#      build without dropout (its cost), and generation at step 3's benchmark shape (gpt2-medium
#      B16 P256+256 bf16);
#   bench: gpt2 B8 T1024 bf16 training as built and with the composed attention
#      (HYBRID_ENGINE_FLASH_ATTENTION=0), `bench ops`, and the PyTorch comparison rows of
#      scripts/bench/gpu_table.py (gpt2 and gpt2-medium training, generation at batch 32; BENCH_ROWS
#      to choose: the --only arguments of gpu_table.py, one row per line, or "none"; BENCH_VARIANTS
#      to choose among "default composed-attention", or "none"; BENCH_OPS=0 skips `bench ops`;
#      BENCH_COMPILE=1 adds the torch.compile variants; BENCH_TIMEOUT each process's limit in
#      seconds, default 90);
#   profile: every kernel of one such training step timed by Nsight Compute (ncu), summed per
#      kernel (WORK_DIR/ncu.csv, the largest in the summary), and the first launch of each
#      attention kernel in detail (WORK_DIR/profile-attention_*.log, the main lines in
#      attention-ncu.txt: throughput, occupancy, issue slots; ATTENTION_DETAIL= to skip, or the
#      kernels to profile).
# Each stage has a time limit; a failing stage does not stop the later ones. The logs, metrics
# and summaries (no weights) go to WORK_DIR; a line per stage and PASS/FAIL at the end.
#
# Usage: gpu-check.sh WORK_DIR [REFERENCE_DIR]    (STAGES="unit check pretrain demo ranks" to choose;
#        STAGES="unit check ab bench profile" for a short lease that measures)
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
work=${1:?usage: gpu-check.sh WORK_DIR [REFERENCE_DIR]}
ref=${2:-}
stages=${STAGES:-unit check pretrain demo ranks}
mkdir -p "$work"
summary=$work/summary.txt
: >"$summary"
failed=0
bin=$here/run-gpu.sh

# stage LABEL LIMIT_S COMMAND...: runs COMMAND with its output in WORK_DIR/LABEL.log.
stage() {
  local label=$1 limit=$2 start rc line
  shift 2
  start=$(date +%s%N)
  timeout "$limit" "$@" >"$work/$label.log" 2>&1
  rc=$?
  line=$(printf '%-24s exit %3d  %6d ms' "$label" "$rc" $((($(date +%s%N) - start) / 1000000)))
  echo "$line" | tee -a "$summary"
  [ "$rc" = 0 ] || { failed=1; tail -5 "$work/$label.log" | sed 's/^/    /'; }
  return "$rc"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$summary"
cat "$here/VERSION" | tee -a "$summary"

if [[ " $stages " == *" unit "* ]]; then
  # --test-threads 1: the GPU tests would share one device; the CPU ones take seconds anyway.
  stage unit-tests 120 "$bin" unit-tests --test-threads 1
  grep -E '^test .*FAILED|^test result' "$work/unit-tests.log" | tee -a "$summary"
  # The GPU tests are the library's ignored ones (a run without a GPU lists them as ignored):
  # here each of them runs, and one that finds no GPU fails saying so.
  stage gpu-tests 120 "$bin" unit-tests --ignored --test-threads 1
  grep -E '^test |^test result' "$work/gpu-tests.log" | tee -a "$summary"
fi

if [[ " $stages " == *" check "* ]]; then
  stage gpu_check-gpt2 90 "$bin" gpu_check --model gpt2 --device cuda
  grep -E '^(PASS|FAIL)' "$work/gpu_check-gpt2.log" | cut -c1-200
fi

if [[ " $stages " == *" pretrain "* ]]; then
  for dtype in fp32 fp16 bf16; do
    # fp16 from 2^16 (pretraining's default is Megatron's 2^32, whose first 17 iterations skip).
    scaler=(); [ "$dtype" = fp16 ] && scaler=(--initial-scale-power 16 --loss-scale-window 100)
    stage "pretrain-$dtype" 90 "$bin" sft --from-scratch --model gpt2 --seq-length 128 --micro-batch-size 4 \
      --train-iters 50 --eval-interval 50 --eval-iters 2 --log-interval 1 --dtype "$dtype" "${scaler[@]}" \
      --output-dir "$work/pretrain-$dtype" --device cuda
  done
  # Loss curves against the reference: the largest |difference| over the 50 iterations.
  python3 - "$work" "${ref:-$work}" <<'PY' | tee -a "$summary"
import json, os, sys
work, ref = sys.argv[1], sys.argv[2]
def curve(d):
    p = os.path.join(d, "metrics.jsonl")
    if not os.path.exists(p):
        return {}
    rows = [json.loads(l) for l in open(p) if l.strip()]
    return {r["iteration"]: r["lm_loss"] for r in rows if "lm_loss" in r}
base = curve(os.path.join(ref, "pretrain-fp32"))
which = "cpu fp32" if ref != work else "cuda fp32"
for dtype in ("fp32", "fp16", "bf16"):
    c = curve(os.path.join(work, f"pretrain-{dtype}"))
    common = sorted(set(c) & set(base))
    if not common:
        print(f"loss curve {dtype}: no curve to compare")
        continue
    d = max(abs(c[i] - base[i]) for i in common)
    last = common[-1]
    print(f"loss curve cuda {dtype} vs {which}: {len(common)} iterations, max |diff| {d:.4f}, "
          f"iteration {last}: {c[last]:.4f} vs {base[last]:.4f}")
PY
fi

if [[ " $stages " == *" demo "* ]]; then
  stage demo 240 "$bin" train --device cuda --output-dir "$work/demo"
  if [ -d "$work/demo/actor" ]; then
    stage gpu_check-sft-actor 60 "$bin" gpu_check --path "$work/demo/actor" --device cuda
    grep -E '^(PASS|FAIL)' "$work/gpu_check-sft-actor.log" | cut -c1-200
  fi
  # Each step's training curve against the CPU's demo (REFERENCE_DIR/demo: `train --device cpu
  # --output-dir REFERENCE_DIR/demo` at the same build): the steps over which the two agree to
  # rounding (1e-4 relative), then the largest difference; and both held-out summaries.
  [ -d "${ref:-}/demo" ] && python3 - "$work/demo" "$ref/demo" <<'PY' | tee -a "$summary"
import json, os, sys
gpu, cpu = sys.argv[1], sys.argv[2]
def rows(d, step):
    p = os.path.join(d, step, "metrics.jsonl")
    return [json.loads(l) for l in open(p) if l.strip()] if os.path.exists(p) else []
for step, key in (("actor", "loss"), ("reward", "loss"), ("step3", "actor_loss")):
    a = [r[key] for r in rows(gpu, step) if key in r]
    b = [r[key] for r in rows(cpu, step) if key in r]
    n = min(len(a), len(b))
    rel = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a[:n], b[:n])]
    agree = next((i for i, d in enumerate(rel) if d > 1e-4), n)
    worst = max(rel, default=float("nan"))
    print(f"demo {step} {key}: {n} steps, the first {agree} within 1e-4 of the CPU's, largest relative |diff| {worst:.2e}")
for name, d in (("cuda", gpu), ("cpu", cpu)):
    end = [r for r in rows(d, "step3") if r.get("event") == "end"]
    summary = end[-1].get("summary", {}) if end else {}
    scores = [(e.get("reward_mean"), e.get("task_success")) for e in (summary.get("sft_eval") or {}, summary.get("ppo_eval") or {})]
    print(f"demo {name}: held-out reward-model score and task score, SFT actor {scores[0]}, PPO actor {scores[1]}")
PY
  actor=$work/demo/step3/actor
  [ -d "$actor" ] || actor=$work/demo/actor
  if [ -d "$actor" ]; then
    stage chat 60 "$bin" chat --path "$actor" --device cuda --chat-format --prompt "What is the capital of France?" --greedy --max-new-tokens 12
    cat "$work/chat.log" | tee -a "$summary"
  fi
fi

train_args=(train --model gpt2 --batch 8 --seq 1024 --dtype bf16 --device cuda)
# One line of a bench train JSON (WORK_DIR/LABEL.log): tokens/s, the phases, where the time goes.
summarise_train() {
  python3 - "$1" "$2" <<'PY' 2>/dev/null | tee -a "$summary"
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
marks = ", ".join("%s %.1f/%s" % (m["mark"], m["host_ms"], "-" if m.get("gpu_ms") is None else "%.1f" % m["gpu_ms"])
                  for m in r.get("timeline") or [])
print("  %s: %.0f tokens/s, ms forward+backward / optimizer %.1f / %.1f, cpu %.1f ms a step, "
      "cuBLASLt fused/unfused %s; ms host/GPU at %s" % (
          sys.argv[2], r["tokens_per_s"], r["ms_forward_backward"], r["ms_optimizer"], r["cpu_ms_per_step"],
          r.get("cublaslt_fused_unfused"), marks or "-"))
PY
}

if [[ " $stages " == *" ab "* ]]; then
  ab_env=${AB_ENV:-HYBRID_ENGINE_CUBLASLT=0}
  for round in $(seq "${AB_ROUNDS:-2}"); do
    for variant in default "$ab_env"; do
      label="ab-$round-${variant%%=*}"
      env_args=()
      [ "$variant" = default ] || env_args=("$variant")
      stage "$label" 90 env "${env_args[@]}" "$bin" bench "${train_args[@]}" --steps 10 --warmup 3
      summarise_train "$work/$label.log" "$label"
    done
  done
  # What dropout (the attention's drawn in its kernels, the residuals', the embeddings') costs.
  stage ab-no-dropout 90 "$bin" bench "${train_args[@]}" --steps 10 --warmup 3 --dropout 0
  summarise_train "$work/ab-no-dropout.log" "no dropout"
  stage generate-medium 90 "$bin" bench generate --model gpt2-medium --batch 16 --prompt-len 256 --new-tokens 256 \
    --warmup 1 --reps 3 --dtype bf16 --device cuda
  python3 - "$work/generate-medium.log" <<'PY' 2>/dev/null | tee -a "$summary"
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
print("  generate gpt2-medium B16 P256+256 bf16: %.0f tokens/s, %.2f ms a token step, cpu %.2f ms a token step"
      % (r["tokens_per_s"], r["ms_per_token_step"], r["cpu_ms_per_token_step"]))
PY
fi

if [[ " $stages " == *" graph "* ]]; then
  for round in 1 2; do
    for shape in "gpt2 32 16 128" "gpt2-medium 16 256 256" "gpt2 32 16 128 sampled"; do
      set -- $shape
      sampling=()
      [ "${5:-}" = sampled ] && sampling=(--temperature 1 --top-k 50 --top-p 0.9)
      for graph in 0 1; do
        label="graph-$round-$1-$2${5:+-$5}-$graph"
        stage "$label" 120 env HYBRID_ENGINE_DECODE_GRAPH=$graph "$bin" bench generate --model "$1" --batch "$2" \
          --prompt-len "$3" --new-tokens "$4" --warmup 1 --reps 3 --dtype bf16 --device cuda "${sampling[@]}"
        python3 - "$work/$label.log" "$label" <<'PY' 2>/dev/null | tee -a "$summary"
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
print("  %s: %.0f tokens/s, %.3f ms a token step, cpu %.3f ms a token step, %d steps replayed, %.0f MiB"
      % (sys.argv[2], r["tokens_per_s"], r["ms_per_token_step"], r["cpu_ms_per_token_step"],
         r.get("decode_graph_replayed_steps", 0), r.get("gpu_used_mib") or 0))
PY
      done
    done
  done
fi

if [[ " $stages " == *" nsys "* ]]; then
  if ! command -v nsys >/dev/null; then
    echo "nsys: not on this machine" | tee -a "$summary"
  else
    for run in "train|0|bench train --model gpt2 --batch 8 --seq 1024 --dtype bf16 --device cuda --steps 3 --warmup 1" \
      "generate|0|bench generate --model gpt2 --batch 32 --prompt-len 16 --new-tokens 64 --warmup 1 --reps 1 --dtype bf16 --device cuda" \
      "generate-graph|1|bench generate --model gpt2 --batch 32 --prompt-len 16 --new-tokens 64 --warmup 1 --reps 1 --dtype bf16 --device cuda"; do
      IFS='|' read -r label graph command <<<"$run"
      # shellcheck disable=SC2086 # the command's words
      stage "nsys-$label" 180 env HYBRID_ENGINE_DECODE_GRAPH=$graph nsys profile --force-overwrite true \
        --trace cuda --output "$work/nsys-$label" "$bin" $command
      nsys stats --force-export true --report cuda_gpu_kern_sum,cuda_api_sum --format csv \
        --output "$work/nsys-$label" "$work/nsys-$label.nsys-rep" >"$work/nsys-$label-stats.log" 2>&1
      python3 "$here/scripts/bench/nsys_summary.py" "$label" "$work/nsys-$label" | tee -a "$summary"
    done
  fi
fi

if [[ " $stages " == *" bench "* ]]; then
  # The build as it is; with the composed attention.
  for variant in ${BENCH_VARIANTS:-default composed-attention}; do
    [ "$variant" = none ] && continue
    flash=1
    [ "$variant" = composed-attention ] && flash=0
    stage "bench-$variant" 90 env HYBRID_ENGINE_FLASH_ATTENTION=$flash \
      "$bin" bench "${train_args[@]}" --steps 5 --warmup 2
    summarise_train "$work/bench-$variant.log" "$variant"
  done
  [ "${BENCH_OPS:-1}" = 0 ] || stage bench-ops 90 "$bin" bench ops --model gpt2 --batch 8 --seq 1024 --reps 3 --dtype bf16 --device cuda
  rows=${BENCH_ROWS:-$'train gpt2 B8 T1024 bf16\ntrain gpt2-medium B8\ngenerate gpt2 B32 P16+128 bf16'}
  if [ "$rows" != none ]; then
    only=()
    while IFS= read -r row; do [ -n "$row" ] && only+=(--only "$row"); done <<<"$rows"
    compile=(--skip-compile)
    [ "${BENCH_COMPILE:-0}" = 1 ] && compile=()
    stage bench-pytorch 360 "$bin" bench-gpu --timeout "${BENCH_TIMEOUT:-90}" "${only[@]}" "${compile[@]}" --out "$work/bench.md" --raw "$work/bench-raw.jsonl"
    grep -E '^\| (train|generate)' "$work/bench.md" | tee -a "$summary"
  fi
fi

if [[ " $stages " == *" profile "* ]]; then
  stage profile 240 ncu --target-processes all --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --csv --log-file "$work/ncu.csv" "$bin" bench "${train_args[@]}" --steps 1 --warmup 0
  python3 - "$work/ncu.csv" <<'PY' | tee -a "$summary"
import collections, csv, sys
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
rows = csv.reader(lines)
head = next(rows)
name, value = head.index("Kernel Name"), head.index("Metric Value")
total = collections.defaultdict(lambda: [0, 0.0])
for r in rows:
    k = "cuBLAS gemm" if r[name].startswith(("nvjet", "sm90_xmma", "cutlass")) else r[name].split("(")[0][:48]
    total[k][0] += 1
    total[k][1] += float(r[value].replace(",", "")) / 1e6  # ns -> ms
print(f"kernels of one step: {sum(v for _, v in total.values()):.1f} ms in {sum(n for n, _ in total.values())} launches")
for k, (n, ms) in sorted(total.items(), key=lambda kv: -kv[1][1])[:15]:
    print(f"  {ms:8.2f} ms {n:5d}  {k}")
PY
  for kernel in ${ATTENTION_DETAIL-attention_forward attention_backward_dq attention_backward_dkv}; do
    stage "profile-$kernel" 90 ncu --target-processes all -k "regex:^${kernel}_" --launch-count 1 --set detailed \
      "$bin" bench "${train_args[@]}" --steps 1 --warmup 0
    grep -E '^  [a-z_]+attention|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit Registers|Issue Slots Busy|No Eligible|Executed Ipc Active' \
      "$work/profile-$kernel.log" | tee -a "$work/attention-ncu.txt" "$summary"
  done
fi

if [[ " $stages " == *" ranks "* ]]; then
  # Two ranks sharing the one GPU over the TCP ring (--distributed-backend gloo: device tensors
  # through host memory; NCCL refuses two ranks on one GPU) at ZeRO stages 1-3 (fp32; stage 2 in
  # buckets; stage 1 also in bf16, its fp32 masters sharded; stage 2 in bf16 with --offload, and
  # in buckets of the GPU's gradients sent as bf16;
  # stage 3 in fp32 at once and in rounds of its gradients' reduce-scatter cut on the GPU, in
  # bf16 with its shards on the GPU and with --offload in host memory)
  # against one rank at the same global batch: each loss curve's largest relative difference,
  # and where each run's optimizer states lived (its log's line).
  tiny=(--from-scratch --num-layers 2 --hidden-size 64 --num-attention-heads 2 --seq-length 32 --train-iters 8
    --gradient-accumulation-steps 2 --lr 3e-3 --lr-warmup-iters 1 --dropout 0 --eval-interval 0 --eval-iters 1
    --log-interval 1 --adam-eps 1e-4 --device cuda:0)
  for dtype in fp32 bf16; do
    stage "ranks-one-$dtype" 90 "$bin" sft "${tiny[@]}" --dtype "$dtype" --micro-batch-size 6 --output-dir "$work/ranks-one-$dtype"
  done
  # Each run: its name, stage, dtype and flags. Stages 1-3 step each rank's shard on the GPU
  # (the pieces in the fp32 weights, or in bf16 the shard of the fp32 masters; at stage 3 the
  # shard the units are gathered from), with --offload in host memory.
  for run in "s1-fp32 1 fp32" "s2-fp32 2 fp32 --reduce-bucket-size 20000" "s3-fp32 3 fp32" \
    "s3-fp32-rounds 3 fp32 --reduce-bucket-size 20000" "s1-bf16 1 bf16" \
    "s2-bf16-offload 2 bf16 --offload" "s2-bf16-buckets 2 bf16 --reduce-bucket-size 20000 --communication-data-type bf16" \
    "s3-bf16 3 bf16" "s3-bf16-offload 3 bf16 --offload"; do
    set -- $run
    name=$1 zs=$2 dtype=$3
    shift 3
    RLHF_NPROC_PER_NODE=2 RLHF_RANK_LOG_DIR="$work/ranks-$name-logs" stage "ranks-gloo-$name" 120 \
      "$bin" sft "${tiny[@]}" --dtype "$dtype" --micro-batch-size 3 --zero-stage "$zs" --distributed-backend gloo "$@" \
      --output-dir "$work/ranks-$name"
    grep -h -m1 "optimizer states" "$work/ranks-gloo-$name.log" "$work/ranks-$name-logs"/* 2>/dev/null | head -1 \
      | sed "s/^/$name: /" | tee -a "$summary"
  done
  python3 - "$work" <<'PY' | tee -a "$summary"
import json, os, sys
work = sys.argv[1]
def curve(d):
    p = os.path.join(work, d, "metrics.jsonl")
    rows = [json.loads(l) for l in open(p) if l.strip()] if os.path.exists(p) else []
    return {r["iteration"]: r["lm_loss"] for r in rows if "lm_loss" in r}
for name in ["s1-fp32", "s2-fp32", "s3-fp32", "s3-fp32-rounds", "s1-bf16", "s2-bf16-offload", "s2-bf16-buckets", "s3-bf16", "s3-bf16-offload"]:
    dtype = name.split("-")[1]
    one, two = curve(f"ranks-one-{dtype}"), curve(f"ranks-{name}")
    common = sorted(set(one) & set(two))
    d = max((abs(two[i] - one[i]) / abs(one[i]) for i in common), default=float("nan"))
    print(f"2 ranks on one GPU (gloo), {name} vs 1 rank: {len(common)} iterations, max relative |diff| {d:.2e}")
PY
fi

find "$work" -name '*.safetensors' -delete
if [ "$failed" = 0 ]; then echo "gpu-check: PASS" | tee -a "$summary"; else echo "gpu-check: FAIL" | tee -a "$summary"; fi
exit "$failed"
