#!/usr/bin/env python3
"""The GPU benchmark: our engine (``bench``, a CUDA build) against Hugging Face transformers'
GPT-2 in PyTorch on the same GPU, in one run, at the sizes a GPU user trains and samples at.

Each row runs ``bench`` and one or more PyTorch variants of ``hf_bench.py`` with the same
arguments, one process each (so each process's memory is its own): the eager float32 model
(the CPU comparison's reference), and the model a PyTorch user would run on a GPU: SDPA
attention, bf16 autocast, fused AdamW, with and without ``torch.compile``. It prints a Markdown
table (tokens/s, MFU, device memory in use) and appends it, with the GPU and versions, to
``--out`` (default BENCHMARKS.md in the current directory).

MFU = tokens/s x model FLOPs per token / the GPU's measured matmul peak in the row's dtype
(the larger of candle's and PyTorch's (8192, 8192) x (8192, 8192) product, bf16 or fp32).
Device memory: the driver's total - free, the most seen after any phase (CUDA context included,
the same measure on both sides). It is not the peak inside a step: PyTorch's caching allocator
keeps what the backward used, so its figure is close to its peak; candle returns activations'
memory as soon as they are dropped, so ours is what stays between steps (weights, gradients,
AdamW moments), below our peak.

Usage: gpu_table.py --bench PATH [--device cuda] [--out FILE] [--raw FILE] [--smoke] [--from-raw FILE]
                    [--only TEXT ...] [--skip-compile]
  --only TEXT: only the rows whose label contains TEXT (repeatable); --skip-compile: no
  torch.compile variant (its compilation takes about a minute of a short device lease).
  --from-raw FILE: no runs; the table from the JSON lines a run cut off short left in its --raw
  file (rows it did not reach are marked as not run).
  (scripts/package-gpu.sh packs it; on the GPU machine `run-gpu.sh bench-gpu [--out FILE]`.)
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
HF = [sys.executable, os.path.join(HERE, "hf_bench.py")]

EAGER = ("HF eager fp32", ["--attn", "eager"])
SDPA_FP32 = ("HF SDPA fp32 fused AdamW", ["--attn", "sdpa", "--fused-adamw"])
SDPA_BF16 = ("HF SDPA bf16 fused AdamW", ["--attn", "sdpa", "--fused-adamw"])
SDPA_BF16_COMPILE = ("HF SDPA bf16 fused AdamW compile", ["--attn", "sdpa", "--fused-adamw", "--compile"])
SDPA_GEN = ("HF SDPA", ["--attn", "sdpa"])
SDPA_GEN_COMPILE = ("HF SDPA static cache, compile", ["--attn", "sdpa", "--compile"])

# label, the arguments both sides take, the PyTorch variants (label, extra arguments).
ROWS = [
    ("train gpt2 B8 T1024 bf16", "train --model gpt2 --batch 8 --seq 1024 --warmup 3 --steps 5 --dtype bf16",
     [SDPA_BF16, SDPA_BF16_COMPILE]),
    ("train gpt2 B8 T1024 fp32", "train --model gpt2 --batch 8 --seq 1024 --warmup 2 --steps 5 --dtype fp32",
     [EAGER, SDPA_FP32]),
    ("train gpt2-medium B8 T1024 bf16", "train --model gpt2-medium --batch 8 --seq 1024 --warmup 2 --steps 4 --dtype bf16",
     [SDPA_BF16]),
    ("generate gpt2 B1 P16+128 bf16", "generate --model gpt2 --batch 1 --prompt-len 16 --new-tokens 128 --warmup 1 --reps 3 --dtype bf16",
     [SDPA_GEN]),
    ("generate gpt2 B32 P16+128 bf16", "generate --model gpt2 --batch 32 --prompt-len 16 --new-tokens 128 --warmup 2 --reps 3 --dtype bf16",
     [SDPA_GEN, SDPA_GEN_COMPILE]),
    ("generate gpt2 B32 P16+128 bf16 sampled", "generate --model gpt2 --batch 32 --prompt-len 16 --new-tokens 128 --warmup 1 --reps 3 --dtype bf16 --temperature 1.0 --top-k 50 --top-p 0.9",
     [SDPA_GEN]),
    ("generate gpt2 B32 P16+128 fp32", "generate --model gpt2 --batch 32 --prompt-len 16 --new-tokens 128 --warmup 1 --reps 3 --dtype fp32",
     [EAGER, SDPA_GEN]),
    ("generate gpt2-medium B32 P16+128 bf16", "generate --model gpt2-medium --batch 32 --prompt-len 16 --new-tokens 128 --warmup 1 --reps 2 --dtype bf16",
     [SDPA_GEN]),
]
SMOKE_ROWS = [
    ("train tiny B4 T128 bf16", "train --model tiny --batch 4 --seq 128 --warmup 1 --steps 2 --dtype bf16", [SDPA_BF16]),
    ("generate tiny B4 P16+32 bf16", "generate --model tiny --batch 4 --prompt-len 16 --new-tokens 32 --warmup 1 --reps 1 --dtype bf16", [SDPA_GEN]),
]
PEAKS = {"bf16": "peak --size 8192 --reps 10 --dtype bf16", "fp32": "peak --size 8192 --reps 5 --dtype fp32"}


RECORDED = None  # --from-raw: {arguments after the program: result}


def key_of(cmd):
    """Which side and its arguments: the same for a command and its --raw record."""
    hf = len(cmd) > 1 and cmd[1].endswith("hf_bench.py")
    return ("hf",) + tuple(cmd[2:]) if hf else ("ours",) + tuple(cmd[1:])


def first_error(stderr, returncode):
    """The line that says what went wrong: the first `error:` line (ours, argparse), else the
    last line (a Python traceback's exception)."""
    lines = [l for l in stderr.strip().splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("error") or l.startswith("Error")]
    return (errors or lines or ["exit %d" % returncode])[0 if errors else -1]


def run(cmd, timeout, raw):
    """One benchmark process: its last stdout line as JSON, or {"failed": reason}."""
    if RECORDED is not None:
        return RECORDED.get(key_of(cmd), {"failed": "not run (the run was cut off before it)"})
    start = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        lines = p.stdout.strip().splitlines()
        out = json.loads(lines[-1]) if p.returncode == 0 and lines else {"failed": first_error(p.stderr, p.returncode)}
    except subprocess.TimeoutExpired:
        out = {"failed": f"timed out after {timeout} s"}
    out["wall_s"] = round(time.time() - start, 1)
    print(f"  {' '.join(os.path.basename(c) if i < 2 else c for i, c in enumerate(cmd))}\n    -> {json.dumps(out)[:300]}", file=sys.stderr, flush=True)
    if raw:
        with open(raw, "a") as f:
            f.write(json.dumps({"cmd": cmd, "result": out}) + "\n")
    return out


def machine_facts(bench):
    """The GPU, the versions on both sides and the cores, read before the runs (and kept in the
    --raw file, so that --from-raw can report them)."""
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        gpu = "no nvidia-smi"
    versions = subprocess.run(HF[:1] + ["-c", "import torch, transformers; print(f'torch {torch.__version__}, transformers {transformers.__version__}')"],
                              capture_output=True, text=True).stdout.strip() or "torch not importable"
    version_file = os.path.join(os.path.dirname(os.path.abspath(bench)), "VERSION")
    ours = open(version_file).read().strip() if os.path.exists(version_file) else bench
    return {"gpu": gpu, "versions": versions, "ours": ours, "cores": os.cpu_count()}


def fmt(r, key, spec):
    return "failed" if "failed" in r else format(r[key], spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench", required=True, help="the CUDA build of hybrid-engine's bench example")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="BENCHMARKS.md")
    ap.add_argument("--raw", default="", help="also append every process's JSON line to this file")
    ap.add_argument("--smoke", action="store_true", help="tiny rows only (checks the script)")
    ap.add_argument("--timeout", type=int, default=150, help="seconds per process")
    ap.add_argument("--from-raw", default="", help="make the table from a --raw file instead of running")
    ap.add_argument("--only", action="append", default=[], help="only rows whose label contains this (repeatable)")
    ap.add_argument("--skip-compile", action="store_true", help="leave out the torch.compile variants")
    a = ap.parse_args()
    global RECORDED
    if a.from_raw:
        RECORDED = {}
        for line in open(a.from_raw):
            d = json.loads(line)
            cmd = d["cmd"]
            RECORDED[key_of(cmd) if cmd != ["machine"] else ("machine",)] = d["result"]
    dev = ["--device", a.device]
    machine = RECORDED.pop(("machine",), None) if RECORDED is not None else None
    if machine is None:
        machine = machine_facts(a.bench)
        if a.raw and RECORDED is None:
            with open(a.raw, "a") as f:
                f.write(json.dumps({"cmd": ["machine"], "result": machine}) + "\n")
    rows = [(label, args, [v for v in variants if not (a.skip_compile and "--compile" in v[1])])
            for label, args, variants in (SMOKE_ROWS if a.smoke else ROWS)
            if not a.only or any(o in label for o in a.only)]
    started = time.time()

    peaks = {}
    for dtype, args in PEAKS.items():
        if a.smoke:
            args = args.replace("8192", "1024")
        ours = run([a.bench] + args.split() + dev, a.timeout, a.raw)
        hf = run(HF + args.split() + dev, a.timeout, a.raw)
        peaks[dtype] = {"ours": ours.get("gflops_best"), "hf": hf.get("gflops_best")}

    results = []
    for label, args, variants in rows:
        print(f"[{time.time() - started:.0f}s] {label}", file=sys.stderr, flush=True)
        ours = run([a.bench] + args.split() + dev, a.timeout, a.raw)
        hfs = [(name, run(HF + args.split() + extra + dev, a.timeout, a.raw)) for name, extra in variants]
        results.append((label, args, variants, ours, hfs))
    elapsed = time.time() - started
    if RECORDED is not None:
        elapsed = sum(r.get("wall_s", 0) for r in RECORDED.values())

    def peak_of(dtype):
        known = [p for p in peaks[dtype].values() if p]
        return max(known) if known else None

    def mfu(r, dtype):
        p = peak_of(dtype)
        if "failed" in r or "flops_per_token" not in r or not p:
            return "-"
        return f"{100 * r['tokens_per_s'] * r['flops_per_token'] / (p * 1e9):.1f}%"

    table = ["| Configuration | Ours tokens/s | PyTorch variant | PyTorch tokens/s | Ours / PyTorch | Ours MFU | PyTorch MFU | Ours GPU MiB | PyTorch GPU MiB |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for label, args, variants, ours, hfs in results:
        dtype = "bf16" if "--dtype bf16" in args else "fp32"
        for i, (name, hf) in enumerate(hfs):
            ok = "failed" not in ours and "failed" not in hf
            ratio = f"{ours['tokens_per_s'] / hf['tokens_per_s']:.2f}" if ok else "n/a"
            first = i == 0
            table.append(
                f"| {label if first else ''} | {fmt(ours, 'tokens_per_s', '.0f') if first else ''} | {name} | "
                f"{fmt(hf, 'tokens_per_s', '.0f')} | {ratio} | {mfu(ours, dtype) if first else ''} | {mfu(hf, dtype)} | "
                f"{fmt(ours, 'gpu_used_mib', '.0f') if first else ''} | {fmt(hf, 'gpu_used_mib', '.0f')} |")
    phases = []
    for label, _, _, ours, hfs in results:
        if label.startswith("train"):
            def ph(x):
                return "failed" if "failed" in x else f"{x['ms_forward_backward']:.0f} / {x['ms_optimizer']:.0f}"
            phases.append(f"- {label}: ours {ph(ours)}; " + "; ".join(f"{n} {ph(h)}" for n, h in hfs))
    failures = [f"- {label}, {who}: {r['failed']}" for label, _, _, ours, hfs in results
                for who, r in [("ours", ours)] + hfs if "failed" in r]

    gpu, versions, ours_version, cores = machine["gpu"], machine["versions"], machine["ours"], machine["cores"]

    def show(p):
        return f"{p / 1000:.0f}" if p else "failed"
    report = "\n".join([
        f"## {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: GPU training and generation throughput against PyTorch",
        "",
        f"- GPU: {gpu} (`--device {a.device}` on both sides); {cores} CPU cores.",
        f"- Versions: ours {ours_version}; {versions}.",
        f"- Command: `scripts/bench/gpu_table.py{' --smoke' if a.smoke else ''}` (took {elapsed:.0f} s"
        + (", the processes' wall times; this table was made afterwards with `--from-raw`" if RECORDED is not None else "") + ").",
        "- Random init, vocabulary padded to 50304, random token ids. Training: median step time (forward",
        "  with dropout 0.1, backward, clip to norm 1.0, AdamW), tokens/s = B*T / step. Ours in bf16: a bf16",
        "  copy of fp32 master weights (DeepSpeed's mixed precision); PyTorch bf16: autocast on fp32 weights.",
        "  Generation: greedy, KV cache, 16-token prompts, 128 new tokens per row, prefill included.",
        "- GPU MiB: the driver's total - free, the most seen after a phase (CUDA context included). Not the peak",
        "  inside a step for ours: candle frees activations as they are dropped, PyTorch's allocator keeps them.",
        f"- Measured matmul peak (8192^3, best of the reps), TFLOP/s: bf16 ours {show(peaks['bf16']['ours'])}, PyTorch "
        f"{show(peaks['bf16']['hf'])}; fp32 ours {show(peaks['fp32']['ours'])}, PyTorch {show(peaks['fp32']['hf'])}. "
        "MFU is against the larger of the row's dtype.",
        "",
        *table,
        "",
        "Training step phases, medians in ms (forward+backward / optimizer: norm, clip, AdamW):",
        "",
        *phases,
        "",
        "Arguments of each row (given to both `bench` and `hf_bench.py`, with `--device`):",
        "",
        *[f"- {label}: `{args}`" for label, args, _, _, _ in results],
        *(["", "Failures:", ""] + failures if failures else []),
        "",
    ])
    print(report)
    if a.out:
        new = not os.path.exists(a.out)
        with open(a.out, "a") as f:
            if new:
                f.write("# Benchmarks\n\n")
            f.write(report + "\n")
        print(f"appended to {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
