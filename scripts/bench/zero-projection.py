#!/usr/bin/env python3
"""Projected data-parallel efficiency of GPT-2 training on one node of 8 GPUs at ZeRO stages 0-3,
from the communication volumes this implementation moves and one GPU's measured step time.
Usage: scripts/bench/zero-projection.py [MODEL] [STEP_MS]

- Volumes: ZeRO's ring volumes per step, the formula of tests/distributed.rs
  (`ring_bytes_per_step`), which asserts the bytes our ranks send to within 0.001% at every stage
  on 2 and 3 ranks, fp32 and bf16 gradient reductions; here bf16 training: stage 0 all-reduces the
  gradients (f32 on the wire, or bf16 with `--communication-data-type bf16`), stages 1 and 2
  reduce-scatter them and all-gather the updated weights into the bf16 compute copy (2 bytes a
  value: the fp32 masters sharded), stage 3 gathers each unit in bf16 for forward and again for
  its recomputation in backward and reduce-scatters its gradient.
- Compute: one GPU's measured step (forward, backward, optimizer) at the same micro-batch, the
  default gpt2 B8 T1024 bf16 on an H200 (BENCHMARKS.md, 2026-11-28 21:29 UTC: 29.2 ms; gpt2-medium
  70.4 ms). Each of the 8 GPUs runs that micro-batch: the per-GPU work does not shrink.
- Bandwidth: NCCL's ring bus bandwidth on 8 GPUs over NVLink 4 (H100/H200 SXM, 900 GB/s per GPU),
  450 GB/s, the order nccl-tests reports for all-reduce, all-gather and reduce-scatter at these
  sizes (a published figure: not measured here, one GPU being all this project was lent).
- Time of a collective = bytes a rank sends / bus bandwidth. Efficiency = compute / (compute +
  exposed communication). Two bounds: none overlapped, and every collective overlapped that does
  not wait on the end of backward or the step (DeepSpeed's `overlap_comm`, stage 3's prefetch; see
  the table's code). As implemented, NCCL runs on a stream of its own: stage 3 prefetches the next
  unit's all-gather and overlaps each unit's gradient reduce-scatter with the next unit's
  backward (the overlapped column), stages 0-2 reduce after backward (the other column).
The optimizer states are on the device at every stage (as implemented since issue 41 item 5).
"""
import sys

PRESETS = {  # layers, hidden, vocab, positions
    "gpt2": (12, 768, 50257, 1024),
    "gpt2-medium": (24, 1024, 50257, 1024),
}
MEASURED_STEP_MS = {"gpt2": 29.2, "gpt2-medium": 70.4}  # H200, bf16, B8 T1024, one GPU
BUS_BW = 450e9
GPUS = 8


def parameters(l, h, v, p):
    outer = v * h + p * h + 2 * h           # wte, wpe, ln_f
    blocks = l * (12 * h * h + 13 * h)      # each block's linears, biases and LayerNorms
    return outer, blocks


def ring_bytes_per_step(outer, blocks, stage, world, micro_batches, half_gradients, half_weights):
    """tests/distributed.rs's `ring_bytes_per_step`: the bytes a rank sends in one step."""
    phase = lambda values: 4.0 * values * (world - 1) / world  # noqa: E731 (one ring phase, f32)
    g = 0.5 if half_gradients else 1.0
    w = 0.5 if half_weights else 1.0
    if stage == 0:
        return 2.0 * g * phase(outer + blocks)
    if stage == 1:
        return (g + w) * phase(outer + blocks)
    if stage == 2:
        return (micro_batches * g + w) * phase(outer + blocks)
    return micro_batches * (phase(outer) * (2.0 * w + 2.0 * g) + phase(blocks) * (2.0 * w + g))


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "gpt2"
    l, h, v, p = PRESETS[name]
    step = float(sys.argv[2]) if len(sys.argv) > 2 else MEASURED_STEP_MS[name]
    outer, blocks = parameters(l, h, v, p)
    # The check against the test's figure for the tiny preset is the test itself; here the
    # parameter count against GPT-2's published 124.44M.
    if name == "gpt2":
        assert outer + blocks == 124_439_808, outer + blocks
    print(f"{name}: {(outer + blocks) / 1e6:.2f}M parameters, one GPU's step {step:.1f} ms (B8 T1024 bf16), "
          f"{GPUS} GPUs, bus bandwidth {BUS_BW / 1e9:.0f} GB/s")
    print("| stage | gradients on the wire | MiB sent per GPU per step | communication (ms) | efficiency, none overlapped | "
          "efficiency, overlapped | tokens/s (8 GPUs, none overlapped) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for stage in range(4):
        for half_gradients in (False, True):
            sent = ring_bytes_per_step(outer, blocks, stage, GPUS, 1, half_gradients, stage > 0)
            comm = sent / BUS_BW * 1e3
            # What cannot overlap compute even with overlap: the collectives that wait on the
            # whole backward or the step. Stage 0 in buckets during backward: the last bucket,
            # the outer unit's gradients (the embeddings', complete only when backward ends);
            # stage 1: the reduce-scatter at the boundary and the weights' gather after the
            # step; stage 2: the gather after the step (its buckets go during backward) and the
            # outer unit's last bucket; stage 3: the outer unit's first gather and its last
            # reduce-scatter (each block's gather prefetched, its gradient's reduce-scatter
            # behind the next block's backward).
            ring = lambda values, half: 4.0 * values * (GPUS - 1) / GPUS * (0.5 if half else 1.0)  # noqa: E731
            total = outer + blocks
            exposed = {
                0: 2 * ring(outer, half_gradients),
                1: sent,
                2: ring(total, True) + ring(outer, half_gradients),
                3: ring(outer, True) + ring(outer, half_gradients),
            }[stage] / BUS_BW * 1e3
            none = step / (step + comm)
            overlapped = step / (step + exposed)
            tokens = GPUS * 8 * 1024 / ((step + comm) / 1e3)
            wire = "bf16" if half_gradients else "f32"
            print(f"| {stage} | {wire} | {sent / 2**20:.0f} | {comm:.2f} | {100 * none:.1f}% | {100 * overlapped:.1f}% | "
                  f"{tokens:,.0f} |")


main()
