//! Memory accounting in the open (llm.c's habit): bytes for parameters, gradients and AdamW
//! moments from the one parameter inventory, and an estimate of activation memory for a
//! micro-batch, with and without activation checkpointing. Printed at startup; the measured
//! peak (see `metrics::peak_rss_mib`) is printed at the end so the two can be compared.

use crate::model::gpt2::Gpt2Config;
use crate::model::params::parameter_count;

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
    /// The fused CPU f32 kernels (`fused.rs`, the default on the CPU).
    FusedCpu,
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
    /// LoRA adapters on the blocks' linears (`--lora-dim` above 0).
    pub lora: bool,
    /// Tensor-parallel ranks splitting each layer (1: none).
    pub tp: usize,
}

/// What one micro-batch of B x T tokens allocates beyond the weights, their compute copy, the
/// AdamW moments and the accumulated gradients, at its peak: the activations kept for backward,
/// backward's transients and the gradients it forms before they are added to the accumulated
/// ones. N = B*T tokens, C, L layers, V vocabulary rows (the LM head's terms only with an LM
/// head), P parameters, P_t of them trainable (what stays accumulated), W = V*C the tied
/// embedding's gradient.
///
/// [`Kernels::FusedCpu`], the peak of the phases found by counting every allocation
/// (`tests/memory_plan.rs` checks 36 configurations: within 2%, never under by more than 0.3%):
/// - the LM head's backward: the activations A, about (20L + 6) (N, C) tensors (the fused
///   attention keeps no (B, NH, T, T) tensor; LoRA adapters add about 3 (N, out) each), the
///   (N, V) logits that forward kept and backward turns in place into their gradient, and the
///   op's output, dx (N, C) stacked on dwte (W);
/// - the embedding's backward: A, that output (the head's dwte lives in it), the fresh
///   gradients of the rest of the model (P - W) and candle's copy of the embedding's summed
///   gradient (W), which at that moment meets either the rest or a second W (a score head,
///   with no dwte of its own, meets both);
/// - with accumulation, adding backward's gradients (P) to the accumulated ones while A lives,
///   one new (W) sum at a time: never above the embedding's phase, so not a term.
///
/// The first micro-batch's peak is P_t lower: its gradients become the accumulated ones. With
/// checkpointing only each block's input stays; the head's phase keeps them (about L + 4 (N, C)
/// tensors with its own); the embedding's gradient, formed in a backward of its own, and its
/// sum with the head's meet as two W beside one block's recomputed activations (three W when
/// accumulating). A frozen model (`--only-optimize-lora`) forms no W and no gradient but the
/// adapters'.
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
    let (n, c, l) = (b * t, a.cfg.n_embd as f64, a.cfg.n_layer as f64);
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
            let floats = if a.checkpoint {
                let head = n * v + head_w + (l + 4.0) * nc;
                if a.accumulating {
                    head.max(head_w + 2.0 * w + (l + 17.0 + lora) * nc)
                } else {
                    (head - kept).max(head_w + w + (l + 15.0 + lora) * nc)
                }
            } else {
                let acts = ((20.0 + lora) * l + 6.0) * nc;
                let head = acts + n * v + nc + head_w;
                let rest = formed - w;
                let embedding = acts + nc + w + if a.lm_head { w + rest.max(w) } else { rest + w };
                head.max(embedding) - if a.accumulating { 0.0 } else { kept }
            };
            4.0 * floats
        }
        Kernels::Composed => {
            let attn = b * a.cfg.n_head as f64 * t * t;
            let per_block = 30.0 * n * c + 5.0 * attn;
            let head = 4.0 * n * v + 6.0 * n * c;
            let blocks = if a.checkpoint { l * n * c + per_block } else { l * per_block };
            a.dtype_bytes as f64 * (blocks + head)
        }
    };
    // `as` saturates: beyond u64 is u64::MAX.
    bytes as u64
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
    let (s, b, h) = (a.t as f64, a.b as f64, a.cfg.n_embd as f64);
    let (heads, layers, t) = (a.cfg.n_head as f64, a.cfg.n_layer as f64, a.tp as f64);
    let scale = a.dtype_bytes as f64 / 2.0;
    let layer = s * b * h * (10.0 + 24.0 / t + 5.0 * heads * s / (h * t)) * scale;
    let blocks = if a.checkpoint { layers * 2.0 * s * b * h * scale + layer } else { layers * layer };
    let vocab = crate::tensor_parallel::vocab::padded_vocab_size(a.cfg.vocab_size, a.tp) as f64;
    let head = if a.lm_head { 4.0 * s * b * vocab / t } else { 0.0 };
    let embedding_grad = if a.trainable == a.parameters { 4.0 * vocab / t * h } else { 0.0 };
    blocks + head + 4.0 * a.trainable as f64 + 2.0 * embedding_grad
}

pub struct MemoryPlan {
    pub parameters: usize,
    pub param_bytes: u64,
    pub grad_bytes: u64,
    pub adam_bytes: u64,
    /// fp16/bf16: the compute-dtype copy of the weights forward and backward run on.
    pub compute_copy_bytes: u64,
    pub activations: ActivationShape,
    device_is_cpu: bool,
    /// Data parallelism: (ZeRO stage, ranks); the byte counts above are per rank.
    pub zero: Option<(u8, usize)>,
    /// Tensor parallelism: (ranks per layer, parameters held by each).
    pub tensor_parallel: Option<(usize, usize)>,
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
                lora: false,
                tp: 1,
            },
            device_is_cpu: true,
            zero: None,
            tensor_parallel: None,
        }
    }

    /// Per-rank model states under ZeRO `stage` over `world` ranks (DeepSpeed's accounting:
    /// stage 1 divides the AdamW moments by the world size, stage 2 the gradients too, stage 3
    /// the weights and their compute copy as well, which also recomputes every block in backward,
    /// so the activations are those of checkpointing). Call after the other `with_*` methods.
    pub fn with_data_parallel(mut self, stage: u8, world: usize) -> Self {
        if world <= 1 {
            return self;
        }
        let shard = |bytes: u64| bytes.div_ceil(world as u64);
        if stage >= 1 {
            self.adam_bytes = shard(self.adam_bytes);
        }
        if stage >= 2 {
            self.grad_bytes = shard(self.grad_bytes);
        }
        if stage >= 3 {
            self.param_bytes = shard(self.param_bytes);
            self.compute_copy_bytes = shard(self.compute_copy_bytes);
            self.activations.checkpoint = true;
        }
        self.zero = Some((stage, world));
        self
    }

    /// Tensor parallelism over `ranks` ranks per layer: each holds its slices of the split
    /// parameters (the vocabulary padded to 128 x T rows) and the replicated ones whole, with
    /// their gradients, moments and compute copy; activations by Megatron's formula (see
    /// [`megatron_activation_bytes`]). Call after [`Self::with_parameters`] and
    /// [`Self::with_compute_dtype`], before [`Self::with_data_parallel`].
    pub fn with_tensor_parallel(mut self, ranks: usize) -> Self {
        if ranks <= 1 {
            return self;
        }
        let cfg = &self.activations.cfg;
        let held: usize = crate::model::params::parameter_shapes(cfg)
            .iter()
            .map(|(name, shape)| {
                crate::tensor_parallel::shard::local_shape(name, shape, ranks).iter().product::<usize>()
            })
            .sum();
        // Whatever is not in the GPT-2 inventory (a score head) stays whole.
        let held = held + self.parameters.saturating_sub(parameter_count(cfg));
        let per_param = |bytes: u64| bytes / self.parameters.max(1) as u64 * held as u64;
        (self.param_bytes, self.grad_bytes, self.adam_bytes, self.compute_copy_bytes) = (
            per_param(self.param_bytes),
            per_param(self.grad_bytes),
            per_param(self.adam_bytes),
            per_param(self.compute_copy_bytes),
        );
        self.activations.tp = ranks;
        let frozen = self.activations.parameters - self.activations.trainable;
        (self.activations.parameters, self.activations.trainable) = (held, held.saturating_sub(frozen));
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
        self
    }

    /// Computing in a 2-byte dtype adds a copy of the weights at 2 bytes per parameter and runs
    /// the composed ops. Gradients are accumulated in f32 either way.
    pub fn with_compute_dtype(mut self, dtype: candle_core::DType) -> Self {
        let bytes = dtype.size_in_bytes();
        self.compute_copy_bytes = if bytes == 4 { 0 } else { bytes as u64 * self.parameters as u64 };
        self.activations.dtype_bytes = bytes;
        self.set_kernels();
        self
    }

    /// The device the micro-batches run on: the fused kernels are CPU-only.
    pub fn on_device(mut self, device: &candle_core::Device) -> Self {
        self.device_is_cpu = device.is_cpu();
        self.set_kernels();
        self
    }

    /// A reward model: a score head instead of the LM head (no logits).
    pub fn with_score_head(mut self) -> Self {
        self.activations.lm_head = false;
        self
    }

    fn set_kernels(&mut self) {
        let fused = self.device_is_cpu && self.activations.dtype_bytes == 4 && !crate::kernels::ops::reference_ops();
        self.activations.kernels = if fused { Kernels::FusedCpu } else { Kernels::Composed };
    }

    /// The estimate of [`activation_bytes`] for this plan's micro-batch.
    pub fn activation_bytes(&self) -> u64 {
        activation_bytes(&self.activations)
    }

    pub fn total(&self) -> u64 {
        [self.param_bytes, self.grad_bytes, self.adam_bytes, self.compute_copy_bytes, self.activation_bytes()]
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
            "{per_rank}parameters: {:.2}M\nallocating {:.1} MiB for parameters (f32)\nallocating {:.1} MiB for gradients\nallocating {:.1} MiB for AdamW m and v\n{}estimated {:.1} MiB for activations per micro-batch\nestimated total {:.1} MiB",
            self.parameters as f64 / 1e6,
            m(self.param_bytes),
            m(self.grad_bytes),
            m(self.adam_bytes),
            if self.compute_copy_bytes > 0 {
                format!("allocating {:.1} MiB for the fp16/bf16 compute copy of the weights\n", m(self.compute_copy_bytes))
            } else {
                String::new()
            },
            m(self.activation_bytes()),
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
                lora: false,
                tp: 1,
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
        let half = MemoryPlan::new(&cfg, 2, 64, false).with_compute_dtype(candle_core::DType::BF16);
        assert_eq!(
            (half.activations.kernels, half.compute_copy_bytes),
            (Kernels::Composed, 2 * plan.parameters as u64)
        );
        let scored = MemoryPlan::new(&cfg, 2, 64, false).with_score_head();
        assert!(scored.activation_bytes() < plan.activation_bytes(), "a score head keeps no logits");
        let split = MemoryPlan::new(&cfg, 2, 64, false).with_tensor_parallel(2);
        let (_, held) = split.tensor_parallel.unwrap();
        // tiny: C = 128, 4 layers, 256 positions; the vocabulary 50257 padded to 50432 rows.
        let (c, l) = (128, 4);
        let whole = 256 * c + l * (4 * c + 2 * c) + 2 * c; // wpe, LayerNorms, c_proj biases, ln_f
        let sliced = 50432 * c + l * (c * 3 * c + 3 * c + c * c + c * 4 * c + 4 * c + 4 * c * c);
        assert_eq!(held, whole + sliced / 2);
        assert_eq!(split.param_bytes, 4 * held as u64);
        let four = MemoryPlan::new(&cfg, 2, 64, false).with_tensor_parallel(4);
        assert!(four.activation_bytes() < split.activation_bytes(), "more ranks split more of each layer");
        let accumulating = MemoryPlan::new(&cfg, 2, 64, false).with_gradient_accumulation(2);
        assert_eq!(
            accumulating.activation_bytes() - plan.activation_bytes(),
            4 * plan.parameters as u64,
            "from the second micro-batch on, backward's gradients meet the accumulated ones"
        );
    }
}
