//! Step 3's memory plan (llm.c's habit, as steps 1 and 2 print theirs): per rank, what the four
//! models keep for the whole run and the largest of the phases a PPO step goes through, printed
//! before the first rollout and, on the CPU, refused where it exceeds the machine.
//!
//! Resident: the actor's and the critic's model states (weights, gradients, Adam moments, compute
//! copy; ZeRO's shards: [`MemoryPlan`]), the frozen reference and reward model in the compute
//! dtype (their shards at ZeRO-3; none on a GPU with `--offload-reference-model`, the reference
//! then being in host memory), the EMA in fp32. The phases, one at a time:
//! - generation: the KV cache of every rollout row over prompt and answer (2 L C values a
//!   position), with the actor gathered whole in the compute dtype at ZeRO-3, or its LoRA
//!   adapters fused into a copy;
//! - experience: the actor's and the reference's log-probs of the answers, each a forward whose
//!   (rows x positions, V) logits are kept with their log-softmax (and its contiguous input, and
//!   under `--compute-fp32-loss` their f32 copy), the actor's beside the activations its forward
//!   keeps (its weights are variables, so the graph holds them);
//! - training the actor: its trunk's activations for a PPO micro-batch (as training it with a
//!   score head: [`MemoryPlan`]'s count) and its log-prob head on the answer's positions: the
//!   logits, the log-softmax and its input kept for backward, and backward's gradients of the
//!   three and of the cast beside them;
//! - training the critic: its micro-batch's activations ([`MemoryPlan`] with a score head).
//!
//! Not counted: the rollouts' ids, rewards and advantages (a few numbers a position), saves (a
//! checkpoint reads the optimizers where they are and writes one tensor at a time).

use hybrid_engine::training::memory::MemoryPlan;
use hybrid_engine::Gpt2Config;

const MIB: f64 = 1024.0 * 1024.0;

/// A trained model's shape and parameters: (config, all parameters, trained ones).
pub struct TrainedShape<'a> {
    pub cfg: &'a Gpt2Config,
    pub total: usize,
    pub trainable: usize,
    /// What one rank holds beyond the trunk (LoRA adapters, the critic's head; under tensor
    /// parallelism its slices of them).
    pub held_beside: usize,
    pub lora: bool,
    pub checkpoint: bool,
}

/// What step 3's plan is computed from (per rank).
pub struct Step3Shapes<'a> {
    pub actor: TrainedShape<'a>,
    pub critic: Option<TrainedShape<'a>>,
    /// The reward model's config, where there is one.
    pub reward: Option<&'a Gpt2Config>,
    /// Rollout rows generated at once (prompts x samples a prompt) and a PPO micro-batch's rows.
    pub generation_rows: usize,
    pub training_rows: usize,
    /// Prompt plus answer positions, and the answer's (the actor's log-probs in training).
    pub positions: usize,
    pub answer_positions: usize,
    pub dtype: candle_core::DType,
    pub fp32_loss: bool,
    pub device: &'a candle_core::Device,
    /// The data-parallel ranks and each model's ZeRO stage; the tensor-parallel ranks.
    pub world: usize,
    pub actor_stage: hybrid_engine::training::zero::ZeroStage,
    pub critic_stage: hybrid_engine::training::zero::ZeroStage,
    /// `--reduce-bucket-size` and `--allgather-bucket-size`.
    pub buckets: (usize, usize),
    pub tensor_parallel: usize,
    pub gradient_accumulation: usize,
    pub offload: bool,
    pub offload_reference: bool,
    pub ema: bool,
    /// On the CPU, the process's own live memory: measured once its inputs are read, less the
    /// models' values and the freed memory its heap keeps.
    pub process_bytes: u64,
}

/// Step 3's plan, in bytes per rank.
pub struct Step3Plan {
    pub actor: MemoryPlan,
    pub critic: Option<MemoryPlan>,
    pub reference_bytes: u64,
    pub reward_bytes: u64,
    pub ema_bytes: u64,
    pub generation_bytes: u64,
    pub experience_bytes: u64,
    /// The actor's log-prob head at its training peak (beside its trunk's activations).
    pub actor_head_bytes: u64,
    /// On the CPU, the process itself (binary, tokenizer, data), measured.
    pub process_bytes: u64,
}

impl Step3Plan {
    pub fn new(s: &Step3Shapes) -> Self {
        let zero3 = |stage| stage == hybrid_engine::training::zero::ZeroStage::Parameters && s.world > 1;
        // Each trained model's trunk as MemoryPlan counts it under a score head: the critic's is
        // one, and the actor's log-prob head (a log-softmax of the whole logits, not
        // MemoryPlan's fused cross-entropy) is counted apart.
        let trained = |m: &TrainedShape, stage, rows: usize| {
            MemoryPlan::new(m.cfg, rows, s.positions, m.checkpoint)
                .with_parameters(m.total, m.trainable)
                .with_gradient_accumulation(s.gradient_accumulation)
                .with_lora(m.lora)
                .with_compute_dtype(s.dtype)
                .on_device(s.device)
                .with_score_head()
                .with_tensor_parallel(s.tensor_parallel, m.held_beside)
                .with_data_parallel(stage, s.world)
                .with_buckets(s.buckets.0, s.buckets.1)
                .with_offload(s.offload)
        };
        let actor = trained(&s.actor, s.actor_stage, s.training_rows);
        let critic = s.critic.as_ref().map(|c| trained(c, s.critic_stage, s.training_rows));
        let d = s.dtype.size_in_bytes() as u64;
        let on_gpu = s.device.is_cuda();
        let shard = |bytes: u64, stage| if zero3(stage) { bytes.div_ceil(s.world as u64) } else { bytes };
        let tp = s.tensor_parallel.max(1) as u64;
        let reference_bytes = match s.offload_reference && on_gpu {
            true => 0,
            false => shard(d * s.actor.total as u64 / tp, s.actor_stage),
        };
        let reward_bytes = s.reward.map_or(0, |cfg| {
            shard(
                d * (hybrid_engine::model::params::parameter_count(cfg) + cfg.hidden_size()) as u64 / tp,
                s.critic_stage,
            )
        });
        let ema_bytes = match s.ema {
            true => shard(4 * s.actor.total as u64 / tp, s.actor_stage),
            false => 0,
        };
        let a = s.actor.cfg;
        let (l, c, v) = (a.num_layers() as u64, a.hidden_size() as u64, a.vocab_size as u64);
        // Generation: the cache, the weights generation reads where they are not the resident
        // ones (ZeRO-3's gather, LoRA's fused copy), a step's f32 logits and their pick.
        let cache = 2 * l * (s.generation_rows * s.positions) as u64 * c * d / tp;
        let gathered = if zero3(s.actor_stage) || s.actor.lora { d * s.actor.total as u64 / tp } else { 0 };
        let generation_bytes = cache + gathered + 2 * 4 * s.generation_rows as u64 * v;
        // The log-prob heads: f, the loss's dtype; the cast copy where it differs from d.
        let f = if s.fp32_loss { 4 } else { d };
        let cast = if f != d { f } else { 0 };
        let rows_g = (s.generation_rows * s.positions) as u64;
        // The trained actor's forward keeps what a training forward keeps (its weights are
        // variables: every op's output stays on the graph until the log-probs are read), then
        // the logits' chain.
        let kept = hybrid_engine::training::memory::forward_kept_values(a, rows_g as f64, s.actor.lora);
        let trunk = kept as u64 / tp * d;
        let experience_bytes = trunk + rows_g * v / tp * (d + cast + 2 * f) + actor.gathered_unit_bytes;
        let rows_t = (s.training_rows * s.answer_positions) as u64;
        // Kept: logits, cast, log-softmax; backward: the gradients of the log-softmax, of its
        // input and of the logits (and of the cast), and the embedding's dW^T with its sum.
        let table = v * c / tp;
        let actor_head_bytes = rows_t * v / tp * (d + cast + f) + rows_t * v / tp * (3 * f + d) + 2 * d * table;
        let process_bytes = if on_gpu { 0 } else { s.process_bytes };
        Self {
            actor,
            critic,
            reference_bytes,
            reward_bytes,
            ema_bytes,
            generation_bytes,
            experience_bytes,
            actor_head_bytes,
            process_bytes,
        }
    }

    /// What stays for the whole run: the trained models' states and the frozen models.
    pub fn resident(&self) -> u64 {
        self.actor.model_state_bytes()
            + self.critic.as_ref().map_or(0, MemoryPlan::model_state_bytes)
            + self.reference_bytes
            + self.reward_bytes
            + self.ema_bytes
            + self.process_bytes
    }

    /// Each phase's transient bytes beside [`Self::resident`].
    pub fn phases(&self) -> [(&'static str, u64); 4] {
        let training = |p: &MemoryPlan| p.activation_bytes() + p.gathered_unit_bytes + p.reduction_bytes;
        [
            ("generation", self.generation_bytes),
            ("experience", self.experience_bytes),
            ("training the actor", training(&self.actor) + self.actor_head_bytes),
            ("training the critic", self.critic.as_ref().map_or(0, training)),
        ]
    }

    pub fn total(&self) -> u64 {
        self.resident() + self.phases().iter().map(|(_, b)| *b).max().unwrap_or(0)
    }

    /// Refuses, before the first rollout allocates it, a plan beyond the machine's memory (RAM
    /// and swap) on the CPU, naming the largest phase and what shrinks it.
    pub fn check_fits(&self, device: &candle_core::Device) -> anyhow::Result<()> {
        let (Some(memory), true) = (hybrid_engine::runtime::machine_memory_bytes(), device.is_cpu()) else {
            return Ok(());
        };
        self.fits(memory)
    }

    fn fits(&self, memory: u64) -> anyhow::Result<()> {
        if self.total() > memory {
            let gib = |x: u64| x as f64 / (1024.0 * MIB);
            let (largest, bytes) = self.phases().into_iter().max_by_key(|(_, b)| *b).unwrap_or(("none", 0));
            anyhow::bail!(
                "step 3's memory plan needs an estimated {:.1} GiB ({:.1} GiB of it {largest}), more than this machine's {:.1} GiB of memory (RAM and swap): lower --per-device-generation-batch-size, --per-device-training-batch-size or the prompt and answer lengths, or use ZeRO stage 3 over more ranks",
                gib(self.total()),
                gib(bytes),
                gib(memory)
            );
        }
        Ok(())
    }

    /// The startup report.
    pub fn report(&self) -> String {
        let m = |x: u64| x as f64 / MIB;
        let phases = self.phases();
        let (largest, _) = phases.iter().max_by_key(|(_, b)| *b).copied().unwrap_or(("none", 0));
        let mut out = format!(
            "step 3 memory plan per rank (MiB): actor {:.0} (model states), critic {:.0}, reference {:.0}, reward model {:.0}, EMA {:.0}",
            m(self.actor.model_state_bytes()),
            m(self.critic.as_ref().map_or(0, MemoryPlan::model_state_bytes)),
            m(self.reference_bytes),
            m(self.reward_bytes),
            m(self.ema_bytes),
        );
        if self.process_bytes > 0 {
            out += &format!(", the process itself {:.0}", m(self.process_bytes));
        }
        out += "; phases:";
        for (name, bytes) in phases {
            out += &format!(" {name} {:.0},", m(bytes));
        }
        out.pop();
        out += &format!("; estimated peak {:.0} MiB ({largest})", m(self.total()));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};
    use hybrid_engine::training::zero::{ZeroStage, DEFAULT_BUCKET};

    fn shapes<'a>(cfg: &'a Gpt2Config, device: &'a Device, world: usize, stage: ZeroStage) -> Step3Shapes<'a> {
        let p = hybrid_engine::model::params::parameter_count(cfg);
        let trained = |total| TrainedShape {
            cfg,
            total,
            trainable: total,
            held_beside: total - p,
            lora: false,
            checkpoint: false,
        };
        Step3Shapes {
            actor: trained(p),
            critic: Some(trained(p + cfg.hidden_size())),
            reward: Some(cfg),
            generation_rows: 4,
            training_rows: 2,
            positions: 40,
            answer_positions: 16,
            dtype: DType::F32,
            fp32_loss: false,
            device,
            world,
            actor_stage: stage,
            critic_stage: stage,
            buckets: (DEFAULT_BUCKET, DEFAULT_BUCKET),
            tensor_parallel: 1,
            gradient_accumulation: 1,
            offload: false,
            offload_reference: false,
            ema: false,
            process_bytes: 1000,
        }
    }

    /// The phases by hand for the tiny GPT-2 (4 layers, C 128, V 50257) in fp32 on one rank:
    /// 4 rollout rows of 40 positions, PPO micro-batches of 2 rows with 16 answer positions.
    #[test]
    fn the_phases_are_the_formulas_by_hand() {
        let (cfg, cpu) = (Gpt2Config::tiny(), Device::Cpu);
        let plan = Step3Plan::new(&shapes(&cfg, &cpu, 1, ZeroStage::Disabled));
        let (l, c, v) = (4u64, 128u64, cfg.vocab_size as u64);
        let p = hybrid_engine::model::params::parameter_count(&cfg) as u64;
        assert_eq!(plan.generation_bytes, 2 * l * 160 * c * 4 + 8 * 4 * v, "cache and two f32 logit rows a row");
        assert_eq!(plan.experience_bytes, (20 * l + 6) * 160 * c * 4 + 160 * v * 12, "kept activations, logits' chain");
        assert_eq!(plan.actor_head_bytes, 32 * v * 8 + 32 * v * 16 + 8 * v * c, "kept, backward's, dW^T and its sum");
        assert_eq!((plan.reference_bytes, plan.reward_bytes, plan.ema_bytes), (4 * p, 4 * (p + c), 0));
        assert_eq!(plan.actor.model_state_bytes(), 16 * p, "fp32 weights, gradients, two moments");
        let resident = 16 * p + 16 * (p + c) + 4 * p + 4 * (p + c) + 1000;
        assert_eq!(plan.resident(), resident);
        let largest = plan.phases().iter().map(|(_, b)| *b).max().unwrap();
        assert_eq!(plan.total(), resident + largest);
        assert!(plan.report().contains("estimated peak"), "{}", plan.report());
    }

    /// At ZeRO-3 over 4 ranks the frozen models and the states are shards, generation gathers
    /// the actor whole; on a GPU `--offload-reference-model` keeps the reference in host memory
    /// (not in the GPU's plan), and the process is counted on the CPU only.
    #[test]
    fn shards_offload_and_the_process_are_planned_where_they_live() {
        let (cfg, cpu) = (Gpt2Config::tiny(), Device::Cpu);
        let p = hybrid_engine::model::params::parameter_count(&cfg) as u64;
        let whole = Step3Plan::new(&shapes(&cfg, &cpu, 1, ZeroStage::Disabled));
        let zero3 = Step3Plan::new(&shapes(&cfg, &cpu, 4, ZeroStage::Parameters));
        assert_eq!(zero3.reference_bytes, (4 * p).div_ceil(4));
        assert_eq!(zero3.generation_bytes, whole.generation_bytes + 4 * p, "the actor gathered for generation");
        assert!(zero3.actor.model_state_bytes() * 3 < whole.actor.model_state_bytes());
        let mut offloaded = shapes(&cfg, &cpu, 1, ZeroStage::Disabled);
        offloaded.offload_reference = true;
        assert_eq!(Step3Plan::new(&offloaded).reference_bytes, 4 * p, "on the CPU the reference is in this memory");
        if let Ok(gpu) = Device::new_cuda(0) {
            let mut on_gpu = shapes(&cfg, &gpu, 1, ZeroStage::Disabled);
            on_gpu.offload_reference = true;
            let plan = Step3Plan::new(&on_gpu);
            assert_eq!((plan.reference_bytes, plan.process_bytes), (0, 0));
        }
    }

    /// A plan beyond the machine is one line naming its largest phase and what shrinks it.
    #[test]
    fn a_plan_beyond_the_machine_is_refused_naming_its_largest_phase() {
        let (cfg, cpu) = (Gpt2Config::tiny(), Device::Cpu);
        let plan = Step3Plan::new(&shapes(&cfg, &cpu, 1, ZeroStage::Disabled));
        assert!(plan.fits(plan.total()).is_ok());
        let err = plan.fits(plan.total() - 1).unwrap_err().to_string();
        let (largest, _) = plan.phases().into_iter().max_by_key(|(_, b)| *b).unwrap();
        assert!(err.contains(largest) && err.contains("lower --per-device-generation-batch-size"), "{err}");
    }
}
