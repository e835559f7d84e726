#!/usr/bin/env python3
"""Projected training throughput of a GPT-2 on one node of 8 GPUs at tensor-parallel sizes
T = 1, 2, 4, 8 (D = 8 / T data-parallel groups), from the communication volumes this
implementation moves (checked against the CPU ranks in BENCHMARKS.md: the formula below gives
the measured 49.00 and 73.50 MiB per step for gpt2-medium, 1 x 128 tokens, fp32, at T = 2 and 4)
and published hardware figures. Usage: scripts/bench/tp-projection.py [MODEL]

Per step, for a global batch of G sequences of s tokens, micro-batch b per data-parallel rank:
- compute: 6 N tokens FLOPs (8 N with activation recomputation) over 8 GPUs at a fixed MFU;
- tensor parallel, per layer and sequence: all-reduces of s x h activations, 2 in forward and 2
  in backward (f's and g's conjugates; 2 more with recomputation), plus the embedding's and the
  head's; a ring all-reduce sends 2 (T-1)/T of the buffer; on the critical path (not overlapped);
- data parallel: the gradient all-reduce of this rank's N / T parameters over D ranks, not
  overlapped with backward (as implemented);
- time = bytes sent per GPU / NCCL bus bandwidth.
Memory per GPU: 16 bytes per held parameter (bf16 weights and gradients, fp32 masters and Adam
moments) plus Megatron's activations s b h (10 + 24/T + 5 a s/(h T)) per layer in 16-bit.
"""
import sys

PRESETS = {  # layers, hidden, heads, vocab, positions
    "gpt2": (12, 768, 12, 50257, 1024),
    "gpt2-medium": (24, 1024, 16, 50257, 1024),
    "gpt2-large": (36, 1280, 20, 50257, 1024),
    # GPT-2 XL has 25 heads, which T = 2, 4, 8 do not divide (Megatron's rule, refused here too):
    # the projection regroups its 1600 channels into 32 heads of 50, the same parameters and FLOPs.
    "gpt2-xl": (48, 1600, 32, 50257, 1024),
}
PEAK_BF16 = 989e12   # H100 SXM dense bf16 FLOP/s
MFU = 0.40           # llm.c's GPT-2 figure on H100; held fixed across T (see the note below)
BUS_BW = 450e9       # NCCL all-reduce bus bandwidth on 8 x H100 SXM (NVLink 4), nccl-tests order
GPUS, MEM = 8, 80 * 2**30


def params(l, h, v, p):
    return v * h + p * h + l * (12 * h * h + 13 * h) + 2 * h


def tp_bytes_per_sequence(l, h, s, t, elem, recompute):
    """Bytes a TP rank sends per sequence in forward and backward."""
    if t == 1:
        return 0.0
    per_layer = (6 if recompute else 4) * s * h * elem
    outer = 2 * s * h * elem  # the embedding's all-reduce and the head's input gradient
    return (l * per_layer + outer) * 2 * (t - 1) / t


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "gpt2-xl"
    l, h, a, v, s = PRESETS[name]
    n = params(l, h, v, s)
    # The check against the CPU measurement (fp32, 1 x 128 tokens, no recomputation).
    lm, hm = PRESETS["gpt2-medium"][:2]
    for t, measured in [(2, 49.00), (4, 73.50)]:
        got = tp_bytes_per_sequence(lm, hm, 128, t, 4, False) / 2**20
        assert abs(got - measured) < 0.01, (t, got, measured)
    g, b = 64, 4  # sequences per step, micro-batch per data-parallel rank
    print(f"{name}: {n / 1e9:.2f}B parameters, {l} layers, h = {h}, {a} heads; global batch {g} x {s} tokens, "
          f"micro-batch {b}, bf16, activation recomputation where the activations would not fit")
    print("| T x D | parameters per GPU | model states per GPU (GiB) | activations per GPU (GiB) | recompute | "
          "compute (ms) | TP comm (ms) | DP comm (ms) | tokens/s (8 GPUs) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t in [1, 2, 4, 8]:
        d = GPUS // t
        held = (v * h) / t + s * h + l * (12 * h * h / t + 7 * h / t + 6 * h) + 2 * h
        states = 16 * held
        act_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
        full = l * act_layer + 4 * s * b * v / t
        recompute = states + full > 0.9 * MEM
        acts = (l * 2 * s * b * h + act_layer + 4 * s * b * v / t) if recompute else full
        tokens = g * s
        flops = (8 if recompute else 6) * n * tokens
        compute = flops / (GPUS * MFU * PEAK_BF16)
        seqs_per_rank = g / d
        tp = tp_bytes_per_sequence(l, h, s, t, 2, recompute) * seqs_per_rank / BUS_BW
        dp = 0.0 if d == 1 else 2 * (d - 1) / d * 2 * held / BUS_BW
        total = compute + tp + dp
        print(f"| {t} x {d} | {held / 1e6:.0f}M | {states / 2**30:.1f} | {acts / 2**30:.1f} | {'yes' if recompute else 'no'} | "
              f"{compute * 1e3:.0f} | {tp * 1e3:.0f} | {dp * 1e3:.0f} | {tokens / total:,.0f} |")


main()
