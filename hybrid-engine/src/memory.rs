//! Memory accounting in the open (llm.c's habit): bytes for parameters, gradients and AdamW
//! moments from the one parameter inventory, and an estimate of activation memory for a
//! micro-batch, with and without activation checkpointing. Printed at startup; the measured
//! peak (see `metrics::peak_rss_mib`) is printed at the end so the two can be compared.

use crate::gpt2::Gpt2Config;
use crate::params::parameter_count;

const MIB: f64 = 1024.0 * 1024.0;

/// Keeps freed memory in the process for reuse instead of returning it to the kernel.
///
/// candle allocates a fresh buffer for every op result and frees it when dropped. glibc serves
/// buffers above 32 MiB (a (B*T, V) logits tensor is 100-800 MiB) with a new `mmap` each time, and
/// the kernel zero-fills every page on first touch: measured at about 20% of a tiny-model step in
/// page faults. Serving them from the heap and never trimming it makes steps about 30% faster
/// (BENCHMARKS.md); the price is that RSS stays at its peak, which a training process reaches
/// on its first step anyway. Call once at startup, before threads allocate.
pub fn retain_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning parameters; called before other threads
    // exist, it cannot race with allocations.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

pub struct MemoryPlan {
    pub parameters: usize,
    pub param_bytes: u64,
    pub grad_bytes: u64,
    pub adam_bytes: u64,
    /// fp16/bf16: the compute-dtype copy of the weights forward and backward run on.
    pub compute_copy_bytes: u64,
    pub activation_bytes: u64,
}

/// Activation bytes kept alive for backward by one f32 micro-batch of B x T tokens in our
/// implementation (counted from `gpt2.rs` and `ops.rs`): per block about 30 (B, T, C) tensors
/// (LayerNorm intermediates, q/k/v and their head-major copies, projections, residuals, the
/// 4C-wide MLP tensors counting 4 each) and 5 (B, NH, T, T) attention tensors; plus the LM head's
/// logits with the log-softmax intermediates, 4 (B, T, V) tensors. With checkpointing only each
/// block's input stays alive, plus one block's activations during its recomputation.
pub fn activation_bytes(cfg: &Gpt2Config, b: usize, t: usize, checkpoint: bool) -> u64 {
    let btc = (b * t * cfg.n_embd) as u64;
    let attn = (b * cfg.n_head * t * t) as u64;
    let per_block = 30 * btc + 5 * attn;
    let head = 4 * (b * t * cfg.vocab_size) as u64 + 6 * btc;
    let blocks = if checkpoint { cfg.n_layer as u64 * btc + per_block } else { cfg.n_layer as u64 * per_block };
    4 * (blocks + head)
}

impl MemoryPlan {
    pub fn new(cfg: &Gpt2Config, b: usize, t: usize, checkpoint: bool) -> Self {
        let parameters = parameter_count(cfg);
        let p = 4 * parameters as u64;
        Self {
            parameters,
            param_bytes: p,
            grad_bytes: p,
            adam_bytes: 2 * p,
            compute_copy_bytes: 0,
            activation_bytes: activation_bytes(cfg, b, t, checkpoint),
        }
    }

    /// Counts `total` parameters (LoRA adapters included) but gradients and AdamW moments for the
    /// `trainable` ones only (`--only-optimize-lora`). candle still forms a frozen weight's
    /// gradient inside backward (its matmul rule computes both operands' gradients) but drops it
    /// with the backward's store: no accumulated copy, no moments.
    pub fn with_parameters(mut self, total: usize, trainable: usize) -> Self {
        self.parameters = total;
        self.param_bytes = 4 * total as u64;
        self.grad_bytes = 4 * trainable as u64;
        self.adam_bytes = 8 * trainable as u64;
        self
    }

    /// Computing in a 2-byte dtype adds a copy of the weights at 2 bytes per parameter and
    /// roughly halves the activations (the attention softmax and LayerNorm statistics stay f32,
    /// so this is an estimate). Gradients are accumulated in f32 either way.
    pub fn with_compute_dtype(mut self, dtype: candle_core::DType) -> Self {
        if dtype.size_in_bytes() == 2 {
            self.compute_copy_bytes = 2 * self.parameters as u64;
            self.activation_bytes /= 2;
        }
        self
    }

    pub fn total(&self) -> u64 {
        self.param_bytes + self.grad_bytes + self.adam_bytes + self.compute_copy_bytes + self.activation_bytes
    }

    /// The startup report, one allocation per line.
    pub fn report(&self) -> String {
        let m = |x: u64| x as f64 / MIB;
        format!(
            "parameters: {:.2}M\nallocating {:.1} MiB for parameters (f32)\nallocating {:.1} MiB for gradients\nallocating {:.1} MiB for AdamW m and v\n{}estimated {:.1} MiB for activations per micro-batch\nestimated total {:.1} MiB",
            self.parameters as f64 / 1e6,
            m(self.param_bytes),
            m(self.grad_bytes),
            m(self.adam_bytes),
            if self.compute_copy_bytes > 0 {
                format!("allocating {:.1} MiB for the fp16/bf16 compute copy of the weights\n", m(self.compute_copy_bytes))
            } else {
                String::new()
            },
            m(self.activation_bytes),
            m(self.total())
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_small_counts_and_checkpointing_saves_block_activations() {
        let cfg = Gpt2Config::gpt2();
        let plan = MemoryPlan::new(&cfg, 1, 1024, false);
        assert_eq!(plan.parameters, 124_439_808, "GPT-2 small has 124.4M parameters");
        let full = activation_bytes(&cfg, 4, 1024, false);
        let ckpt = activation_bytes(&cfg, 4, 1024, true);
        assert!(ckpt * 3 < full, "checkpointing keeps one block's activations, not 12: {ckpt} vs {full}");
    }
}
