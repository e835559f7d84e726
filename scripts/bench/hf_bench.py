#!/usr/bin/env python3
"""Throughput of Hugging Face transformers' GPT-2 (CPU, or ``--device cuda``), the reference half of ``run.sh``.

The PyTorch twin of ``hybrid-engine/examples/bench.rs``: same modes, flags and JSON fields, with
``"impl": "hf-pytorch-eager"``. ``GPT2LMHeadModel`` in float32 on the CPU (or ``--device cuda``) with
``attn_implementation="eager"``, randomly initialised with the vocabulary padded to 50304 as the
Rust side is, and ``torch.set_num_threads`` = the cores this process may use.

* ``train --model M --batch B --seq T --steps N --warmup W [--checkpoint-activations]``:
  ``model.train()`` (dropout 0.1), forward with ``labels``, backward, ``clip_grad_norm_(1.0)``,
  ``torch.optim.AdamW`` (default foreach implementation; no decay on biases and LayerNorm, as
  ours), on fresh random ids each step. ``--checkpoint-activations`` calls
  ``gradient_checkpointing_enable()`` (``activation_checkpointing_enable`` in transformers 5).
  Median over N steps after W warmup steps; ``tokens_per_s`` = B*T / step time; the medians of
  the phases are ``ms_forward_backward``, ``ms_clip``, ``ms_adamw`` and ``ms_optimizer`` (the
  last two together, as the Rust bench reports its fused optimizer step). ``labels=ids`` scores T-1
  positions where ours scores T (same B*T tokens through the model).
* ``generate --model M --batch B --prompt-len P --new-tokens N --warmup W --reps R``:
  ``model.generate(do_sample=False, max_new_tokens=N, min_new_tokens=N, use_cache=True)`` in
  ``torch.inference_mode()``, pad token set; median over R calls; ``tokens_per_s`` = B*N / call
  time (prefill included).

* ``peak --size N --reps R``: the f32 matmul rate of ``torch.matmul`` on (N, N) x (N, N), best
  and median of R after one warmup, in GFLOP/s.

GPU options (defaults: the CPU comparison's eager float32): ``--dtype bf16`` trains under
``torch.autocast(bfloat16)`` on float32 weights (PyTorch's mixed precision; the Rust side's bf16
copy of fp32 masters is DeepSpeed's) and generates with bfloat16 weights; ``--attn sdpa`` uses
``scaled_dot_product_attention`` (flash/memory-efficient kernels); ``--fused-adamw`` the fused
CUDA AdamW; ``--compile`` wraps the model in ``torch.compile`` when training and generates with a
static KV cache and the forward compiled (reduce-overhead: CUDA graphs), HF's fast-generation
recipe (compilation happens in the warmup steps or calls, outside the timing). ``impl`` names the variant (``hf-pytorch-sdpa-bf16-fused-compile``).
On a GPU, ``gpu_used_mib`` is the most device memory in use (the driver's total - free, sampled
after each phase, as ``bench.rs``), beside PyTorch's own ``peak_gpu_mib``.

Training reports ``flops_per_token`` (6N + 12LHQT, N all parameters but the position embedding,
as ``bench.rs``), for MFU. Peak RSS is ``getrusage(RUSAGE_SELF).ru_maxrss``: run one
configuration per process.
"""

import argparse
import json
import os
import resource
import statistics
import time

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

DEVICE = torch.device("cpu")  # set from --device in main()
GPU_USED_MIB = 0.0  # the most device memory seen in use (sample_gpu_memory)

GPT2_VOCAB = 50257
EOS = 50256
PADDED_VOCAB = 50304  # 50257 rounded up to a multiple of 128 (Megatron), as bench.rs does
SEED = 1234
LR = 1e-4

# (n_layer, n_embd, n_head, n_positions): hybrid_engine::Gpt2Config presets.
PRESETS = {
    "tiny": (4, 128, 4, 256),
    "gpt2": (12, 768, 12, 1024),
    "gpt2-medium": (24, 1024, 16, 1024),
}


def build_model(name):
    n_layer, n_embd, n_head, n_positions = PRESETS[name]
    config = GPT2Config(
        vocab_size=PADDED_VOCAB,
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        bos_token_id=EOS,
        eos_token_id=EOS,
        pad_token_id=EOS,
        attn_implementation=ATTN,
    )
    torch.manual_seed(SEED)
    return GPT2LMHeadModel(config).to(torch.float32).to(DEVICE)


ATTN = "eager"  # set from --attn in main()


def impl_name(a):
    parts = ["hf-pytorch", a.attn]
    if a.dtype == "bf16":
        parts.append("bf16")
    if getattr(a, "fused_adamw", False):
        parts.append("fused")
    if getattr(a, "compile", False):
        parts.append("compile")
    return "-".join(parts)


def sample_gpu_memory():
    global GPU_USED_MIB
    if DEVICE.type == "cuda":
        free, total = torch.cuda.mem_get_info(DEVICE)
        GPU_USED_MIB = max(GPU_USED_MIB, (total - free) / 2**20)


def sync():
    """Waits for the GPU's queued work, so timers measure it (a no-op on the CPU)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def random_ids(gen, rows, cols):
    return torch.randint(0, GPT2_VOCAB, (rows, cols), generator=gen).to(DEVICE)


def no_weight_decay(name):
    """Same groups as hybrid_engine::optim::no_weight_decay (biases, LayerNorm)."""
    return name.endswith(".bias") or ".ln_" in name  # HF names: transformer.h.0.ln_1.weight


def bench_train(a):
    model = build_model(a.model)
    if a.seq > model.config.n_positions:
        raise SystemExit(f"--seq {a.seq} exceeds {a.model}'s context of {model.config.n_positions}")
    if a.checkpoint_activations:
        # transformers 5 renamed gradient_checkpointing_enable (now a deprecated alias) to
        # activation_checkpointing_enable; both wrap each block in torch's non-reentrant checkpoint.
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
    model.train()
    named = list(model.named_parameters())  # the tied lm_head appears once, as wte
    groups = [
        {"params": [p for n, p in named if not no_weight_decay(n)], "weight_decay": 0.01},
        {"params": [p for n, p in named if no_weight_decay(n)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8, fused=a.fused_adamw)
    params = [p for _, p in named]
    forward = torch.compile(model) if a.compile else model
    autocast = torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=a.dtype == "bf16")
    gen = torch.Generator().manual_seed(SEED)

    times, phases, loss = [], ([], [], []), float("nan")  # phases: fwd+bwd, clip, AdamW
    for step in range(a.warmup + a.steps):
        ids = random_ids(gen, a.batch, a.seq)  # (B, T); labels are shifted inside the model
        sync()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast:
            out = forward(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        sync()
        backward_done = time.perf_counter()
        sample_gpu_memory()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        sync()
        clip_done = time.perf_counter()
        opt.step()
        sync()
        end = time.perf_counter()
        sample_gpu_memory()
        loss = out.loss.item()
        if step >= a.warmup:
            times.append(end - start)
            phases[0].append(backward_done - start)
            phases[1].append(clip_done - backward_done)
            phases[2].append(end - clip_done)
    step_s = statistics.median(times)
    return {
        "impl": impl_name(a),
        "mode": "train",
        "model": a.model,
        "batch": a.batch,
        "seq": a.seq,
        "checkpoint_activations": a.checkpoint_activations,
        "dtype": a.dtype,
        "vocab_size": PADDED_VOCAB,
        "params": model.num_parameters(),
        "flops_per_token": train_flops_per_token(model, a.seq),
        "threads": torch.get_num_threads(),
        "warmup": a.warmup,
        "steps": a.steps,
        "tokens_per_s": a.batch * a.seq / step_s,
        "ms_per_step": step_s * 1e3,
        "ms_per_step_min": min(times) * 1e3,
        "ms_per_step_max": max(times) * 1e3,
        "ms_forward_backward": statistics.median(phases[0]) * 1e3,
        "ms_clip": statistics.median(phases[1]) * 1e3,
        "ms_adamw": statistics.median(phases[2]) * 1e3,
        "ms_optimizer": statistics.median([c + a for c, a in zip(phases[1], phases[2])]) * 1e3,
        "last_loss": loss,
        "peak_rss_mib": peak_rss_mib(),
    }


def train_flops_per_token(model, seq):
    """6N + 12LHQT (PaLM appendix B, nanoGPT's estimate_mfu): N counts every parameter but the
    position embedding (the tied token embedding is the LM head's weight)."""
    cfg = model.config
    n = model.num_parameters() - model.transformer.wpe.weight.numel()
    return 6 * n + 12 * cfg.n_layer * cfg.n_head * (cfg.n_embd // cfg.n_head) * seq


def bench_peak(a):
    torch.manual_seed(SEED)
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    x = torch.randn(a.size, a.size, device=DEVICE).to(dt)
    y = torch.randn(a.size, a.size, device=DEVICE).to(dt)
    times = []
    for rep in range(a.reps + 1):
        sync()
        start = time.perf_counter()
        torch.matmul(x, y)
        sync()
        if rep > 0:
            times.append(time.perf_counter() - start)
    flops = 2.0 * a.size**3
    return {
        "impl": "hf-pytorch",
        "mode": "peak",
        "size": a.size,
        "dtype": a.dtype,
        "reps": a.reps,
        "threads": torch.get_num_threads(),
        "gflops_best": flops / min(times) / 1e9,
        "gflops_median": flops / statistics.median(times) / 1e9,
    }


def bench_generate(a):
    model = build_model(a.model)
    if a.prompt_len + a.new_tokens > model.config.n_positions:
        raise SystemExit("--prompt-len + --new-tokens exceeds the model's context")
    if a.dtype == "bf16":
        model = model.to(torch.bfloat16)
    model.eval()
    gen = torch.Generator().manual_seed(SEED)
    ids = random_ids(gen, a.batch, a.prompt_len)  # (B, P), all the same length: no padding
    mask = torch.ones_like(ids)
    times = []
    sampling = {"do_sample": False}
    if a.compile:
        # HF's fast generation recipe: a static KV cache (fixed shapes) and the forward compiled
        # with CUDA graphs; compilation and capture happen in the warmup calls, outside the timing.
        # transformers compiles the forward itself when the cache is static on a GPU (its
        # CompileConfig: reduce-overhead); versions without CompileConfig need it done here.
        sampling["cache_implementation"] = "static"
        if not hasattr(transformers.GenerationConfig(), "compile_config"):
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    if a.temperature is not None:  # HF's defaults otherwise: no top-k, no top-p
        sampling |= {"do_sample": True, "temperature": a.temperature, "top_k": a.top_k or 0, "top_p": a.top_p or 1.0}
    with torch.inference_mode():
        for rep in range(a.warmup + a.reps):
            start = time.perf_counter()
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                **sampling,
                max_new_tokens=a.new_tokens,
                min_new_tokens=a.new_tokens,  # EOS suppressed: exactly N tokens per row
                use_cache=True,
                pad_token_id=EOS,
            )
            sync()
            secs = time.perf_counter() - start
            sample_gpu_memory()
            assert out.shape == (a.batch, a.prompt_len + a.new_tokens), out.shape
            if rep >= a.warmup:
                times.append(secs)
    call_s = statistics.median(times)
    return {
        "impl": impl_name(a),
        "mode": "generate",
        "model": a.model,
        "batch": a.batch,
        "prompt_len": a.prompt_len,
        "new_tokens": a.new_tokens,
        "dtype": a.dtype,
        "vocab_size": PADDED_VOCAB,
        "threads": torch.get_num_threads(),
        "warmup": a.warmup,
        "reps": a.reps,
        "tokens_per_s": a.batch * a.new_tokens / call_s,
        "ms_per_call": call_s * 1e3,
        "ms_per_token_step": call_s * 1e3 / a.new_tokens,
        "peak_rss_mib": peak_rss_mib(),
    }


def main():
    global DEVICE, ATTN
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    t = sub.add_parser("train")
    g = sub.add_parser("generate")
    pk = sub.add_parser("peak")
    for s in (t, g, pk):
        s.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
        s.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
        s.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    pk.add_argument("--size", type=int, required=True)
    pk.add_argument("--reps", type=int, required=True)
    for s in (t, g):
        s.add_argument("--model", required=True, choices=sorted(PRESETS))
        s.add_argument("--batch", type=int, required=True)
        s.add_argument("--warmup", type=int, required=True)
    t.add_argument("--seq", type=int, required=True)
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--checkpoint-activations", action="store_true")
    t.add_argument("--fused-adamw", action="store_true")
    t.add_argument("--compile", action="store_true")
    g.add_argument("--prompt-len", type=int, required=True)
    g.add_argument("--new-tokens", type=int, required=True)
    g.add_argument("--reps", type=int, required=True)
    g.add_argument("--temperature", type=float, help="sample (default: greedy)")
    g.add_argument("--top-k", type=int)
    g.add_argument("--top-p", type=float)
    g.add_argument("--compile", action="store_true", help="static cache + torch.compile (reduce-overhead)")
    a = p.parse_args()
    DEVICE, ATTN = torch.device(a.device), a.attn
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"error: --device {a.device}: this PyTorch sees no CUDA GPU")

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    transformers.logging.set_verbosity_error()  # no per-call generation warnings on stdout/stderr
    result = {"train": bench_train, "generate": bench_generate, "peak": bench_peak}[a.mode](a)
    result["device"] = str(DEVICE) if DEVICE.type == "cpu" else f"cuda:{DEVICE.index or 0}"
    if DEVICE.type == "cuda":
        result["peak_gpu_mib"] = torch.cuda.max_memory_allocated(DEVICE) / 2**20
        result["gpu_used_mib"] = GPU_USED_MIB
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
