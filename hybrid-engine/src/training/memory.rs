//! Memory accounting in the open (llm.c's habit): bytes for parameters, gradients and AdamW
//! moments from the one parameter inventory, and an estimate of activation memory for a
//! micro-batch, with and without activation checkpointing. Printed at startup; the measured
//! peak (see `metrics::peak_rss_mib`) is printed at the end so the two can be compared.

use crate::model::gpt2::Gpt2Config;
use crate::model::params::parameter_count;
use crate::training::zero::ZeroStage;

const MIB: f64 = 1024.0 * 1024.0;

/// Refuses, before training allocates it, a plan whose estimated total exceeds the machine's
/// memory (RAM and swap) on the CPU: `--micro-batch-size` or `--seq-length` too large for it.
pub fn check_plan_fits(plan: &MemoryPlan, device: &candle_core::Device) -> anyhow::Result<()> {
    let (Some(memory), true) = (crate::runtime::machine_memory_bytes(), device.is_cpu()) else { return Ok(()) };
    plan_fits(plan, memory)
}

/// [`check_plan_fits`] against `memory` bytes.
fn plan_fits(plan: &MemoryPlan, memory: u64) -> anyhow::Result<()> {
    if plan.total() > memory {
        let gib = |x: u64| x as f64 / (1024.0 * MIB);
        anyhow::bail!(
            "the memory plan needs an estimated {:.1} GiB ({:.1} GiB of it activations for a micro-batch of {} x {} tokens), more than this machine's {:.1} GiB of memory (RAM and swap): lower the micro-batch size or the sequence length, or turn on activation checkpointing",
            gib(plan.total()),
            gib(plan.activation_bytes()),
            plan.activations.b,
            plan.activations.t,
            gib(memory)
        );
    }
    Ok(())
}

/// Which implementation runs a micro-batch: it decides what forward keeps for backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernels {
    /// The fused CPU f32 kernels (`kernels/ops/*.rs`, the default on the CPU).
    FusedCpu,
    /// The CUDA kernels of the same ops (their `cuda_fwd`, the default on a CUDA GPU in any dtype):
    /// LayerNorm, linear, GELU, dropout, embedding and the cross-entropy on given logits, with
    /// the flash attention where `ops::flash_attention_takes` the dtype (bf16 and f16 with heads
    /// of 64) and the composed attention (its masked softmax and dropout still the kernels')
    /// elsewhere, f32 included. The LM head's logits are a matmul in the compute dtype either way
    /// (the fused LM head with cross-entropy is CPU-only).
    FusedGpu { flash_attention: bool },
    /// The composed candle ops: other devices and dtypes, and `HYBRID_ENGINE_REFERENCE_OPS=1`.
    Composed,
}

/// The micro-batch an activation estimate is for.
#[derive(Clone, Debug)]
pub struct ActivationShape {
    pub cfg: Gpt2Config,
    pub b: usize,
    pub t: usize,
    pub checkpoint: bool,
    pub kernels: Kernels,
    /// An LM head (logits over the vocabulary); false for a reward model's score head.
    pub lm_head: bool,
    /// The compute dtype's size.
    pub dtype_bytes: usize,
    /// All parameters (adapters included) and those the optimizer updates: backward forms a
    /// gradient for the trainable ones only (frozen weights enter the model detached).
    pub parameters: usize,
    pub trainable: usize,
    /// Gradient accumulation over several micro-batches: from the second on, backward's fresh
    /// gradients are formed while the accumulated ones are held.
    pub accumulating: bool,
    /// The held (accumulated) gradients' size per trainable parameter: 4 (f32), or the compute
    /// dtype's where they stay in it (see [`MemoryPlan::held_gradient_bytes`]). Backward forms
    /// gradients in the compute dtype; where the two differ, adding them to the accumulator casts
    /// each one.
    pub grad_bytes: usize,
    /// LoRA adapters on the blocks' linears (`--lora-dim` above 0).
    pub lora: bool,
    /// Tensor-parallel ranks splitting each layer (1: none).
    pub tp: usize,
    /// ZeRO stage 3 across ranks: each unit's weights and gradients are gathered and
    /// reduce-scattered one unit at a time and counted apart ([`MemoryPlan::gathered_unit_bytes`]).
    pub sharded: bool,
}

/// What one micro-batch of B x T tokens allocates beyond the weights, their compute copy, the
/// AdamW moments and the accumulated gradients, at its peak: the activations kept for backward,
/// backward's transients and the gradients it forms before they are added to the accumulated
/// ones. N = B*T tokens, C, L layers, V vocabulary rows (the LM head's terms only with an LM
/// head), P parameters, P_t of them trainable (what stays accumulated), W = V*C the tied
/// embedding's gradient.
///
/// [`Kernels::FusedCpu`], the peak of the phases found by counting every allocation
/// (`tests/memory_plan.rs` checks 36 configurations: at most 3.3% over, never under by more than
/// 0.4%):
/// - the LM head's backward: the activations A, about (20L + 6) (N, C) tensors (the fused
///   attention keeps no (B, NH, T, T) tensor; LoRA adapters add about 3 (N, out) each), the
///   (N, V) logits that forward kept and backward turns in place into their gradient, and the
///   op's output, dx (N, C) stacked on dwte (W);
/// - the embedding's backward: A, an (N, C), the fresh gradients of the rest of the model
///   (P - W) and two W: the lookup's dwte and wte's gradient (the head's, which the lookup's is
///   added to; with a score head, the lookup's own copied: candle's backward copies a
///   variable's first gradient, where upstream added it to a tensor of zeros, third_party/);
/// - with accumulation, adding backward's gradients (P) to the accumulated ones while A lives,
///   one new (W) sum at a time: never above the embedding's phase, so not a term.
///
/// The first micro-batch's peak is P_t lower: its gradients become the accumulated ones. With
/// checkpointing only each block's input stays; the head's phase keeps them (about L + 4 (N, C)
/// tensors with its own); the embedding's gradient, formed in a backward of its own, and its
/// sum with the head's meet as two W beside one block's recomputed activations (accumulating
/// too, with or without the head's). A frozen model (`--only-optimize-lora`) forms no W and no
/// gradient but the adapters'. Under ZeRO stage 3 the formed gradients are a gathered unit's, the
/// plan's line apart with the unit's weights: the head's phase keeps (N, V), L + 5 (N, C) and
/// dwte^T (W), which the unit's gradient is copied from; a recomputed block's as with
/// checkpointing; the embeddings' dwte is formed from the ids alone, within the unit's line.
///
/// [`Kernels::FusedGpu`], counted from the CUDA ops of `kernels/ops/*.rs`, candle's backward and
/// `train_step`, then checked against the CUDA pool's measured peak (bench train, H200,
/// 2026-11-27: gpt2 and gpt2-medium, bf16 and f32, with and without checkpointing; all five within
/// 0.1%, with f32 gradients). Those measurements predate candle's backward copying a variable's
/// first gradient instead of adding it to zeros (third_party/README.md), which should take one W
/// off the phases that count "the zeros" below (the LM head's: the peak of gpt2 at B8 T1024);
/// the terms still count it until a GPU measures the change, so the plan may be up to one W
/// over there (77 MiB for gpt2 in bf16, about 1%). d is the compute dtype's size, g the held
/// gradients' ([`MemoryPlan::held_gradient_bytes`]: 4, or d). The peak of these phases, less the
/// held gradients (the plan's own line):
/// - forward keeps A, all in d but the f32 mask and statistics: per block 20 (N, C) tensors with
///   the flash attention (LayerNorm outputs 2, c_attn 3, the attention's output, c_proj 2,
///   dropouts 2, residual sums 2, c_fc 4, GELU 4) and its row maxima and 1/sums, 2 (B, NH, T)
///   f32; the composed attention (f32, or heads other than 64) keeps 8 (N, C) in place of the
///   one (q, k and v each a reshape copy of a strided slice and a contiguous copy of that, the
///   heads' output and its merged copy) and 3 (B, NH, T, T) (scores, probabilities, dropout);
///   the embedding's lookup, sum and dropout and ln_f, 4 (N, C); the head's matmul's (N, V)
///   logits; the (1, 1, T, T) f32 mask; LoRA as on the CPU. All of it lives until
///   `GradAccumulator::add` has run: the loss holds the graph;
/// - the LM head's backward: A, d(logits) (N, V), dx (N, C) and 3 W. candle's matmul backward
///   forms dx and dwte^T by ops on tracked tensors (wte, ln_f's output), so each holds d(logits)
///   until its node is processed; wte's first gradient is added to a zeros tensor (a variable's
///   always is): dwte^T, the zeros and the sum;
/// - the first block's backward (the last processed): A, every other gradient formed (P, in d)
///   and the MLP's gradients, 9 (N, C) (the GELU's input and output, 4C wide, and the residual
///   stream's), or the composed attention's 2 (B, NH, T, T) where larger;
/// - the embedding's backward: A and P + 2W in d (the lookup's dwte, the head's and their sum;
///   with a score head, the lookup's dwte, the zeros it is added to and the sum) and an (N, C);
/// - `GradAccumulator::add`, A still alive: the P formed in d and, where g is not d, their
///   g-byte copies; accumulating, one tensor's cast and sum at a time beside the held ones.
///
/// With f32 gradients in bf16 the last phase is the peak where the logits are small beside the
/// parameters (gpt2 at B4 T512, gpt2-medium at B4 T1024: A + 6P), the LM head's where they are
/// large (gpt2 at B8 T1024, bf16 and f32). With gradients held in d the add phase costs nothing
/// (the formed gradients are the held ones) and the embedding's or the head's is the peak.
///
/// With checkpointing, kept through backward: each block's input, the last block's output and
/// the head's leaf (a copy of it), and the head's graph, ln_f's output and the logits (the loss
/// lives until the end): (L + 3) (N, C) and (N, V). The phases: the head's backward as above
/// (the logits twice: the peak for gpt2 B8 T1024), a recomputed block with its surrogate
/// out * grad (5 (N, C) beside the block's: its input's copy, the product, its gradient,
/// candle's gradient for the untracked incoming gradient, which holds that, and the incoming
/// gradient) and the held gradients, and the embeddings recomputed with wte's gradient (3 W in a
/// store of its own, or in `add` the stored W and its sum with the held one). Adding the head's
/// gradients between them (the leaf's (N, C), wte's W, and its sum into the held one where
/// accumulating or cast) is not a term: the embeddings' phase holds as much and 7 (N, C) more
/// (with a score head, not accumulating: 3 W, and the held gradients with wte's among them,
/// against W and its cast), and with a frozen trunk it equals the head's backward.
///
/// A frozen wte (`--only-optimize-lora`): candle still forms dwte^T, under an untracked node
/// that backward never processes, so it and d(logits) stay until backward returns. Not counted:
/// tensors of N values or fewer (ids, losses), the attention's tile map, and the optimizer's
/// step, which runs after the activations are freed (clipping replaces one gradient at a time;
/// AdamW updates in place).
///
/// [`Kernels::Composed`], counted from the graph (not measured: it runs on the GPU and in half
/// precision): per block about 30 (N, C) tensors (LayerNorm intermediates, q/k/v and their
/// head-major copies, projections, residuals, the 4C-wide MLP tensors counting 4 each) and 5
/// (B, NH, T, T) attention tensors; the LM head's logits with the log-softmax intermediates,
/// 4 (N, V) tensors; all in the compute dtype (the attention softmax and LayerNorm statistics
/// stay f32 in half precision, so that is an estimate).
///
/// Computed in f64, exact for every size below 2^53 bytes, so that an absurd batch size
/// saturates at `u64::MAX` (and is refused by [`check_plan_fits`]) instead of overflowing.
pub fn activation_bytes(a: &ActivationShape) -> u64 {
    if a.tp > 1 {
        return megatron_activation_bytes(a) as u64;
    }
    let (b, t) = (a.b as f64, a.t as f64);
    let (n, c, l) = (b * t, a.cfg.hidden_size() as f64, a.cfg.num_layers() as f64);
    let v = if a.lm_head { a.cfg.vocab_size as f64 } else { 0.0 };
    let bytes = match a.kernels {
        Kernels::FusedCpu => {
            let nc = n * c;
            // Frozen weights are detached from the graph: no gradient is formed for them, the
            // tied embedding's included (only `--only-optimize-lora` freezes any).
            let frozen = a.trainable < a.parameters;
            let kept = a.trainable as f64;
            let formed = if frozen { kept } else { a.parameters as f64 };
            let w = if frozen { 0.0 } else { a.cfg.vocab_size as f64 * c };
            // The LM head's dwte; its sum with the embedding's own is a second W.
            let head_w = if a.lm_head { w } else { 0.0 };
            // An adapter keeps about 3 (N, out) tensors; on all four linears, 27 (N, C) a block.
            let lora = if a.lora { 27.0 } else { 0.0 };
            let floats = if a.sharded {
                // ZeRO-3 (checkpointed): no whole gradient is ever formed or held, and the
                // gathered unit's weights with its gradient are the plan's line apart (the LM
                // head's dwte; the embeddings' dwte, formed from the ids without the unit). Left:
                // the kept inputs, the head's logits, turned in place into their gradient, dx,
                // and beside the unit's gradient the transposed dwte^T it is copied from (a
                // variable's first gradient is a copy of its own: measured, one W); or a
                // recomputed block's activations as below.
                (n * v + head_w + (l + 5.0) * nc).max((l + 15.0 + lora) * nc)
            } else if a.checkpoint {
                let head = n * v + head_w + (l + 4.0) * nc;
                if a.accumulating {
                    head.max(2.0 * w + (l + 17.0 + lora) * nc)
                } else {
                    (head - kept).max(head_w + w + (l + 15.0 + lora) * nc)
                }
            } else {
                let acts = forward_kept_values(&a.cfg, n, a.lora);
                let head = acts + n * v + nc + head_w;
                let rest = formed - w;
                let embedding = acts + nc + 2.0 * w + rest;
                head.max(embedding) - if a.accumulating { 0.0 } else { kept }
            };
            4.0 * floats
        }
        Kernels::FusedGpu { flash_attention } => fused_gpu_activation_bytes(a, flash_attention),
        Kernels::Composed => {
            let attn = b * a.cfg.num_heads() as f64 * t * t;
            let per_block = 30.0 * n * c + 5.0 * attn;
            let head = 4.0 * n * v + 6.0 * n * c;
            let blocks = if a.checkpoint { l * n * c + per_block } else { l * per_block };
            a.dtype_bytes as f64 * (blocks + head)
        }
    };
    // `as` saturates: beyond u64 is u64::MAX.
    bytes as u64
}

/// The values a forward of `rows` positions keeps for backward with the fused CPU kernels, as
/// [`activation_bytes`] counts them: about (20 L + 6) (N, C) tensors, 27 more a block with LoRA
/// adapters. Also what a forward without backward keeps where the weights are variables (step
/// 3's experience: candle keeps every op's output on the graph until the result is dropped).
pub fn forward_kept_values(cfg: &Gpt2Config, rows: f64, lora: bool) -> f64 {
    let lora = if lora { 27.0 } else { 0.0 };
    ((20.0 + lora) * cfg.num_layers() as f64 + 6.0) * (rows * cfg.hidden_size() as f64)
}

/// [`activation_bytes`] for [`Kernels::FusedGpu`] (see there), in bytes.
fn fused_gpu_activation_bytes(a: &ActivationShape, flash_attention: bool) -> f64 {
    let (b, t) = (a.b as f64, a.t as f64);
    let (n, c, l, heads) = (b * t, a.cfg.hidden_size() as f64, a.cfg.num_layers() as f64, a.cfg.num_heads() as f64);
    let nc = n * c;
    let nv = if a.lm_head { n * a.cfg.vocab_size as f64 } else { 0.0 };
    // d: the compute dtype's size, what backward forms gradients in; g: the held gradients'.
    let (d, g) = (a.dtype_bytes as f64, a.grad_bytes as f64);
    let cast = a.grad_bytes != a.dtype_bytes;
    let trainable = a.trainable as f64;
    let frozen = a.trainable < a.parameters;
    let formed = if frozen { trainable } else { a.parameters as f64 };
    let table = a.cfg.vocab_size as f64 * c;
    let w = if frozen { 0.0 } else { table };
    let held = g * trainable;
    let held_before = if a.accumulating { held } else { 0.0 };

    // What forward keeps, A: per block 19 (N, C) tensors besides the attention's (LayerNorm
    // outputs 2, c_attn 3, c_proj 2, dropouts 2, residual sums 2, c_fc 4, GELU 4) and the
    // attention's; the embedding's lookup, sum and dropout and ln_f, 4; the logits.
    let (attention_nc, attention_rest) = if flash_attention {
        // y; the row maxima and 1/sums, f32 (B, NH, T) each.
        (1.0, 2.0 * 4.0 * n * heads)
    } else {
        // q, k, v: each a reshape copy and a contiguous copy of it; the heads' output and its
        // merged copy; scores, probabilities and dropped probabilities (B, NH, T, T).
        (8.0, 3.0 * d * b * heads * t * t)
    };
    let lora = if a.lora { 27.0 } else { 0.0 };
    let block = d * (19.0 + attention_nc + lora) * nc + attention_rest;
    // The additive mask (1, 1, T, T), f32.
    let mask = 4.0 * t * t;
    // The largest transient of a block's backward beside what it keeps: the MLP's, the GELU's
    // input and output gradients (4C wide each) beside the residual stream's pending gradient;
    // the composed attention's, two (B, NH, T, T) gradients (the dropout's input and output,
    // the first holding the output gradient of the (N, C) heads alive).
    let block_transient =
        if flash_attention { d * 9.0 * nc } else { (d * 9.0 * nc).max(2.0 * d * b * heads * t * t + 2.0 * d * nc) };
    // The LM head's backward, logits' matmul: candle computes dx (N, C) and dwte^T (C, V) from
    // d(logits) (N, V), and both keep it alive through their own graph until their nodes are
    // processed; the transpose's node adds dwte^T to a zeros tensor (wte is a variable): three W
    // at once. With wte frozen dwte^T is still computed, stored under an untracked node that is
    // never processed: it and d(logits) stay until backward returns.
    let (head, head_leftover) = match (a.lm_head, frozen) {
        (false, _) => (0.0, 0.0),
        (true, false) => (d * (nv + nc + 3.0 * w), 0.0),
        (true, true) => (d * (nv + nc + table), d * (nv + table)),
    };
    // Adding a gradient of `size` values to an occupied accumulator slot: the cast copy (if
    // any) and the sum beside the held one.
    let sum_into_held = |size: f64| if cast { 2.0 * g * size } else { g * size };
    let largest = if frozen { 0.0 } else { w.max(c * a.cfg.inner_dim() as f64) };

    let peak = if !a.checkpoint {
        let kept = l * block + d * (4.0 * nc + nv) + mask;
        let head = kept + head + held_before;
        // The first block's backward (the last processed): every other gradient formed.
        let blocks = kept + head_leftover + d * formed + block_transient + held_before;
        // The embedding's: its dwte (V, C), the gradients already formed (the LM head's dwte
        // among them) and their sum, a third W (with a score head, wte's first gradient added to
        // a zeros tensor: the same count), beside the lookup's output gradient.
        let embedding = kept + head_leftover + d * (formed + 2.0 * w + nc) + held_before;
        // `GradAccumulator::add` while the graph lives (the loss is alive): the formed gradients
        // and, cast, their f32 copies; accumulating, one tensor's cast and sum at a time.
        let add = kept
            + head_leftover
            + d * formed
            + match (a.accumulating, cast) {
                (true, _) => held + sum_into_held(largest),
                (false, true) => held,
                (false, false) => 0.0,
            };
        head.max(blocks).max(embedding).max(add)
    } else {
        // Kept through backward: each block's input and the last block's output, the head's
        // leaf (a copy of that output), and the head's graph (the loss lives to the end): ln_f's
        // output and the logits.
        let kept = d * ((l + 3.0) * nc + nv) + mask;
        let head = kept + head + held_before;
        // A recomputed block: its activations, its input's copy (the leaf), the surrogate
        // out * grad, its gradient and candle's gradient for the (untracked) incoming gradient,
        // which holds it, the incoming gradient; the held gradients bound those added so far.
        let recomputed = block + d * 5.0 * nc + block_transient + held;
        // The embeddings recomputed (3 (N, C)), the surrogate's 3 as for a block, the incoming
        // gradient and the lookup's output gradient; then wte's gradient added to a zeros tensor
        // in this backward's store (three W), or, in `GradAccumulator::add`, the store's W and
        // its sum with the held one.
        let occupied = a.lm_head || a.accumulating;
        let wte = (3.0 * d * w).max(d * w + if occupied { sum_into_held(w) } else { 0.0 });
        let embedding = kept + d * 8.0 * nc + wte + held;
        head.max(kept + recomputed).max(embedding)
    };
    // The held gradients are the plan's own line.
    peak - held
}

/// Activation memory under T-way tensor parallelism, by Megatron's formula (Korthikanti et al.
/// 2022, "Reducing Activation Recomputation in Large Transformer Models", without sequence
/// parallelism): per layer s b h (10 + 24/T + 5 a s / (h T)) bytes for 16-bit activations (the
/// 10 s b h are the LayerNorms' inputs, the residual dropout masks and the inputs of the
/// column-parallel linears, which every rank keeps whole); with full recomputation each layer
/// keeps only its input (2 s b h) and one layer is rebuilt in backward; the cross-entropy's fp32
/// logits add 4 s b v / T. Scaled to the compute dtype's size (f32 doubles the 16-bit terms).
/// Beyond Megatron's count, which is of activations alone: backward forms this rank's fp32
/// gradients (its trainable parameters) before they are added to the accumulated ones, and the
/// embedding slice's gradient twice more (from the lookup and from the tied head, then their
/// sum). Measured on gpt2-medium at T = 2 and 4 (BENCHMARKS.md): without these terms the plan
/// fell short of the measured peak by 680 and 340 MiB.
fn megatron_activation_bytes(a: &ActivationShape) -> f64 {
    let (s, b, h) = (a.t as f64, a.b as f64, a.cfg.hidden_size() as f64);
    let (heads, layers, t) = (a.cfg.num_heads() as f64, a.cfg.num_layers() as f64, a.tp as f64);
    let scale = a.dtype_bytes as f64 / 2.0;
    let layer = s * b * h * (10.0 + 24.0 / t + 5.0 * heads * s / (h * t)) * scale;
    let blocks = if a.checkpoint { layers * 2.0 * s * b * h * scale + layer } else { layers * layer };
    let vocab = crate::tensor_parallel::vocab::padded_vocab_size(a.cfg.vocab_size, a.tp) as f64;
    let head = if a.lm_head { 4.0 * s * b * vocab / t } else { 0.0 };
    let embedding_grad = if a.trainable == a.parameters { 4.0 * vocab / t * h } else { 0.0 };
    blocks + head + 4.0 * a.trainable as f64 + 2.0 * embedding_grad
}

/// Which kind of device runs the micro-batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DeviceKind {
    Cpu,
    Cuda,
    Other,
}

#[derive(Clone)]
pub struct MemoryPlan {
    pub parameters: usize,
    pub param_bytes: u64,
    pub grad_bytes: u64,
    pub adam_bytes: u64,
    /// fp16/bf16: the compute-dtype copy of the weights forward and backward run on.
    pub compute_copy_bytes: u64,
    pub activations: ActivationShape,
    compute_dtype: candle_core::DType,
    device: DeviceKind,
    /// Data parallelism: (ZeRO stage, ranks); the byte counts above are per rank.
    pub zero: Option<(ZeroStage, usize)>,
    /// Tensor parallelism: (ranks per layer, parameters held by each).
    pub tensor_parallel: Option<(usize, usize)>,
    /// ZeRO stage 3 across ranks: the largest unit (the embeddings and heads, or a block)
    /// gathered whole with its whole gradient, 4 + 4 bytes a value (see [`gathered_unit_values`]);
    /// on a GPU without `--offload`, the next block prefetched beside it.
    pub gathered_unit_bytes: u64,
    /// On the CPU, the process itself before the model: its resident memory when planned (the
    /// binary, the tokenizer, the loaded data), measured ([`Self::with_process_baseline`]).
    pub process_bytes: u64,
    /// Data parallelism at stages 0-2: what a micro-batch's gradient reduction holds beyond the
    /// held gradients ([`Self::with_buckets`]).
    pub reduction_bytes: u64,
    /// The optimizer states are in host memory, not in this (GPU) plan ([`Self::with_offload`]).
    pub offloaded: bool,
}

/// The values of the largest unit ZeRO stage 3 gathers at once: everything outside the blocks
/// (embeddings, final LayerNorm, `extra` head parameters) or one block, whichever is larger.
/// During a unit's backward its gathered weights and its gradient are both whole; its gather
/// buffer and the reduce-scatter buffer each live beside one of them.
pub fn gathered_unit_values(cfg: &Gpt2Config, extra: usize) -> usize {
    let c = cfg.hidden_size();
    let outer = cfg.vocab_size * c + cfg.max_positions() * c + 2 * c + extra;
    outer.max(block_values(cfg))
}

/// The values of one transformer block.
fn block_values(cfg: &Gpt2Config) -> usize {
    let c = cfg.hidden_size();
    let outer = cfg.vocab_size * c + cfg.max_positions() * c + 2 * c;
    (parameter_count(cfg) - outer) / cfg.num_layers().max(1)
}

impl MemoryPlan {
    /// The plan of an f32 LM on the CPU; the `with_*` and [`Self::on_device`] methods adjust it.
    pub fn new(cfg: &Gpt2Config, b: usize, t: usize, checkpoint: bool) -> Self {
        let parameters = parameter_count(cfg);
        let p = 4 * parameters as u64;
        Self {
            parameters,
            param_bytes: p,
            grad_bytes: p,
            adam_bytes: 2 * p,
            compute_copy_bytes: 0,
            activations: ActivationShape {
                cfg: cfg.clone(),
                b,
                t,
                checkpoint,
                kernels: Kernels::FusedCpu,
                lm_head: true,
                dtype_bytes: 4,
                parameters,
                trainable: parameters,
                accumulating: false,
                grad_bytes: 4,
                lora: false,
                tp: 1,
                sharded: false,
            },
            compute_dtype: candle_core::DType::F32,
            device: DeviceKind::Cpu,
            zero: None,
            tensor_parallel: None,
            gathered_unit_bytes: 0,
            process_bytes: 0,
            reduction_bytes: 0,
            offloaded: false,
        }
    }

    /// Per-rank model states under ZeRO `stage` over `world` ranks (DeepSpeed's accounting:
    /// stage 1 divides the AdamW moments by the world size, and in fp16/bf16 the fp32 masters,
    /// stage 2 the gradients too, stage 3 the weights and their compute copy as well, which also recomputes every block in backward,
    /// so the activations are those of checkpointing). Call after the other `with_*` methods.
    pub fn with_data_parallel(mut self, stage: ZeroStage, world: usize) -> Self {
        if world <= 1 {
            return self;
        }
        // The ranks reduce and hold their gradients in f32.
        self.zero = Some((stage, world));
        self.set_gradient_bytes();
        let shard = |bytes: u64| bytes.div_ceil(world as u64);
        if stage >= ZeroStage::OptimizerStates {
            self.adam_bytes = shard(self.adam_bytes);
            // Under mixed precision stages 1 and 2 keep a shard of the fp32 masters beside the
            // whole compute copy (`engine::shards_masters`: every parameter trained, no LoRA).
            let a = &self.activations;
            let whole_masters = a.lora || a.trainable != a.parameters;
            if stage < ZeroStage::Parameters && self.compute_copy_bytes > 0 && !whole_masters {
                self.param_bytes = shard(self.param_bytes);
            }
        }
        if stage >= ZeroStage::Gradients {
            self.grad_bytes = shard(self.grad_bytes);
        }
        if stage >= ZeroStage::Parameters {
            self.param_bytes = shard(self.param_bytes);
            self.compute_copy_bytes = shard(self.compute_copy_bytes);
            self.activations.checkpoint = true;
            self.activations.sharded = true;
            let extra = self.parameters.saturating_sub(parameter_count(&self.activations.cfg));
            let unit = gathered_unit_values(&self.activations.cfg, extra) as u64;
            let unit = match self.tensor_parallel {
                Some((_, held)) => unit * held as u64 / self.parameters.max(1) as u64,
                None => unit,
            };
            self.gathered_unit_bytes = 8 * unit;
        }
        self
    }

    /// Where the optimizer states are on a GPU: `--offload` (DeepSpeed's `offload_optimizer:
    /// cpu`) keeps the Adam moments, and the fp32 masters where each rank keeps only its shard
    /// of them (mixed precision at stages 1 and 2; stage 3 always, whose units are then gathered
    /// to the GPU from host memory), in host memory; what is there leaves the GPU's plan.
    /// Without it they are on the GPU. Nothing changes on the CPU, where all of it is host
    /// memory. Call after [`Self::with_data_parallel`].
    pub fn with_offload(mut self, offload: bool) -> Self {
        if self.device != DeviceKind::Cuda {
            return self;
        }
        match self.zero.map(|(stage, _)| stage) {
            Some(ZeroStage::OptimizerStates | ZeroStage::Gradients) if offload => {
                let sharded_masters = self.masters_sharded();
                self.adam_bytes = 0;
                if sharded_masters {
                    self.param_bytes = 0;
                }
            }
            Some(ZeroStage::Parameters) if offload => {
                (self.adam_bytes, self.param_bytes, self.compute_copy_bytes) = (0, 0, 0)
            }
            Some(ZeroStage::Parameters) => {
                // Gathered from shards on the GPU, the next block is prefetched while a unit
                // computes: one more block in the compute dtype (this rank's TP slices of it).
                let block = block_values(&self.activations.cfg) as u64;
                let block = match self.tensor_parallel {
                    Some((_, held)) => block * held as u64 / self.parameters.max(1) as u64,
                    None => block,
                };
                self.gathered_unit_bytes += self.compute_dtype.size_in_bytes() as u64 * block;
                return self;
            }
            _ => return self,
        }
        self.offloaded = true;
        self
    }

    /// Tensor parallelism over `ranks` ranks per layer: each holds its slices of the split
    /// parameters (the vocabulary padded to 128 x T rows) and the replicated ones whole, with
    /// their gradients, moments and compute copy; activations by Megatron's formula (see
    /// [`megatron_activation_bytes`]). `held_beside` is what one rank holds beyond the GPT-2
    /// inventory, counted from its own tensors: its slices of the LoRA adapters (cut as their
    /// linears) and a score head whole ([`crate::model::params::numel_beside_trunk`]). A frozen
    /// trunk (`--only-optimize-lora`) trains only those, so they alone have gradients and
    /// moments. Call after [`Self::with_parameters`] (whole-model counts) and
    /// [`Self::with_compute_dtype`], before [`Self::with_data_parallel`].
    pub fn with_tensor_parallel(mut self, ranks: usize, held_beside: usize) -> Self {
        if ranks <= 1 {
            return self;
        }
        // The ranks reduce and hold their gradients in f32 (set before they are divided up).
        self.activations.tp = ranks;
        self.set_gradient_bytes();
        let cfg = &self.activations.cfg;
        let trunk: usize = crate::model::params::parameter_shapes(cfg)
            .iter()
            .map(|(name, shape)| {
                crate::tensor_parallel::shard::local_shape(cfg.split_of(name), shape, ranks).iter().product::<usize>()
            })
            .sum();
        let held = trunk + held_beside;
        let (total, trainable) = (self.activations.parameters, self.activations.trainable);
        let trained_held = if trainable < total { held_beside } else { held };
        // Each state's bytes a value (exact: every count is a whole number of bytes a value).
        let per_value = |bytes: u64, values: usize| bytes / values.max(1) as u64;
        (self.param_bytes, self.compute_copy_bytes) =
            (per_value(self.param_bytes, total) * held as u64, per_value(self.compute_copy_bytes, total) * held as u64);
        (self.grad_bytes, self.adam_bytes) = (
            per_value(self.grad_bytes, trainable) * trained_held as u64,
            per_value(self.adam_bytes, trainable) * trained_held as u64,
        );
        (self.activations.parameters, self.activations.trainable) = (held, trained_held);
        self.tensor_parallel = Some((ranks, held));
        self
    }

    /// Parameters, gradients, AdamW moments and compute copy: DeepSpeed's "model states".
    pub fn model_state_bytes(&self) -> u64 {
        self.param_bytes + self.grad_bytes + self.adam_bytes + self.compute_copy_bytes
    }

    /// Counts `total` parameters (LoRA adapters included) but gradients and AdamW moments for the
    /// `trainable` ones only (`--only-optimize-lora`): frozen weights enter the model detached,
    /// so backward forms no gradient for them.
    pub fn with_parameters(mut self, total: usize, trainable: usize) -> Self {
        self.parameters = total;
        self.param_bytes = 4 * total as u64;
        self.grad_bytes = 4 * trainable as u64;
        self.adam_bytes = 8 * trainable as u64;
        self.activations.parameters = total;
        self.activations.trainable = trainable;
        self.activations.grad_bytes = 4;
        self.set_gradient_bytes();
        self
    }

    /// LoRA adapters on the blocks' linears: their activations (counted as if on all four).
    pub fn with_lora(mut self, enabled: bool) -> Self {
        self.activations.lora = enabled;
        self
    }

    /// Accumulating gradients over `steps` micro-batches (`--gradient-accumulation-steps`).
    pub fn with_gradient_accumulation(mut self, steps: usize) -> Self {
        self.activations.accumulating = steps > 1;
        self.set_gradient_bytes();
        self
    }

    /// Computing in a 2-byte dtype adds a copy of the weights at 2 bytes per parameter; the dtype
    /// decides which kernels run, and on a GPU the held gradients' size.
    pub fn with_compute_dtype(mut self, dtype: candle_core::DType) -> Self {
        let bytes = dtype.size_in_bytes();
        self.compute_copy_bytes = if bytes == 4 { 0 } else { bytes as u64 * self.parameters as u64 };
        self.compute_dtype = dtype;
        self.activations.dtype_bytes = bytes;
        self.set_kernels();
        self.set_gradient_bytes();
        self
    }

    /// The device the micro-batches run on: it decides which kernels run and, on a GPU, in which
    /// dtype the gradients are held.
    pub fn on_device(self, device: &candle_core::Device) -> Self {
        self.on_device_kind(match device {
            candle_core::Device::Cpu => DeviceKind::Cpu,
            candle_core::Device::Cuda(_) => DeviceKind::Cuda,
            _ => DeviceKind::Other,
        })
    }

    /// [`Self::on_device`] by the device's kind (tests plan for a GPU they may not have).
    fn on_device_kind(mut self, device: DeviceKind) -> Self {
        self.device = device;
        self.set_kernels();
        self.set_gradient_bytes();
        self
    }

    /// What reducing a micro-batch's gradient over the data-parallel ranks, and at stages 1 and 2
    /// all-gathering the updated weights after the step, hold at their peak beyond the held
    /// gradients, with buckets of `reduce` values (`--reduce-bucket-size`) and rounds of `gather`
    /// (`--allgather-bucket-size`), as `zero.rs` does it. The reduction: the collective's f32
    /// buffer, into which the gradients are copied while they are still alive (stage 0: a
    /// bucket, averaged in place; stages 1 and 2: the whole flat gradient, and at stage
    /// 2, which holds only a shard, the micro-batch's whole gradient beside it; stage 2's buckets
    /// during backward: a bucket on the CPU, two on a GPU, a bucket's buffer and the sums it
    /// delivers, or the next bucket's buffer being filled); under mixed precision also backward's own
    /// half-precision gradients, converted to f32 for the reduction. The all-gather, once the
    /// gradient is reduced to its shard (stage 1's whole one freed): a round of weights in the
    /// dtype they are gathered in, the ring's incoming share of it, the shard's gradient read as
    /// f32 and, with whole masters, the shard's weights copied out to step. The larger of the
    /// two; nothing at stage 3 (its gathered unit is counted apart) or on one rank. Call after
    /// [`Self::with_data_parallel`].
    pub fn with_buckets(mut self, reduce: usize, gather: usize) -> Self {
        let Some((stage, world)) = self.zero else { return self };
        let (p, w) = (self.activations.trainable as u64, world as u64);
        let bucket = (reduce as u64).min(p);
        let f32_values = match stage {
            ZeroStage::Disabled => bucket,
            // Stage 1 reduce-scatters after backward in rounds of a bucket (two in flight over
            // NCCL).
            ZeroStage::OptimizerStates if bucket < p && self.device == DeviceKind::Cpu => bucket,
            ZeroStage::OptimizerStates if bucket < p => 2 * bucket,
            ZeroStage::OptimizerStates => p,
            ZeroStage::Gradients if bucket < p && self.device == DeviceKind::Cpu => bucket,
            ZeroStage::Gradients if bucket < p => 2 * bucket,
            ZeroStage::Gradients => 2 * p,
            ZeroStage::Parameters => return self,
        };
        let half =
            if self.compute_dtype == candle_core::DType::F32 { 0 } else { self.activations.dtype_bytes as u64 * p };
        let reduction = 4 * f32_values + half;
        let all_gather = if stage == ZeroStage::Disabled {
            0
        } else {
            let shard = p.div_ceil(w);
            let round = (gather as u64).min(p);
            // Sharded masters (mixed precision, `engine::shards_masters`) step in place and
            // gather into the compute copy; whole ones are copied out and gathered in fp32.
            let sharded_masters = self.masters_sharded();
            let (d, copies) = if sharded_masters { (self.activations.dtype_bytes as u64, 1) } else { (4, 2) };
            let freed = if stage == ZeroStage::OptimizerStates { 4 * (p - shard) } else { 0 };
            (d * (round + round.div_ceil(w)) + 4 * copies * shard).saturating_sub(freed)
        };
        self.reduction_bytes = reduction.max(all_gather);
        self
    }

    /// Whether the ranks of a data-parallel group each keep a shard of the fp32 masters
    /// (mixed precision at stages 1 and 2, `engine::shards_masters`; always at stage 3): fewer
    /// than 4 bytes for each parameter this rank holds (all, or its tensor-parallel slices).
    fn masters_sharded(&self) -> bool {
        self.param_bytes < 4 * self.activations.parameters as u64
    }

    /// On the CPU, counts the process's own resident memory now (before the model is built): the
    /// machine holds it beside the model states and activations, and a rank's measured peak
    /// includes it. Not on a GPU, whose memory the plan is of.
    pub fn with_process_baseline(mut self) -> Self {
        if self.device == DeviceKind::Cpu {
            let mib = crate::training::metrics::current_rss_mib().unwrap_or(0.0);
            self.process_bytes = (mib * MIB) as u64;
        }
        self
    }

    /// A reward model: a score head instead of the LM head (no logits).
    pub fn with_score_head(mut self) -> Self {
        self.activations.lm_head = false;
        self
    }

    /// What `kernels::ops` dispatches to for this device and dtype.
    fn set_kernels(&mut self) {
        let reference = crate::kernels::ops::reference_ops();
        self.activations.kernels = match self.device {
            DeviceKind::Cpu if self.activations.dtype_bytes == 4 && !reference => Kernels::FusedCpu,
            DeviceKind::Cuda if !reference => Kernels::FusedGpu {
                flash_attention: crate::kernels::ops::flash_attention_takes(
                    self.compute_dtype,
                    self.activations.cfg.head_dim(),
                ),
            },
            _ => Kernels::Composed,
        };
    }

    /// The held gradients' size per parameter: the compute dtype's on a CUDA GPU in a single
    /// process without accumulation (the first micro-batch's gradients stay as backward formed
    /// them and the optimizer reads them so), else 4: f32 sums over micro-batches, and across
    /// ranks, whose reductions run in f32.
    pub fn held_gradient_bytes(&self) -> usize {
        let single = self.zero.is_none() && self.activations.tp == 1;
        match self.device {
            DeviceKind::Cuda if single && !self.activations.accumulating => self.activations.dtype_bytes,
            _ => 4,
        }
    }

    /// Resizes the gradients' bytes to [`Self::held_gradient_bytes`] per parameter.
    fn set_gradient_bytes(&mut self) {
        self.hold_gradients_in(self.held_gradient_bytes());
    }

    /// Gradients held at `bytes` per parameter.
    fn hold_gradients_in(&mut self, bytes: usize) {
        let old = self.activations.grad_bytes;
        if bytes != old {
            // Exact: set before any division among ranks, the bytes are a multiple of `old`.
            self.grad_bytes = self.grad_bytes / old as u64 * bytes as u64;
            self.activations.grad_bytes = bytes;
        }
    }

    /// The estimate of [`activation_bytes`] for this plan's micro-batch.
    pub fn activation_bytes(&self) -> u64 {
        activation_bytes(&self.activations)
    }

    pub fn total(&self) -> u64 {
        let transient = self.activation_bytes() + self.gathered_unit_bytes;
        let transient = transient + self.reduction_bytes;
        [self.param_bytes, self.grad_bytes, self.adam_bytes, self.compute_copy_bytes, transient, self.process_bytes]
            .into_iter()
            .fold(0, u64::saturating_add)
    }

    /// The startup report, one allocation per line.
    pub fn report(&self) -> String {
        let m = |x: u64| x as f64 / MIB;
        let per_rank = match self.zero {
            Some((stage, world)) => format!(
                "per rank of {world} (ZeRO stage {stage}): model states {:.1} MiB, {:.2} bytes per parameter\n",
                m(self.model_state_bytes()),
                self.model_state_bytes() as f64 / self.parameters.max(1) as f64
            ),
            None => String::new(),
        };
        let per_rank = match self.tensor_parallel {
            Some((ranks, held)) => format!(
                "{per_rank}tensor parallel over {ranks} ranks: {:.2}M parameters per rank, activations by Megatron's formula\n",
                held as f64 / 1e6
            ),
            None => per_rank,
        };
        format!(
            "{per_rank}parameters: {:.2}M\nallocating {:.1} MiB for parameters (f32)\nallocating {:.1} MiB for gradients ({})\nallocating {:.1} MiB for AdamW m and v{}\n{}estimated {:.1} MiB for activations per micro-batch\n{}{}{}estimated total {:.1} MiB",
            self.parameters as f64 / 1e6,
            m(self.param_bytes),
            m(self.grad_bytes),
            if self.activations.grad_bytes == 4 { "f32" } else { "in the compute dtype" },
            m(self.adam_bytes),
            if self.offloaded { " (the optimizer states in host memory: not in this GPU plan)" } else { "" },
            if self.compute_copy_bytes > 0 {
                format!("allocating {:.1} MiB for the fp16/bf16 compute copy of the weights\n", m(self.compute_copy_bytes))
            } else {
                String::new()
            },
            m(self.activation_bytes()),
            if self.gathered_unit_bytes > 0 {
                format!(
                    "estimated {:.1} MiB for ZeRO-3's largest gathered unit and its gradient (on a GPU, with the next block prefetched)\n",
                    m(self.gathered_unit_bytes)
                )
            } else {
                String::new()
            },
            if self.reduction_bytes > 0 {
                format!("estimated {:.1} MiB for the gradient reduction's buffers\n", m(self.reduction_bytes))
            } else {
                String::new()
            },
            if self.process_bytes > 0 {
                format!("measured {:.1} MiB for the process before the model (binary, tokenizer, data)\n", m(self.process_bytes))
            } else {
                String::new()
            },
            m(self.total())
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_beyond_the_machine_is_refused_and_absurd_batches_saturate() {
        let tiny = Gpt2Config::tiny();
        let plan = MemoryPlan::new(&tiny, 4, 64, false);
        assert!(plan_fits(&plan, plan.total()).is_ok());
        let err = plan_fits(&plan, plan.total() - 1).unwrap_err().to_string();
        assert!(err.contains("micro-batch of 4 x 64 tokens") && err.contains("lower the micro-batch size"), "{err}");
        let absurd = MemoryPlan::new(&tiny, usize::MAX, 64, false);
        assert_eq!((absurd.activation_bytes(), absurd.total()), (u64::MAX, u64::MAX), "saturates, no overflow");
        assert!(check_plan_fits(&absurd, &candle_core::Device::Cpu).is_err());
        // The line's numbers in GiB: u64::MAX bytes are 2^34 GiB; 3 x 2^30 bytes, 3 GiB.
        let err = plan_fits(&absurd, 3 << 30).unwrap_err().to_string();
        let want = "needs an estimated 17179869184.0 GiB (17179869184.0 GiB of it activations";
        assert!(err.contains(want) && err.contains("more than this machine's 3.0 GiB of memory"), "{err}");
    }

    /// The gradient reduction's buffers by stage, as zero.rs holds them (see
    /// [`MemoryPlan::with_buckets`]), counted in the total.
    #[test]
    fn the_gradient_reduction_is_planned_by_stage_and_bucket() {
        let cfg = Gpt2Config::tiny();
        let p = parameter_count(&cfg) as u64;
        let plan_gathering = |stage, bucket, gather, dtype| {
            MemoryPlan::new(&cfg, 2, 32, false)
                .with_compute_dtype(dtype)
                .on_device_kind(DeviceKind::Cpu)
                .with_data_parallel(stage, 4)
                .with_buckets(bucket, gather)
        };
        let plan = |stage, bucket, dtype| plan_gathering(stage, bucket, usize::MAX, dtype);
        let f32 = candle_core::DType::F32;
        let big = usize::MAX;
        let shard = p.div_ceil(4);
        assert_eq!(plan(ZeroStage::Disabled, big, f32).reduction_bytes, 4 * p);
        assert_eq!(plan(ZeroStage::Disabled, 1000, f32).reduction_bytes, 4 * 1000);
        // Stage 1: the flat gradient's buffer, or after the step, with the whole gradient
        // freed, the gathered weights, the ring's incoming quarter, the shard's weights and
        // gradient copied out (the same bytes but for the shards' rounding).
        let gathering = 4 * (p + shard) + 8 * shard - 4 * (p - shard);
        assert_eq!(plan(ZeroStage::OptimizerStates, big, f32).reduction_bytes, (4 * p).max(gathering));
        // In rounds of a bucket the reduce-scatter's buffer is a round: the gathering is larger.
        assert_eq!(plan(ZeroStage::OptimizerStates, 1000, f32).reduction_bytes, (4 * 1000).max(gathering));
        assert_eq!(plan(ZeroStage::Gradients, big, f32).reduction_bytes, 8 * p);
        // Stage 2's buckets during backward leave the step's all-gather the larger: the whole
        // weights, or with rounds of 1000 values 1000 and the ring's 250 beside the copies.
        assert_eq!(plan(ZeroStage::Gradients, 1000, f32).reduction_bytes, 4 * (p + shard) + 8 * shard);
        let rounds = plan_gathering(ZeroStage::Gradients, 1000, 1000, f32).reduction_bytes;
        assert_eq!(rounds, 4 * (1000 + 250) + 8 * shard, "buckets during backward, weights gathered in rounds");
        // On a GPU a bucket is reduced while the next is filled: two buckets.
        let on_gpu = |bucket: usize| {
            MemoryPlan::new(&cfg, 2, 32, false)
                .on_device_kind(DeviceKind::Cuda)
                .with_data_parallel(ZeroStage::Gradients, 4)
                .with_buckets(bucket, 1000)
        };
        assert_eq!(on_gpu(big).reduction_bytes, 8 * p, "no bucket smaller than the model: its whole gradient");
        let half = (p / 2) as usize;
        assert!(8 * half as u64 > 4 * (1000 + 250) + 8 * shard, "the buckets larger than the all-gather");
        assert_eq!(on_gpu(half).reduction_bytes, 8 * half as u64);
        assert_eq!(plan(ZeroStage::Parameters, big, f32).reduction_bytes, 0);
        let bf16 = plan(ZeroStage::Gradients, big, candle_core::DType::BF16);
        assert_eq!(bf16.reduction_bytes, 8 * p + 2 * p, "backward's bf16 gradients besides");
        let without = MemoryPlan::new(&cfg, 2, 32, false).with_data_parallel(ZeroStage::Gradients, 4);
        assert_eq!(plan(ZeroStage::Gradients, big, f32).total(), without.total() + 8 * p);
        assert!(plan(ZeroStage::Gradients, big, f32).report().contains("the gradient reduction's buffers"));
        let one_rank = MemoryPlan::new(&cfg, 2, 32, false).with_buckets(big, big);
        assert_eq!(one_rank.reduction_bytes, 0);
    }

    /// The reduction's buffers in rounds of a bucket, where the step's all-gather runs in small
    /// rounds and so is not the larger: one bucket on the CPU, two in flight on a GPU, the whole
    /// flat gradient (stage 2: with the micro-batch's beside it) where the bucket is not smaller
    /// than the model; backward's bf16 gradients beside them in every case.
    #[test]
    fn the_reduction_in_rounds_of_a_bucket_by_stage_and_device() {
        let cfg = Gpt2Config::tiny();
        let p = parameter_count(&cfg) as u64;
        let reduction = |stage, device, bucket| {
            MemoryPlan::new(&cfg, 2, 32, false)
                .with_compute_dtype(candle_core::DType::BF16)
                .on_device_kind(device)
                .with_data_parallel(stage, 4)
                .with_buckets(bucket, 1000)
                .reduction_bytes
        };
        let (cpu, gpu, whole) = (DeviceKind::Cpu, DeviceKind::Cuda, p as usize);
        for stage in [ZeroStage::OptimizerStates, ZeroStage::Gradients] {
            assert_eq!(reduction(stage, cpu, 1000), 4 * 1000 + 2 * p, "{stage:?}");
            assert_eq!(reduction(stage, gpu, 1000), 8 * 1000 + 2 * p, "{stage:?}");
        }
        for device in [cpu, gpu] {
            assert_eq!(reduction(ZeroStage::OptimizerStates, device, whole), 4 * p + 2 * p);
            assert_eq!(reduction(ZeroStage::Gradients, device, whole), 8 * p + 2 * p);
        }
    }

    /// `--offload` on a GPU takes the Adam moments and the sharded fp32 masters out of the GPU's
    /// plan at stages 1-3 (the report says where they are); nothing changes on the CPU.
    #[test]
    fn offload_takes_the_optimizer_states_off_the_gpus_plan() {
        let cfg = Gpt2Config::tiny();
        let plan = |stage, device, offload| {
            MemoryPlan::new(&cfg, 2, 32, false)
                .with_compute_dtype(candle_core::DType::BF16)
                .on_device_kind(device)
                .with_data_parallel(stage, 4)
                .with_offload(offload)
        };
        for stage in [ZeroStage::OptimizerStates, ZeroStage::Gradients] {
            let (kept, offloaded) = (plan(stage, DeviceKind::Cuda, false), plan(stage, DeviceKind::Cuda, true));
            assert!(kept.adam_bytes > 0 && kept.param_bytes > 0, "{stage:?}");
            assert_eq!((offloaded.adam_bytes, offloaded.param_bytes), (0, 0), "{stage:?}: sharded masters and moments");
            assert_eq!(offloaded.total(), kept.total() - kept.adam_bytes - kept.param_bytes);
            assert!(offloaded.report().contains("the optimizer states in host memory"), "{}", offloaded.report());
            assert_eq!(plan(stage, DeviceKind::Cpu, true).total(), plan(stage, DeviceKind::Cpu, false).total());
        }
        // Whole masters (fp32: they are the weights) stay on the GPU; the moments go.
        let fp32 = MemoryPlan::new(&cfg, 2, 32, false)
            .on_device_kind(DeviceKind::Cuda)
            .with_data_parallel(ZeroStage::OptimizerStates, 4)
            .with_offload(true);
        assert_eq!((fp32.adam_bytes, fp32.param_bytes), (0, 4 * parameter_count(&cfg) as u64));
        // Stage 3 keeps its shards and moments on the GPU; --offload takes them to host memory.
        let (kept, offloaded) =
            (plan(ZeroStage::Parameters, DeviceKind::Cuda, false), plan(ZeroStage::Parameters, DeviceKind::Cuda, true));
        let on_cpu = plan(ZeroStage::Parameters, DeviceKind::Cpu, false);
        assert_eq!((kept.adam_bytes, kept.param_bytes), (on_cpu.adam_bytes, on_cpu.param_bytes));
        assert!(kept.adam_bytes > 0 && kept.param_bytes > 0 && !kept.offloaded);
        // Gathered from the GPU's shards, the next block is prefetched: one more block in bf16.
        assert_eq!(kept.gathered_unit_bytes, offloaded.gathered_unit_bytes + 2 * (12 * 128 * 128 + 13 * 128));
        assert_eq!(offloaded.gathered_unit_bytes, on_cpu.gathered_unit_bytes);
        assert_eq!((offloaded.adam_bytes, offloaded.param_bytes, offloaded.compute_copy_bytes), (0, 0, 0));
        assert!(offloaded.gathered_unit_bytes > 0 && offloaded.offloaded);
    }

    /// On the CPU the plan counts the process's own resident memory (measured: above zero for
    /// any running test binary) in its total and says so; a GPU plan, of device memory, does not.
    #[test]
    fn the_process_itself_is_counted_on_the_cpu_only() {
        let plan = MemoryPlan::new(&Gpt2Config::tiny(), 2, 32, false);
        let counted = plan.clone().with_process_baseline();
        assert!(counted.process_bytes > 0, "a test binary has resident memory");
        // In bytes: the resident memory read again now, in MiB, within a half of it.
        let now = crate::training::metrics::current_rss_mib().expect("this process's resident memory");
        let planned = counted.process_bytes as f64 / MIB;
        assert!((planned - now).abs() < 0.5 * now, "planned {planned:.1} MiB, resident {now:.1} MiB");
        assert_eq!(counted.total(), plan.total() + counted.process_bytes);
        assert!(counted.report().contains("for the process before the model"), "{}", counted.report());
        // tiny's 7,259,008 f32 parameters: 29,036,032 bytes.
        assert!(plan.report().contains("allocating 27.7 MiB for parameters (f32)\n"), "{}", plan.report());
        let gpu = plan.on_device_kind(DeviceKind::Cuda).with_process_baseline();
        assert_eq!(gpu.process_bytes, 0);
    }

    #[test]
    fn gpt2_small_counts_and_checkpointing_saves_block_activations() {
        let cfg = Gpt2Config::gpt2();
        let plan = MemoryPlan::new(&cfg, 1, 1024, false);
        assert_eq!(plan.parameters, 124_439_808, "GPT-2 small has 124.4M parameters");
        for kernels in [Kernels::FusedCpu, Kernels::Composed] {
            let shape = |checkpoint| ActivationShape {
                cfg: cfg.clone(),
                b: 4,
                t: 1024,
                checkpoint,
                kernels,
                lm_head: false,
                dtype_bytes: 4,
                parameters: plan.parameters,
                trainable: plan.parameters,
                accumulating: true,
                grad_bytes: 4,
                lora: false,
                tp: 1,
                sharded: false,
            };
            let (full, ckpt) = (activation_bytes(&shape(false)), activation_bytes(&shape(true)));
            assert!(
                ckpt * 3 < full,
                "{kernels:?}: checkpointing keeps one block's activations, not 12: {ckpt} vs {full}"
            );
        }
    }

    #[test]
    fn the_plan_follows_the_device_and_dtype() {
        let cfg = Gpt2Config::tiny();
        let plan = MemoryPlan::new(&cfg, 2, 64, false);
        assert_eq!(plan.activations.kernels, Kernels::FusedCpu);
        let on_cpu = plan.clone().on_device_kind(DeviceKind::Other).on_device(&candle_core::Device::Cpu);
        assert_eq!(on_cpu.activations.kernels, Kernels::FusedCpu, "the CPU's own kernels, not another device's");
        let half = MemoryPlan::new(&cfg, 2, 64, false).with_compute_dtype(candle_core::DType::BF16);
        assert_eq!(
            (half.activations.kernels, half.compute_copy_bytes),
            (Kernels::Composed, 2 * plan.parameters as u64)
        );
        // Where the (N, V) logits set the peak (N = 512 here; at 128 the embedding's backward
        // does, for a score head as for the LM head: tests/memory_plan.rs measures both equal).
        let (lm, scored) = (MemoryPlan::new(&cfg, 8, 64, false), MemoryPlan::new(&cfg, 8, 64, false).with_score_head());
        assert!(scored.activation_bytes() < lm.activation_bytes(), "a score head keeps no logits");
        let split = MemoryPlan::new(&cfg, 2, 64, false).with_tensor_parallel(2, 0);
        let (_, held) = split.tensor_parallel.unwrap();
        assert_eq!(held, tiny_held_by_one_of_two_tp_ranks());
        assert_eq!(split.param_bytes, 4 * held as u64);
        let four = MemoryPlan::new(&cfg, 2, 64, false).with_tensor_parallel(4, 0);
        assert!(four.activation_bytes() < split.activation_bytes(), "more ranks split more of each layer");
        let one_step = MemoryPlan::new(&cfg, 2, 64, false).with_gradient_accumulation(1);
        assert_eq!(one_step.activation_bytes(), plan.activation_bytes(), "one micro-batch a step accumulates nothing");
        let accumulating = MemoryPlan::new(&cfg, 2, 64, false).with_gradient_accumulation(2);
        assert_eq!(
            accumulating.activation_bytes() - plan.activation_bytes(),
            4 * plan.parameters as u64,
            "from the second micro-batch on, backward's gradients meet the accumulated ones"
        );
    }

    /// Megatron's formula by hand under 2-way tensor parallelism: 3 blocks, s 8, b 2, h 64 in 2
    /// heads, V 1000 padded to 1024 rows (128 x 2), in bf16 (the formula's 16-bit unit).
    #[test]
    fn tensor_parallel_activations_by_megatrons_formula_by_hand() {
        let cfg =
            Gpt2Config { n_layer: 3, n_embd: 64, n_head: 2, n_positions: 8, vocab_size: 1000, ..Gpt2Config::tiny() };
        let shape = |checkpoint, dtype_bytes, lm_head, trainable| ActivationShape {
            cfg: cfg.clone(),
            b: 2,
            t: 8,
            checkpoint,
            kernels: Kernels::FusedCpu,
            lm_head,
            dtype_bytes,
            parameters: 5000,
            trainable,
            accumulating: false,
            grad_bytes: 4,
            lora: false,
            tp: 2,
            sharded: false,
        };
        // A layer: s b h (10 + 24/2 + 5 a s / (h 2)) = 1024 x (22 + 0.625) bytes.
        let layer = 23_168;
        // The head's fp32 logits, 4 s b V / T; the embedding slice's gradient, 4 (V / T) h.
        let (logits, embedding) = (4 * 8 * 2 * 1024 / 2, 4 * (1024 / 2) * 64);
        let rest = logits + 4 * 5000 + 2 * embedding;
        assert_eq!(activation_bytes(&shape(false, 2, true, 5000)), 3 * layer + rest);
        // Checkpointed: each layer keeps its input, 2 s b h, and one is rebuilt in backward.
        assert_eq!(activation_bytes(&shape(true, 2, true, 5000)), 3 * 2 * 1024 + layer + rest);
        // f32 doubles the 16-bit terms, not the fp32 logits or gradients.
        assert_eq!(activation_bytes(&shape(false, 4, true, 5000)), 2 * 3 * layer + rest);
        assert_eq!(activation_bytes(&shape(true, 4, true, 5000)), 2 * (3 * 2 * 1024 + layer) + rest);
        // A score head keeps no logits; a frozen embedding (`--only-optimize-lora`) forms no
        // gradient, and only the trainable parameters' gradients are formed.
        assert_eq!(activation_bytes(&shape(false, 2, false, 5000)), 3 * layer + rest - logits);
        assert_eq!(activation_bytes(&shape(false, 2, true, 1000)), 3 * layer + logits + 4 * 1000);
    }

    /// ZeRO-3's largest gathered unit by hand: a block is 12 C^2 + 13 C values (c_attn, c_proj,
    /// c_fc, the MLP's c_proj and two LayerNorms); gpt2's outer unit, V C + 1024 C + 2 C, is the
    /// larger, with a score head's parameters in it; with 10 tokens and 8 positions a block is.
    #[test]
    fn the_largest_gathered_unit_by_hand() {
        let gpt2 = Gpt2Config::gpt2();
        assert_eq!(block_values(&gpt2), 12 * 768 * 768 + 13 * 768);
        let outer = 50257 * 768 + 1024 * 768 + 2 * 768;
        assert_eq!(gathered_unit_values(&gpt2, 0), outer);
        assert_eq!(gathered_unit_values(&gpt2, 769), outer + 769);
        let p = parameter_count(&gpt2);
        let scored = MemoryPlan::new(&gpt2, 1, 64, false)
            .with_score_head()
            .with_parameters(p + 769, p + 769)
            .with_data_parallel(ZeroStage::Parameters, 4);
        assert_eq!(scored.gathered_unit_bytes, 8 * (outer + 769) as u64, "the head's f32 values and gradient");
        let narrow = Gpt2Config { vocab_size: 10, n_positions: 8, n_embd: 64, ..Gpt2Config::tiny() };
        assert_eq!(gathered_unit_values(&narrow, 0), 12 * 64 * 64 + 13 * 64);
        assert_eq!(block_values(&Gpt2Config::tiny()), 12 * 128 * 128 + 13 * 128);
    }

    /// Stage 3 divides each model state once by the world size: in bf16 the fp32 masters, their
    /// gradient, the two moments and the bf16 copy, 18 bytes a parameter over 4 ranks (ZeRO's
    /// 16 P / N with our f32 gradients for its fp16 ones). Under tensor parallelism the gathered
    /// unit is this rank's slices of it: the unit scaled by the share of the parameters held.
    #[test]
    fn stage_3_shards_every_model_state_once() {
        let cfg = Gpt2Config::tiny();
        let p = parameter_count(&cfg) as u64;
        let bf16 = candle_core::DType::BF16;
        let plan = MemoryPlan::new(&cfg, 2, 32, false).with_compute_dtype(bf16);
        let stage_3 = plan.clone().with_data_parallel(ZeroStage::Parameters, 4);
        let states = (stage_3.param_bytes, stage_3.grad_bytes, stage_3.adam_bytes, stage_3.compute_copy_bytes);
        assert_eq!(p % 4, 0, "tiny's 7.26M parameters split evenly");
        assert_eq!(states, (p, p, 2 * p, p / 2));
        assert_eq!(stage_3.model_state_bytes(), 18 * p / 4);
        let transient = stage_3.activation_bytes() + stage_3.gathered_unit_bytes;
        assert_eq!(stage_3.total(), 18 * p / 4 + transient, "the gathered unit beside the activations");
        let split = plan.with_tensor_parallel(2, 0);
        let (_, held) = split.tensor_parallel.unwrap();
        let both = split.with_data_parallel(ZeroStage::Parameters, 4);
        let unit = gathered_unit_values(&cfg, 0) as u64;
        assert_eq!(both.gathered_unit_bytes, 8 * (unit * held as u64 / p));
        assert!(both.gathered_unit_bytes < stage_3.gathered_unit_bytes);
        // On a GPU the next block is prefetched beside it: this rank's slices of it in bf16.
        let on_gpu = MemoryPlan::new(&cfg, 2, 32, false)
            .with_compute_dtype(bf16)
            .on_device_kind(DeviceKind::Cuda)
            .with_tensor_parallel(2, 0)
            .with_data_parallel(ZeroStage::Parameters, 4)
            .with_offload(false);
        let block = block_values(&cfg) as u64;
        assert_eq!(on_gpu.gathered_unit_bytes, both.gathered_unit_bytes + 2 * (block * held as u64 / p));
    }

    /// What one of 2 tensor-parallel ranks holds of tiny, by hand: C = 128, 4 layers, 256
    /// positions; the vocabulary 50257 padded to 50432 rows.
    fn tiny_held_by_one_of_two_tp_ranks() -> usize {
        let (c, l) = (128, 4);
        let whole = 256 * c + l * (4 * c + 2 * c) + 2 * c; // wpe, LayerNorms, c_proj biases, ln_f
        let sliced = 50432 * c + l * (c * 3 * c + 3 * c + c * c + c * 4 * c + 4 * c + 4 * c * c);
        whole + sliced / 2
    }

    /// Under tensor parallelism the trunk is split and what is beyond it counted as the rank
    /// holds it: its slices of the adapters, a score head whole; a frozen trunk has no gradient
    /// or moment, only the adapters do. Before, a frozen trunk's adapters lost theirs: the states
    /// were scaled by the share of trainable values in whole bytes (`4 x trainable / total`, 0
    /// for LoRA), and the trained count became the slices held less the whole frozen trunk (0).
    #[test]
    fn tensor_parallel_keeps_the_adapters_states_beside_a_frozen_trunk() {
        let cfg = Gpt2Config::tiny();
        let (p, trunk) = (parameter_count(&cfg), tiny_held_by_one_of_two_tp_ranks());
        // LoRA of rank 4 on the four linears of tiny's 4 blocks: r (in + out) an adapter whole;
        // one of 2 ranks holds the column-parallel linears' (c_attn, c_fc) A (r, in) whole and
        // half of B (out, r), the row-parallel ones' (the c_projs) half of A and B whole.
        let adapters = 4 * 4 * ((128 + 384) + (128 + 128) + (128 + 512) + (512 + 128));
        let held = 4 * 4 * ((128 + 384 / 2) + (128 / 2 + 128) + (128 + 512 / 2) + (512 / 2 + 128));
        let lora = MemoryPlan::new(&cfg, 2, 64, false)
            .with_parameters(p + adapters, adapters)
            .with_lora(true)
            .with_tensor_parallel(2, held);
        assert_eq!(lora.tensor_parallel, Some((2, trunk + held)));
        let states = (lora.param_bytes, lora.grad_bytes, lora.adam_bytes);
        assert_eq!(states, (4 * (trunk + held) as u64, 4 * held as u64, 8 * held as u64));
        assert_eq!((lora.activations.parameters, lora.activations.trainable), (trunk + held, held));
        let head = 129;
        let scored = MemoryPlan::new(&cfg, 2, 64, false)
            .with_parameters(p + head, p + head)
            .with_compute_dtype(candle_core::DType::BF16)
            .with_tensor_parallel(2, head);
        let held = (trunk + head) as u64;
        let states = (scored.param_bytes, scored.grad_bytes, scored.adam_bytes, scored.compute_copy_bytes);
        assert_eq!(states, (4 * held, 4 * held, 8 * held, 2 * held));
        assert_eq!(scored.activations.trainable, trunk + head);
    }

    /// Under tensor parallelism a rank's slices in fp32 are its masters, whole over the
    /// data-parallel ranks at stage 1: `--offload` moves the moments alone, and the step's
    /// all-gather copies the masters out in f32 (not a shard of sharded masters in bf16).
    #[test]
    fn tensor_parallel_masters_stay_whole_at_stage_1_in_fp32() {
        let cfg = Gpt2Config::tiny();
        let trunk = tiny_held_by_one_of_two_tp_ranks() as u64;
        let plan = |dtype| {
            MemoryPlan::new(&cfg, 2, 64, false)
                .with_compute_dtype(dtype)
                .on_device_kind(DeviceKind::Cuda)
                .with_tensor_parallel(2, 0)
                .with_data_parallel(ZeroStage::OptimizerStates, 2)
        };
        let fp32 = plan(candle_core::DType::F32).with_offload(true);
        assert_eq!((fp32.param_bytes, fp32.adam_bytes), (4 * trunk, 0), "whole masters stay on the GPU");
        let bf16 = plan(candle_core::DType::BF16).with_offload(true);
        assert_eq!((bf16.param_bytes, bf16.adam_bytes), (0, 0), "sharded masters go with the moments");
        // The all-gather after the step: rounds of the whole slices, the ring's half of them,
        // and the shard's masters and gradient copied out in f32.
        let shard = trunk.div_ceil(2);
        let gathering = 4 * (trunk + shard) + 8 * shard - 4 * (trunk - shard);
        assert_eq!(plan(candle_core::DType::F32).with_buckets(usize::MAX, usize::MAX).reduction_bytes, gathering);
    }

    /// A CUDA plan for `cfg` with its vocabulary padded to 128 (as `bench` pads it: 50304).
    fn cuda_plan(cfg: Gpt2Config, b: usize, t: usize, checkpoint: bool, dtype: candle_core::DType) -> MemoryPlan {
        let mut cfg = cfg;
        cfg.pad_vocab(128);
        MemoryPlan::new(&cfg, b, t, checkpoint).with_compute_dtype(dtype).on_device_kind(DeviceKind::Cuda)
    }

    #[test]
    fn cuda_runs_the_fused_gpu_kernels_and_holds_gradients_in_the_compute_dtype_alone() {
        use candle_core::DType::{BF16, F16, F32};
        let mut cfg = Gpt2Config::gpt2();
        cfg.pad_vocab(128); // as `cuda_plan` pads it
        let p = cuda_plan(cfg.clone(), 2, 64, false, BF16).parameters as u64;
        let half = cuda_plan(cfg.clone(), 2, 64, false, BF16);
        assert_eq!(half.activations.kernels, Kernels::FusedGpu { flash_attention: true });
        assert_eq!((half.activations.grad_bytes, half.grad_bytes), (2, 2 * p), "kept as backward formed them");
        assert_eq!(cuda_plan(cfg.clone(), 2, 64, false, F16).activations.kernels, half.activations.kernels);
        // f32 runs the composed attention (its softmax and dropout still kernels), and so do
        // heads other than 64 in half precision.
        let single = cuda_plan(cfg.clone(), 2, 64, false, F32);
        assert_eq!(single.activations.kernels, Kernels::FusedGpu { flash_attention: false });
        assert_eq!(single.grad_bytes, 4 * p);
        let wide_heads = Gpt2Config { n_head: 6, ..cfg.clone() };
        assert_eq!(
            cuda_plan(wide_heads, 2, 64, false, BF16).activations.kernels,
            Kernels::FusedGpu { flash_attention: false }
        );
        let reference = crate::kernels::ops::with_reference_ops(|| cuda_plan(cfg.clone(), 2, 64, false, BF16));
        assert_eq!(reference.activations.kernels, Kernels::Composed);
        // Sums over micro-batches and across ranks are f32, whatever order the builder runs in.
        let accumulating = cuda_plan(cfg.clone(), 2, 64, false, BF16).with_gradient_accumulation(4);
        assert_eq!(accumulating.grad_bytes, 4 * p);
        let first = MemoryPlan::new(&cfg, 2, 64, false).with_gradient_accumulation(4);
        assert_eq!(first.with_compute_dtype(BF16).on_device_kind(DeviceKind::Cuda).grad_bytes, 4 * p);
        let stage_1 = cuda_plan(cfg.clone(), 2, 64, false, BF16).with_data_parallel(ZeroStage::OptimizerStates, 2);
        assert_eq!(stage_1.grad_bytes, 4 * p);
        // The fp32 masters sharded beside the whole bf16 copy; whole with LoRA or in fp32.
        assert_eq!((stage_1.param_bytes, stage_1.compute_copy_bytes), (2 * p, 2 * p));
        let lora = cuda_plan(cfg.clone(), 2, 64, false, BF16).with_lora(true);
        assert_eq!(lora.with_data_parallel(ZeroStage::OptimizerStates, 2).param_bytes, 4 * p);
        let fp32 = MemoryPlan::new(&cfg, 2, 64, false).with_data_parallel(ZeroStage::Gradients, 2);
        assert_eq!(fp32.param_bytes, 4 * p);
        let stage_2 = cuda_plan(cfg.clone(), 2, 64, false, BF16).with_data_parallel(ZeroStage::Gradients, 2);
        assert_eq!(stage_2.grad_bytes, 2 * p);
        assert_eq!(stage_2.gathered_unit_bytes, 0, "only stage 3 gathers units");
        // Stage 3 holds the largest unit whole with its gradient: gpt2's embeddings and ln_f.
        let gpt2 = Gpt2Config::gpt2();
        let stage_3 = MemoryPlan::new(&gpt2, 1, 64, false).with_data_parallel(ZeroStage::Parameters, 4);
        let outer = gpt2.vocab_size * 768 + 1024 * 768 + 2 * 768;
        assert_eq!(stage_3.gathered_unit_bytes, 8 * outer as u64);
        assert!(stage_3.report().contains("for ZeRO-3's largest gathered unit and its gradient"));
        let split = cuda_plan(cfg.clone(), 2, 64, false, BF16).with_tensor_parallel(2, 0);
        let (_, held) = split.tensor_parallel.unwrap();
        assert_eq!(split.grad_bytes, 4 * held as u64);
        let frozen = cuda_plan(cfg.clone(), 2, 64, false, BF16).with_parameters(p as usize, 1000);
        assert_eq!(frozen.grad_bytes, 2000, "the trainable ones only");
        assert!(half.report().contains("for gradients (in the compute dtype)"), "{}", half.report());
        let cpu = MemoryPlan::new(&cfg, 2, 64, false).with_compute_dtype(BF16).on_device(&candle_core::Device::Cpu);
        assert_eq!((cpu.activations.kernels, cpu.grad_bytes), (Kernels::Composed, 4 * p));
    }

    /// The five configurations `bench train` measured on an H200 (gpt2 B8 T1024 bf16, B4 T512
    /// bf16, B8 T1024 fp32, gpt2-medium B4 T1024 bf16, gpt2 B8 T1024 bf16 checkpointed) with
    /// their measured pool peaks in MiB, each planned with gradients held in `gradient_bytes`:
    /// within 10% of the measurement, and never under it by more than 1% (a run that does not fit
    /// must not look as if it did).
    fn assert_plans_match(pool_peaks_mib: [f64; 5], gradient_bytes: usize) {
        use candle_core::DType::{BF16, F32};
        let configurations = [
            ("gpt2 B8 T1024 bf16", cuda_plan(Gpt2Config::gpt2(), 8, 1024, false, BF16)),
            ("gpt2 B4 T512 bf16", cuda_plan(Gpt2Config::gpt2(), 4, 512, false, BF16)),
            ("gpt2 B8 T1024 fp32", cuda_plan(Gpt2Config::gpt2(), 8, 1024, false, F32)),
            ("gpt2-medium B4 T1024 bf16", cuda_plan(Gpt2Config::gpt2_medium(), 4, 1024, false, BF16)),
            ("gpt2 B8 T1024 bf16 checkpointed", cuda_plan(Gpt2Config::gpt2(), 8, 1024, true, BF16)),
        ];
        for ((name, mut plan), measured) in configurations.into_iter().zip(pool_peaks_mib) {
            if plan.activations.dtype_bytes != 4 {
                plan.hold_gradients_in(gradient_bytes);
            }
            let planned = plan.total() as f64 / MIB;
            let ratio = planned / measured;
            assert!((0.99..1.10).contains(&ratio), "{name}: planned {planned:.0} MiB, measured {measured} MiB");
        }
    }

    /// `bench train` on an H200, 2026-11-27 (real measurements, one micro-batch a step, dropout
    /// on, gradients cast to f32 by `GradAccumulator::add`): the CUDA pool's USED_MEM_HIGH over
    /// the measured steps, every live tensor at the step's peak. Before `FusedGpu` the plan said
    /// 21193, 5461, 40011, 28832 and 6817 MiB.
    #[test]
    fn the_fused_gpu_estimate_matches_the_peaks_measured_on_an_h200() {
        assert_plans_match([6410.0, 3307.0, 26738.0, 11052.0, 3651.0], 4);
    }

    /// The same five measured again (H200, 2026-11-27, a4c5992) once the fused GPU step held the
    /// gradients in the compute dtype; the plan had predicted 6408, 3014, 26735, 9900 and 3651
    /// MiB before this run.
    #[test]
    fn the_fused_gpu_estimate_matches_the_peaks_measured_with_compute_dtype_gradients() {
        assert_plans_match([6409.7, 3015.0, 26737.8, 9902.5, 3651.1], 2);
    }

    /// The formula by hand on a one-block model: B 2, T 8 (N 16), C 64 in one head of 64 (flash
    /// attention in bf16), V 1000, 8 positions.
    #[test]
    fn the_fused_gpu_estimate_by_hand() {
        let cfg =
            Gpt2Config { n_layer: 1, n_embd: 64, n_head: 1, n_positions: 8, vocab_size: 1000, ..Gpt2Config::tiny() };
        let mut plan = MemoryPlan::new(&cfg, 2, 8, false)
            .with_compute_dtype(candle_core::DType::BF16)
            .on_device_kind(DeviceKind::Cuda);
        // P: the block's 12 C^2 + 13 C, the embeddings (1000 + 8) x 64, ln_f 2C.
        let p = 12 * 64 * 64 + 13 * 64 + 1008 * 64 + 128;
        assert_eq!(plan.parameters, p);
        let (nc, nv, w) = (16 * 64, 16 * 1000, 1000 * 64);
        // A: the block's 20 (N, C) and 2 x (B, NH, T) f32 statistics, embeddings and ln_f 4
        // (N, C), the logits, the (T, T) f32 mask.
        let kept = 2 * 20 * nc + 4 * 2 * 16 + 2 * (4 * nc + nv) + 4 * 8 * 8;
        assert_eq!(kept, 81_536);
        let head = kept + 2 * (nv + nc + 3 * w);
        let embedding = kept + 2 * (p + 2 * w + nc);
        assert_eq!((head, embedding), (499_584, 568_832));
        // Held in bf16: the add phase forms nothing new; the embedding's backward is the peak.
        assert_eq!(plan.activation_bytes(), (embedding - 2 * p) as u64);
        assert_eq!(plan.activation_bytes(), 339_584);
        // Held in f32: `add` makes f32 copies of all P while the bf16 ones and A live.
        plan.hold_gradients_in(4);
        let add = kept + 2 * p + 4 * p;
        assert_eq!(plan.activation_bytes(), (add - 4 * p) as u64);
        assert_eq!(plan.activation_bytes(), 310_784);
    }

    /// A one-block CUDA plan in bf16 for B x T tokens: `heads` heads of C / `heads`, V rows.
    fn one_block_gpu_plan(c: usize, heads: usize, vocab_size: usize, b: usize, t: usize) -> MemoryPlan {
        let cfg =
            Gpt2Config { n_layer: 1, n_embd: c, n_head: heads, n_positions: 64, vocab_size, ..Gpt2Config::tiny() };
        MemoryPlan::new(&cfg, b, t, false)
    }

    fn on_a_gpu_in_bf16(plan: MemoryPlan) -> MemoryPlan {
        plan.with_compute_dtype(candle_core::DType::BF16).on_device_kind(DeviceKind::Cuda)
    }

    /// The parameters of those one-block models by hand: the block's 12 C^2 + 13 C, the
    /// embeddings (V + 64 positions) x C, ln_f 2C.
    fn one_block_parameters(c: usize, vocab_size: usize) -> usize {
        12 * c * c + 13 * c + (vocab_size + 64) * c + 2 * c
    }

    /// The composed attention (heads of 16, not the flash kernel's 64) by hand: C 64 in 4
    /// heads, V 16, B 2 x T 64 (N 128), where the first block's backward is the peak (the
    /// attention's two (B, NH, T, T) gradients); with LoRA adapters; and with a frozen trunk,
    /// whose formed gradients are the adapters' alone beside what the untracked dwte^T holds.
    #[test]
    fn the_fused_gpu_estimate_by_hand_with_the_composed_attention() {
        let plan = on_a_gpu_in_bf16(one_block_gpu_plan(64, 4, 16, 2, 64));
        assert_eq!(plan.activations.kernels, Kernels::FusedGpu { flash_attention: false });
        let p = one_block_parameters(64, 16);
        assert_eq!(plan.parameters, p);
        let (nc, nv, w, scores) = (128 * 64, 128 * 16, 16 * 64, 2 * 4 * 64 * 64);
        // A in bf16: the block's 19 + 8 (N, C) and 3 (B, NH, T, T), the embeddings and ln_f 4
        // (N, C), the logits; the (T, T) f32 mask.
        let kept = 2 * (27 * nc + 3 * scores) + 2 * (4 * nc + nv) + 4 * 64 * 64;
        assert_eq!(kept, 724_992);
        // The block's transient: 2 (B, NH, T, T) and 2 (N, C), above the MLP's 9 (N, C).
        let transient = 2 * (2 * scores + 2 * nc);
        assert!(transient > 2 * 9 * nc);
        let blocks = kept + 2 * p + transient;
        let (head, embedding, add) = (kept + 2 * (nv + nc + 3 * w), kept + 2 * (p + 2 * w + nc), kept + 2 * p);
        assert_eq!((blocks, head, embedding, add), (999_296, 751_616, 855_936, 835_456));
        assert_eq!(plan.activation_bytes(), (blocks - 2 * p) as u64);
        // LoRA: 27 (N, C) more a block, in every phase.
        let lora = on_a_gpu_in_bf16(one_block_gpu_plan(64, 4, 16, 2, 64).with_lora(true));
        assert_eq!(lora.activation_bytes(), (blocks + 2 * 27 * nc - 2 * p) as u64);
        assert_eq!(lora.activation_bytes(), 1_331_200);
        // A frozen trunk with 1000 adapter values: no W formed, but dwte^T (V, C) and d(logits)
        // left under the untracked node; the formed gradients are the adapters'.
        let adapters = 1000;
        let frozen = on_a_gpu_in_bf16(
            one_block_gpu_plan(64, 4, 16, 2, 64).with_parameters(p + adapters, adapters).with_lora(true),
        );
        let kept = kept + 2 * 27 * nc;
        let leftover = 2 * (nv + w);
        let blocks = kept + leftover + 2 * adapters + transient;
        let head = kept + 2 * (nv + nc + w);
        let (embedding, add) = (kept + leftover + 2 * (adapters + nc), kept + leftover + 2 * adapters);
        assert_eq!((blocks, head, embedding, add), (1_339_344, 1_189_888, 1_191_888, 1_175_504));
        assert_eq!(frozen.activation_bytes(), (blocks - 2 * adapters) as u64);
    }

    /// The flash attention with 2 heads of 64 by hand, where the LM head's backward is the peak:
    /// C 128, V 1000, B 4 x T 64 (N 256), in bf16.
    #[test]
    fn the_fused_gpu_estimate_by_hand_where_the_lm_head_peaks() {
        let plan = on_a_gpu_in_bf16(one_block_gpu_plan(128, 2, 1000, 4, 64));
        assert_eq!(plan.activations.kernels, Kernels::FusedGpu { flash_attention: true });
        let p = one_block_parameters(128, 1000);
        assert_eq!(plan.parameters, p);
        let (nc, nv, w) = (256 * 128, 256 * 1000, 1000 * 128);
        // The block's 20 (N, C) in bf16 and its row maxima and 1/sums, 2 (B, NH, T) in f32.
        let block = 2 * 20 * nc + 2 * 4 * (4 * 2 * 64);
        let kept = block + 2 * (4 * nc + nv) + 4 * 64 * 64;
        assert_eq!(kept, 2_105_344);
        let head = kept + 2 * (nv + nc + 3 * w);
        let (blocks, embedding) = (kept + 2 * p + 2 * 9 * nc, kept + 2 * (p + 2 * w + nc));
        assert_eq!((head, blocks, embedding), (3_450_880, 3_364_608, 3_352_320));
        assert_eq!(plan.activation_bytes(), (head - 2 * p) as u64);
    }

    /// Accumulating with f32 gradients in bf16 by hand, where adding to the held gradients is the
    /// peak: C 128 in 2 heads (flash), V 256, B 2 x T 64 (N 128). Every phase carries the held
    /// f32 gradients; the add phase, the largest tensor's cast copy and sum beside them, the MLP's
    /// (C, 4C) weight, larger than the (V, C) embedding here.
    #[test]
    fn the_fused_gpu_estimate_by_hand_accumulating() {
        let plan = on_a_gpu_in_bf16(one_block_gpu_plan(128, 2, 256, 2, 64).with_gradient_accumulation(2));
        assert_eq!(plan.activations.grad_bytes, 4);
        let p = one_block_parameters(128, 256);
        let (nc, nv, w, largest) = (128 * 128, 128 * 256, 256 * 128, 128 * 512);
        let kept = 2 * 20 * nc + 2 * 4 * (2 * 2 * 64) + 2 * (4 * nc + nv) + 4 * 64 * 64;
        assert_eq!(kept, 870_400);
        let held = 4 * p;
        let head = kept + 2 * (nv + nc + 3 * w) + held;
        let blocks = kept + 2 * p + 2 * 9 * nc + held;
        let embedding = kept + 2 * (p + 2 * w + nc) + held;
        let add = kept + 2 * p + held + 2 * 4 * largest;
        assert_eq!((head, blocks, embedding, add), (2_123_264, 2_602_240, 2_471_168, 2_831_616));
        assert_eq!(plan.activation_bytes(), (add - held) as u64);

        // In f32 (the composed attention; no cast: the largest tensor's sum alone), adding is
        // the peak for C 64 in 1 head, V 16, B 1 x T 8 (N 8)...
        let f32_plan = |c, heads, vocab_size| {
            one_block_gpu_plan(c, heads, vocab_size, 1, 8)
                .with_gradient_accumulation(2)
                .on_device_kind(DeviceKind::Cuda)
        };
        let plan = f32_plan(64, 1, 16);
        assert_eq!(plan.activations.kernels, Kernels::FusedGpu { flash_attention: false });
        let p = one_block_parameters(64, 16);
        let (nc, nv, w, scores) = (8 * 64, 8 * 16, 16 * 64, 8 * 8);
        let kept = 4 * (27 * nc + 3 * scores) + 4 * (4 * nc + nv) + 4 * 8 * 8;
        let held = 4 * p;
        let add = kept + 4 * p + held + 4 * (64 * 256);
        let blocks = kept + 4 * p + 4 * 9 * nc + held;
        let embedding = kept + 4 * (p + 2 * w + nc) + held;
        assert_eq!((add, blocks, embedding), (572_416, 525_312, 517_120));
        assert_eq!(plan.activation_bytes(), (add - held) as u64);
        // ...the embedding's backward for C 128 in 2 heads, V 1000 (W above the MLP's weight)...
        let plan = f32_plan(128, 2, 1000);
        let p = one_block_parameters(128, 1000);
        let (nc, nv, w, scores) = (8 * 128, 8 * 1000, 1000 * 128, 2 * 8 * 8);
        let kept = 4 * (27 * nc + 3 * scores) + 4 * (4 * nc + nv) + 4 * 8 * 8;
        let held = 4 * p;
        let embedding = kept + 4 * (p + 2 * w + nc) + held;
        let (add, head) = (kept + 4 * p + held + 4 * w, kept + 4 * (nv + nc + 3 * w) + held);
        assert_eq!((embedding, add, head), (3_866_624, 3_350_528, 3_071_744));
        assert_eq!(plan.activation_bytes(), (embedding - held) as u64);
        // ...and in bf16 the LM head's backward for V 16384, C 64 in 1 head, B 8 x T 64 (N 512).
        let plan = on_a_gpu_in_bf16(one_block_gpu_plan(64, 1, 16384, 8, 64).with_gradient_accumulation(2));
        let p = one_block_parameters(64, 16384);
        let (nc, nv, w) = (512 * 64, 512 * 16384, 16384 * 64);
        let kept = 2 * 20 * nc + 2 * 4 * 512 + 2 * (4 * nc + nv) + 4 * 64 * 64;
        let held = 4 * p;
        let (head, add) = (kept + 2 * (nv + nc + 3 * w) + held, kept + 2 * p + held + 2 * 4 * w);
        assert_eq!((head, add), (45_915_904, 33_375_872));
        assert_eq!(plan.activation_bytes(), (head - held) as u64);
    }

    /// The first block's backward as the peak by hand (every other gradient formed, in bf16,
    /// and the block's largest transient): with the flash attention (C 128 in 2 heads, V 256,
    /// B 2 x T 64), where the MLP's 9 (N, C) are the transient; with the composed attention (C
    /// 64 in 2 heads of 32, V 16, B 2 x T 16), whose 9 (N, C) exceed its two (B, NH, T, T); and
    /// with accumulated f32 gradients held beside it (the composed attention's plan above).
    #[test]
    fn the_fused_gpu_estimate_by_hand_where_a_block_peaks() {
        let plan = on_a_gpu_in_bf16(one_block_gpu_plan(128, 2, 256, 2, 64));
        let p = one_block_parameters(128, 256);
        let (nc, nv, w) = (128 * 128, 128 * 256, 256 * 128);
        let kept = 2 * 20 * nc + 2 * 4 * (2 * 2 * 64) + 2 * (4 * nc + nv) + 4 * 64 * 64;
        let blocks = kept + 2 * p + 2 * 9 * nc;
        let (head, embedding, add) = (kept + 2 * (nv + nc + 3 * w), kept + 2 * (p + 2 * w + nc), kept + 2 * p);
        assert_eq!((blocks, head, embedding, add), (1_644_288, 1_165_312, 1_513_216, 1_349_376));
        assert_eq!(plan.activation_bytes(), (blocks - 2 * p) as u64);

        let plan = on_a_gpu_in_bf16(one_block_gpu_plan(64, 2, 16, 2, 16));
        assert_eq!(plan.activations.kernels, Kernels::FusedGpu { flash_attention: false });
        let p = one_block_parameters(64, 16);
        let (nc, nv, scores) = (32 * 64, 32 * 16, 2 * 2 * 16 * 16);
        let kept = 2 * (27 * nc + 3 * scores) + 2 * (4 * nc + nv) + 4 * 16 * 16;
        assert!(2 * 9 * nc > 2 * (2 * scores + 2 * nc));
        let blocks = kept + 2 * p + 2 * 9 * nc;
        assert_eq!(blocks, 282_496);
        assert_eq!(plan.activation_bytes(), (blocks - 2 * p) as u64);

        let plan = on_a_gpu_in_bf16(one_block_gpu_plan(64, 4, 16, 2, 64).with_gradient_accumulation(2));
        let p = one_block_parameters(64, 16);
        let (nc, nv, w, scores) = (128 * 64, 128 * 16, 16 * 64, 2 * 4 * 64 * 64);
        let kept = 2 * (27 * nc + 3 * scores) + 2 * (4 * nc + nv) + 4 * 64 * 64;
        let (transient, held) = (2 * (2 * scores + 2 * nc), 4 * p);
        let blocks = kept + 2 * p + transient + held;
        // Adding: the MLP's (C, 4C) weight, cast and summed beside the held gradients.
        let add = kept + 2 * p + held + 2 * 4 * (64 * 256);
        let (head, embedding) = (kept + 2 * (nv + nc + 3 * w) + held, kept + 2 * (p + 2 * w + nc) + held);
        assert_eq!((blocks, add, head, embedding), (1_220_224, 1_187_456, 972_544, 1_076_864));
        assert_eq!(plan.activation_bytes(), (blocks - held) as u64);
    }

    /// A frozen trunk's adapters with f32 gradients held in a bf16 run (as over several ranks),
    /// by hand, where adding them is the peak: C 64 in 1 head (flash), V 16, B 1 x T 16, 8192
    /// adapter values. Beside every phase but the LM head's, the logits' gradient and dwte^T that
    /// the untracked node keeps.
    #[test]
    fn the_fused_gpu_estimate_by_hand_for_a_frozen_trunk_with_f32_gradients() {
        let p = one_block_parameters(64, 16);
        let adapters = 8192;
        let mut plan = on_a_gpu_in_bf16(
            one_block_gpu_plan(64, 1, 16, 1, 16).with_parameters(p + adapters, adapters).with_lora(true),
        );
        plan.hold_gradients_in(4);
        let (nc, nv, table) = (16 * 64, 16 * 16, 16 * 64);
        let kept = 2 * (20 + 27) * nc + 2 * 4 * 16 + 2 * (4 * nc + nv) + 4 * 16 * 16;
        let (leftover, held) = (2 * (nv + table), 4 * adapters);
        let add = kept + leftover + 2 * adapters + held;
        let blocks = kept + leftover + 2 * adapters + 2 * 9 * nc;
        let (embedding, head) = (kept + leftover + 2 * (adapters + nc), kept + 2 * (nv + nc + table));
        assert_eq!((add, blocks, embedding, head), (157_824, 143_488, 127_104, 110_720));
        assert_eq!(plan.activation_bytes(), (add - held) as u64);
    }

    /// Checkpointing on a GPU by hand, each case with another phase as the peak. Kept through
    /// backward: 3 + L (N, C), the logits and the f32 mask; the held gradients sit in every phase
    /// but the LM head's, which has them only when accumulating.
    #[test]
    fn the_fused_gpu_estimate_by_hand_checkpointed() {
        let checkpointed = |c, heads, vocab_size, b, t| {
            let cfg =
                Gpt2Config { n_layer: 1, n_embd: c, n_head: heads, n_positions: 64, vocab_size, ..Gpt2Config::tiny() };
            MemoryPlan::new(&cfg, b, t, true)
        };
        // A recomputed block, the peak: the composed attention's plan above (C 64 in 4 heads,
        // V 16, B 2 x T 64), gradients held in bf16.
        let plan = on_a_gpu_in_bf16(checkpointed(64, 4, 16, 2, 64));
        let p = one_block_parameters(64, 16);
        let (nc, nv, w, scores) = (128 * 64, 128 * 16, 16 * 64, 2 * 4 * 64 * 64);
        let kept = 2 * (4 * nc + nv) + 4 * 64 * 64;
        let (block, transient, held) = (2 * (27 * nc + 3 * scores), 2 * (2 * scores + 2 * nc), 2 * p);
        // Its activations, 5 (N, C) for its input's copy, the surrogate and the gradients.
        let recomputed = kept + block + 2 * 5 * nc + transient + held;
        let head = kept + 2 * (nv + nc + 3 * w);
        // The embeddings: 8 (N, C) and wte's gradient added to zeros, 3 W (above its W and its
        // sum with the head's, bf16 on bf16: 2 W).
        let embedding = kept + 2 * 8 * nc + 2 * 3 * w + held;
        assert_eq!((recomputed, head, embedding), (1_081_216, 112_640, 333_696));
        assert_eq!(plan.activation_bytes(), (recomputed - held) as u64);
        // The LM head's backward, the peak for a large vocabulary: C 64 in 1 head (flash), V
        // 16384, B 8 x T 64 (N 512), accumulating f32 gradients.
        let plan = on_a_gpu_in_bf16(checkpointed(64, 1, 16384, 8, 64).with_gradient_accumulation(2));
        let p = one_block_parameters(64, 16384);
        let (nc, nv, w) = (512 * 64, 512 * 16384, 16384 * 64);
        let (kept, held) = (2 * (4 * nc + nv) + 4 * 64 * 64, 4 * p);
        let head = kept + 2 * (nv + nc + 3 * w) + held;
        let block = 2 * 20 * nc + 2 * 4 * 512;
        let recomputed = kept + block + 2 * 5 * nc + 2 * 9 * nc + held;
        // wte's gradient: its W and its cast and sum into the held one, above 3 W in bf16.
        let embedding = kept + 2 * 8 * nc + (2 * w + 2 * 4 * w) + held;
        assert_eq!((head, recomputed, embedding), (44_601_088, 23_699_200, 32_476_928));
        assert_eq!(plan.activation_bytes(), (head - held) as u64);
        // The embeddings' backward, the peak: V 1000, B 8 x T 16 (N 128), accumulating.
        let plan = on_a_gpu_in_bf16(checkpointed(64, 1, 1000, 8, 16).with_gradient_accumulation(2));
        let p = one_block_parameters(64, 1000);
        let (nc, nv, w) = (128 * 64, 128 * 1000, 1000 * 64);
        let (kept, held) = (2 * (4 * nc + nv) + 4 * 16 * 16, 4 * p);
        let embedding = kept + 2 * 8 * nc + (2 * w + 2 * 4 * w) + held;
        let head = kept + 2 * (nv + nc + 3 * w) + held;
        let recomputed = kept + (2 * 20 * nc + 2 * 4 * 128) + 2 * 5 * nc + 2 * 9 * nc + held;
        assert_eq!((embedding, head, recomputed), (1_566_464, 1_451_776, 1_353_472));
        assert_eq!(plan.activation_bytes(), (embedding - held) as u64);
        // Not accumulating, for C 128 in 2 heads, V 1000, B 1 x T 8: wte's gradient added to
        // zeros (3 W in bf16) above its W and its sum with the head's (2 W)...
        let plan = on_a_gpu_in_bf16(checkpointed(128, 2, 1000, 1, 8));
        let p = one_block_parameters(128, 1000);
        let (nc, nv, w) = (8 * 128, 8 * 1000, 1000 * 128);
        let (kept, held) = (2 * (4 * nc + nv) + 4 * 8 * 8, 2 * p);
        let embedding = kept + 2 * 8 * nc + 2 * 3 * w + held;
        let head = kept + 2 * (nv + nc + 3 * w);
        assert_eq!((embedding, head), (1_478_272, 810_496));
        assert_eq!(plan.activation_bytes(), (embedding - held) as u64);
        // ...and with f32 gradients held (as over several ranks) for V 4096 the W, its cast and
        // its sum into the head's, 2 + 2 x 4 bytes a value, above 3 W in bf16.
        let mut plan = on_a_gpu_in_bf16(checkpointed(128, 2, 4096, 1, 8));
        plan.hold_gradients_in(4);
        let p = one_block_parameters(128, 4096);
        let (nc, nv, w) = (8 * 128, 8 * 4096, 4096 * 128);
        let (kept, held) = (2 * (4 * nc + nv) + 4 * 8 * 8, 4 * p);
        let embedding = kept + 2 * 8 * nc + (2 * w + 2 * 4 * w) + held;
        let head = kept + 2 * (nv + nc + 3 * w);
        assert_eq!((embedding, head), (8_257_280, 3_287_296));
        assert_eq!(plan.activation_bytes(), (embedding - held) as u64);
        // A frozen trunk with 1000 adapter values, C 64 in 1 head, V 4096, B 2 x T 16: the LM
        // head's backward forms dwte^T (V, C) for no gradient, beside d(logits) and dx.
        let p = one_block_parameters(64, 4096);
        let plan = on_a_gpu_in_bf16(checkpointed(64, 1, 4096, 2, 16).with_parameters(p + 1000, 1000).with_lora(true));
        let (nc, nv, table) = (32 * 64, 32 * 4096, 4096 * 64);
        let (kept, held) = (2 * (4 * nc + nv) + 4 * 16 * 16, 2 * 1000);
        let head = kept + 2 * (nv + nc + table);
        let recomputed = kept + (2 * 47 * nc + 2 * 4 * 32) + 2 * 5 * nc + 2 * 9 * nc + held;
        let embedding = kept + 2 * 8 * nc + held;
        assert_eq!((head, recomputed, embedding), (1_070_080, 531_664, 314_320));
        assert_eq!(plan.activation_bytes(), (head - held) as u64);
    }

    /// A CPU plan's shape (f32, the fused CPU kernels, trained whole) of 3 blocks of C 32 in 2
    /// heads, V `vocab_size`, 16 positions, for B x T tokens.
    fn three_block_cpu_shape(vocab_size: usize, b: usize, t: usize, checkpoint: bool) -> ActivationShape {
        let cfg = Gpt2Config { n_layer: 3, n_embd: 32, n_head: 2, n_positions: 16, vocab_size, ..Gpt2Config::tiny() };
        let shape = MemoryPlan::new(&cfg, b, t, checkpoint).activations;
        assert_eq!(shape.kernels, Kernels::FusedCpu);
        assert_eq!(shape.parameters, 3 * (12 * 32 * 32 + 13 * 32) + (vocab_size + 16) * 32 + 2 * 32);
        shape
    }

    /// The fused CPU estimate by hand, f32 (4 bytes a value), L 3, C 32, V 500 (P 54,688, W
    /// 16,000): A is (20 L + 6) (N, C), 47 L + 6 with LoRA; the LM head's phase A, the logits, dx
    /// and dwte (W); the embedding's A, an (N, C), the rest of the gradients (P - W) and 2 W. Less
    /// the gradients that become the held ones where not accumulating (P, or the adapters').
    #[test]
    fn the_fused_cpu_estimate_by_hand() {
        let p = 54_688;
        let w = 500 * 32;
        let kept = |n: usize, per_block: usize| (per_block * 3 + 6) * n * 32;
        // B 2 x T 16 (N 32): the embedding's backward is the peak (P above the logits' N V).
        let (nc, nv, a) = (32 * 32, 32 * 500, kept(32, 20));
        let (head, embedding) = (a + nv + nc + w, a + nc + 2 * w + (p - w));
        assert_eq!((a, head, embedding), (67_584, 100_608, 139_296));
        assert_eq!(activation_bytes(&three_block_cpu_shape(500, 2, 16, false)), 4 * (embedding - p) as u64);
        // Accumulating: the fresh gradients are not the held ones, so nothing is taken off.
        let accumulating = ActivationShape { accumulating: true, ..three_block_cpu_shape(500, 2, 16, false) };
        assert_eq!(activation_bytes(&accumulating), 4 * embedding as u64);
        assert_eq!(activation_bytes(&accumulating), 557_184);
        // B 8 x T 16 (N 128): the LM head's backward is the peak.
        let (nc, nv, a) = (128 * 32, 128 * 500, kept(128, 20));
        let (head, embedding) = (a + nv + nc + w, a + nc + 2 * w + (p - w));
        assert_eq!((a, head, embedding), (270_336, 354_432, 345_120));
        assert_eq!(activation_bytes(&three_block_cpu_shape(500, 8, 16, false)), 4 * (head - p) as u64);
        assert_eq!(activation_bytes(&three_block_cpu_shape(500, 8, 16, false)), 1_198_976);
        // A score head: no logits and no head's dwte; the embedding's dwte is wte's gradient,
        // copied (2 W).
        let scored = ActivationShape { lm_head: false, ..three_block_cpu_shape(500, 8, 16, false) };
        let (head, embedding) = (a + nc, a + nc + 2 * w + (p - w));
        assert_eq!((head, embedding), (274_432, 345_120));
        assert_eq!(activation_bytes(&scored), 4 * (embedding - p) as u64);
        // A frozen trunk with 3000 adapter values and LoRA (B 2 x T 16): no W is formed; the
        // gradients formed are the adapters'.
        let adapters = 3000;
        let frozen = ActivationShape {
            parameters: p + adapters,
            trainable: adapters,
            lora: true,
            ..three_block_cpu_shape(500, 2, 16, false)
        };
        let (nc, nv, a) = (32 * 32, 32 * 500, kept(32, 47));
        let (head, embedding) = (a + nv + nc, a + nc + adapters);
        assert_eq!((a, head, embedding), (150_528, 167_552, 154_552));
        assert_eq!(activation_bytes(&frozen), 4 * (head - adapters) as u64);
        assert_eq!(activation_bytes(&frozen), 658_208);
    }

    /// Checkpointed on the CPU by hand (the model above; L 3, so L + 4 = 7 (N, C) beside the LM
    /// head's logits and W; a recomputed block with the embeddings' gradients: 2 W and L + 17
    /// (N, C) accumulating, else the head's W, wte's and L + 15; 27 (N, C) more with LoRA),
    /// each phase where it is the peak.
    #[test]
    fn the_fused_cpu_estimate_by_hand_checkpointed() {
        let (p, w) = (54_688, 500 * 32);
        let phases = |n: usize, lm: usize, w: usize, lora: usize| {
            let (nc, nv) = (n * 32, n * 500 * lm);
            (nv + lm * w + 7 * nc, 2 * w + (20 + lora) * nc, lm * w + w + (18 + lora) * nc)
        };
        let shape = |b, accumulating| ActivationShape { accumulating, ..three_block_cpu_shape(500, b, 16, true) };
        // Accumulating, B 2 x T 16 (N 32): the embeddings' phase...
        let (head, accumulated, _) = phases(32, 1, w, 0);
        assert_eq!((head, accumulated), (39_168, 52_480));
        assert_eq!(activation_bytes(&shape(2, true)), 4 * accumulated as u64);
        // ...and at N 256 the LM head's.
        let (head, accumulated, _) = phases(256, 1, w, 0);
        assert_eq!((head, accumulated), (201_344, 195_840));
        assert_eq!(activation_bytes(&shape(16, true)), 4 * head as u64);
        // Not accumulating, the head's phase less the gradients that are then the held ones: at
        // N 256 the embeddings' phase...
        let (head, _, embedding) = phases(256, 1, w, 0);
        assert_eq!((head - p, embedding), (146_656, 179_456));
        assert_eq!(activation_bytes(&shape(16, false)), 4 * embedding as u64);
        // ...and at N 512 the LM head's.
        let (head, _, embedding) = phases(512, 1, w, 0);
        assert_eq!((head - p, embedding), (332_000, 326_912));
        assert_eq!(activation_bytes(&shape(32, false)), 4 * (head - p) as u64);
        // With LoRA, a recomputed block's 27 (N, C) more; with a score head, no logits nor the
        // head's W.
        let lora = ActivationShape { lora: true, ..shape(2, false) };
        let (_, _, embedding) = phases(32, 1, w, 27);
        assert_eq!(embedding, 78_080);
        assert_eq!(activation_bytes(&lora), 4 * embedding as u64);
        let lora = ActivationShape { lora: true, ..shape(2, true) };
        let (_, accumulated, _) = phases(32, 1, w, 27);
        assert_eq!(activation_bytes(&lora), 4 * accumulated as u64);
        let scored = ActivationShape { lm_head: false, ..shape(2, false) };
        let (head, _, embedding) = phases(32, 0, w, 0);
        assert_eq!((head, embedding), (7168, 34_432));
        assert_eq!(activation_bytes(&scored), 4 * embedding as u64);
        // A frozen trunk (3000 adapter values, LoRA) with V 5000: no W, the LM head's phase the
        // peak, less the adapters' gradients where not accumulating.
        let adapters = 3000;
        let frozen = |accumulating| {
            let shape = three_block_cpu_shape(5000, 2, 16, true);
            ActivationShape {
                parameters: shape.parameters + adapters,
                trainable: adapters,
                lora: true,
                accumulating,
                ..shape
            }
        };
        let (nc, nv) = (32 * 32, 32 * 5000);
        let head = nv + 7 * nc;
        assert_eq!((head, 20 * nc + 27 * nc, 18 * nc + 27 * nc), (167_168, 48_128, 46_080));
        assert_eq!(activation_bytes(&frozen(false)), 4 * (head - adapters) as u64);
        assert_eq!(activation_bytes(&frozen(true)), 4 * head as u64);
    }

    /// ZeRO-3 on the CPU by hand (the model above, B 2 x T 16): the LM head's phase keeps the
    /// logits, the transposed dwte^T (W) and L + 5 (N, C); a recomputed block L + 15, 27 more
    /// with LoRA. No gradient is held apart from the unit's, so nothing is taken off.
    #[test]
    fn the_fused_cpu_estimate_by_hand_sharded() {
        let (nc, nv, w) = (32 * 32, 32 * 500, 500 * 32);
        let sharded =
            |lm_head, lora| ActivationShape { sharded: true, lm_head, lora, ..three_block_cpu_shape(500, 2, 16, true) };
        let (head, block) = (nv + w + 8 * nc, 18 * nc);
        assert_eq!((head, block), (40_192, 18_432));
        assert_eq!(activation_bytes(&sharded(true, false)), 4 * head as u64);
        // A score head: the recomputed block is the peak, with LoRA's 27 (N, C) too.
        assert_eq!(activation_bytes(&sharded(false, false)), 4 * block as u64);
        assert_eq!(activation_bytes(&sharded(false, true)), 4 * (block + 27 * nc) as u64);
        assert_eq!(activation_bytes(&sharded(false, true)), 184_320);
        // A frozen trunk forms no dwte^T for a gradient (V 5000: the head's phase the peak).
        let shape = three_block_cpu_shape(5000, 2, 16, true);
        let frozen = ActivationShape {
            parameters: shape.parameters + 3000,
            trainable: 3000,
            lora: true,
            sharded: true,
            ..shape
        };
        assert_eq!(activation_bytes(&frozen), 4 * (32 * 5000 + 8 * nc) as u64);
    }

    /// The composed kernels' graph count by hand in bf16 (the model above, B 4 x T 8, N 32):
    /// per block 30 (N, C) and 5 (B, NH, T, T), the head's 4 (N, V) and 6 (N, C); with
    /// checkpointing one block's and the L blocks' inputs.
    #[test]
    fn the_composed_estimate_by_hand() {
        let composed = |checkpoint| ActivationShape {
            kernels: Kernels::Composed,
            dtype_bytes: 2,
            ..three_block_cpu_shape(500, 4, 8, checkpoint)
        };
        let (nc, nv, scores) = (32 * 32, 32 * 500, 4 * 2 * 8 * 8);
        let (block, head) = (30 * nc + 5 * scores, 4 * nv + 6 * nc);
        assert_eq!((block, head), (33_280, 70_144));
        assert_eq!(activation_bytes(&composed(false)), 2 * (3 * block + head) as u64);
        assert_eq!(activation_bytes(&composed(true)), 2 * (3 * nc + block + head) as u64);
        assert_eq!(activation_bytes(&composed(true)), 212_992);
    }

    /// What a forward keeps on the CPU by hand: tiny's 4 layers of C 128 over 10 rows, 20 (N, C)
    /// a block and 6 beside, 27 more a block with LoRA adapters.
    #[test]
    fn forward_kept_values_by_hand() {
        let cfg = Gpt2Config::tiny();
        assert_eq!(forward_kept_values(&cfg, 10.0, false), ((20 * 4 + 6) * 10 * 128) as f64);
        assert_eq!(forward_kept_values(&cfg, 10.0, true), ((47 * 4 + 6) * 10 * 128) as f64);
    }
}
