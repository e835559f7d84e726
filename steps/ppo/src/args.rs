//! Flags of `ppo` (step 3): DS-Chat's `step3_rlhf_finetuning/main.py` names in kebab-case
//! (snake_case accepted), the PPO constants DS-Chat hard-codes (as flags with its values), and
//! sampling for rollouts (DS-Chat generates greedily; `--do-sample` samples).

use crate::ppo::{Algorithm, LossType, PpoConfig, RewardScaling};
use anyhow::{bail, Result};
use clap::Parser;
use data::args::DataArgs;
use hybrid_engine::cli;
use hybrid_engine::cli::dist_args::DistArgs;
use hybrid_engine::cli::heading;
use hybrid_engine::cli::precision_args::PrecisionArgs;
use hybrid_engine::cli::step_args::{lora_flag_set, DEFAULT_LORA_LEARNING_RATE, DEFAULT_LORA_MODULES};
use hybrid_engine::comm::ProcessGroup;
use hybrid_engine::engine::EngineConfig;
use hybrid_engine::training::optim::AdamWConfig;
use hybrid_engine::training::precision::Dtype;
use hybrid_engine::training::schedule::HfScheduler;
use hybrid_engine::training::zero::ZeroStage;
use std::path::PathBuf;

#[derive(Parser, Debug, Clone)]
#[command(
    args_override_self = true,
    name = "ppo",
    about = "Step 3: PPO of the step-1 actor against the step-2 reward model (DS-Chat step 3)"
)]
pub struct PpoArgs {
    #[command(flatten, next_help_heading = heading::DATA)]
    pub data: DataArgs,
    /// The step-1 actor (also the frozen reference): HF directory or hub id.
    #[arg(help_heading = heading::MODEL, long, default_value = "output/actor", alias = "actor_model_name_or_path")]
    pub actor_model_name_or_path: String,
    /// The step-2 reward model (also the critic's start): HF directory or hub id.
    #[arg(help_heading = heading::MODEL, long, default_value = "output/reward", alias = "critic_model_name_or_path")]
    pub critic_model_name_or_path: String,
    /// Prompts each rank generates per rollout (a rollout is this times the number of ranks).
    /// Earlier DS-Chat called it `--per_device_train_batch_size`.
    #[arg(help_heading = heading::TRAINING, long, default_value_t = 16, aliases = ["per_device_generation_batch_size", "per_device_train_batch_size", "per-device-train-batch-size"])]
    pub per_device_generation_batch_size: usize,
    /// Rows per PPO micro-batch on each rank (a rollout is sliced into global micro-batches of
    /// this times the number of ranks). Earlier DS-Chat: `--per_device_mini_train_batch_size`.
    #[arg(help_heading = heading::TRAINING, long, default_value_t = 16, aliases = ["per_device_training_batch_size", "per_device_mini_train_batch_size", "per-device-mini-train-batch-size"])]
    pub per_device_training_batch_size: usize,
    /// Rollouts collected before the PPO epochs over them (earlier DS-Chat:
    /// `--generation_batch_numbers`).
    #[arg(help_heading = heading::TRAINING, long, default_value_t = 1, aliases = ["generation_batches", "generation_batch_numbers", "generation-batch-numbers"])]
    pub generation_batches: usize,
    /// DS-Chat's `--num_padding_at_beginning`. Its step 3 reads each score after the prompt (the
    /// reward model's `forward_value`), where leading padding cannot be, so it has no effect
    /// there, in DS-Chat as here; accepted for its scripts (step 2 reads it).
    #[arg(help_heading = heading::DATA, long, default_value_t = 0, alias = "num_padding_at_beginning")]
    pub num_padding_at_beginning: usize,
    /// DS-Chat's `--enable_test_mode`: stop after `--test-stop-step` rollouts, then save as at
    /// the end of a run.
    #[arg(help_heading = heading::TRAINING, long, alias = "enable_test_mode", requires = "test_stop_step")]
    pub enable_test_mode: bool,
    /// The rollouts a `--enable-test-mode` run makes.
    #[arg(help_heading = heading::TRAINING, long, alias = "test_stop_step", requires = "enable_test_mode", value_parser = clap::value_parser!(u64).range(1..))]
    pub test_stop_step: Option<u64>,
    /// DS-Chat's `--print_answers`: print decoded rollouts every `--print-answers-interval`
    /// steps (default 1 with it, as DS-Chat; without it, every 10).
    #[arg(help_heading = heading::EVALUATION, long, alias = "print_answers")]
    pub print_answers: bool,
    /// DS-Chat's `--offload_reference_model`: on a GPU the frozen reference (at ZeRO stage 3,
    /// its shard) stays in host memory between rollouts, brought to the GPU for each rollout's
    /// log-probs (on the CPU it is there already: the run says so).
    #[arg(help_heading = heading::PARALLELISM, long, alias = "offload_reference_model")]
    pub offload_reference_model: bool,
    /// The actor's dropout off (earlier DS-Chat's `--disable_actor_dropout`): `--actor-dropout 0`.
    #[arg(help_heading = heading::MODEL, long, alias = "disable_actor_dropout", conflicts_with = "actor_dropout")]
    pub disable_actor_dropout: bool,
    /// The critic's dropout off (earlier DS-Chat's `--disable_critic_dropout`).
    #[arg(help_heading = heading::MODEL, long, alias = "disable_critic_dropout", conflicts_with = "critic_dropout")]
    pub disable_critic_dropout: bool,
    /// The configuration of the hub dataset --unsupervised-dataset-name names (DS-Chat's
    /// `load_dataset(name, config)`, e.g. `wikitext` with `wikitext-2-raw-v1`): PTX reads that
    /// configuration's train split.
    #[arg(help_heading = heading::DATA, long, alias = "unsupervised_dataset_config_name", requires = "unsupervised_dataset_name")]
    pub unsupervised_dataset_config_name: Option<String>,
    /// Passes over the collected rollouts.
    #[arg(help_heading = heading::TRAINING, long, default_value_t = 1, alias = "ppo_epochs")]
    pub ppo_epochs: usize,
    /// Prompts are left-padded to exactly this many tokens; longer ones are dropped.
    #[arg(help_heading = heading::GENERATION, long, default_value_t = 256, alias = "max_prompt_seq_len")]
    pub max_prompt_seq_len: usize,
    /// Tokens an answer may have: generation stops there or at EOS.
    #[arg(help_heading = heading::GENERATION, long, default_value_t = 256, alias = "max_answer_seq_len")]
    pub max_answer_seq_len: usize,
    /// The actor's peak learning rate (DS-Chat's 9.65e-6).
    #[arg(help_heading = heading::OPTIMIZER, long, default_value_t = 9.65e-6, alias = "actor_learning_rate", value_parser = cli::positive())]
    pub actor_learning_rate: f64,
    /// The critic's peak learning rate (DS-Chat's 5e-6).
    #[arg(help_heading = heading::OPTIMIZER, long, default_value_t = 5e-6, alias = "critic_learning_rate", value_parser = cli::positive())]
    pub critic_learning_rate: f64,
    /// The actor's AdamW weight decay (biases and LayerNorms never decay).
    #[arg(help_heading = heading::OPTIMIZER, long, default_value_t = 0.0, alias = "actor_weight_decay", value_parser = cli::non_negative())]
    pub actor_weight_decay: f64,
    /// The critic's AdamW weight decay (biases and LayerNorms never decay).
    #[arg(help_heading = heading::OPTIMIZER, long, default_value_t = 0.0, alias = "critic_weight_decay", value_parser = cli::non_negative())]
    pub critic_weight_decay: f64,
    /// Passes over the prompts.
    #[arg(help_heading = heading::TRAINING, long, default_value_t = 1, alias = "num_train_epochs")]
    pub num_train_epochs: usize,
    /// HF's scheduler types, as sft's --lr-scheduler-type.
    #[arg(help_heading = heading::OPTIMIZER, long, default_value = "cosine", alias = "lr_scheduler_type")]
    pub lr_scheduler_type: HfScheduler,
    /// PPO micro-batches whose gradients are summed before each optimizer step of the actor
    /// and the critic.
    #[arg(help_heading = heading::TRAINING, long, default_value_t = 1, alias = "gradient_accumulation_steps")]
    pub gradient_accumulation_steps: usize,
    /// Optimizer steps of linear warm-up from 0 to the learning rates.
    #[arg(help_heading = heading::OPTIMIZER, long, default_value_t = 100, alias = "num_warmup_steps")]
    pub num_warmup_steps: u64,
    /// Seed of the prompt order, the initialisation of new heads and adapters, dropout and
    /// sampling (DS-Chat's 1234).
    #[arg(help_heading = heading::TRAINING, long, default_value_t = 1234)]
    pub seed: u64,
    /// Actor dropout (default: its config's).
    #[arg(help_heading = heading::MODEL, long, alias = "actor_dropout", value_parser = cli::dropout())]
    pub actor_dropout: Option<f64>,
    /// Critic dropout (default: its config's).
    #[arg(help_heading = heading::MODEL, long, alias = "critic_dropout", value_parser = cli::dropout())]
    pub critic_dropout: Option<f64>,
    /// Recompute each of the actor's blocks in the backward instead of keeping its
    /// activations (less memory, about a third more compute).
    #[arg(help_heading = heading::MODEL, long, alias = "actor_gradient_checkpointing")]
    pub actor_gradient_checkpointing: bool,
    /// Recompute each of the critic's blocks in the backward instead of keeping its
    /// activations.
    #[arg(help_heading = heading::MODEL, long, alias = "critic_gradient_checkpointing")]
    pub critic_gradient_checkpointing: bool,
    /// LoRA rank on the actor's linears --actor-lora-module-name selects (0: none). Fresh
    /// adapters (B = 0) are added to the step-1 actor; saved models have them merged.
    #[arg(help_heading = heading::LORA, long, default_value_t = 0, alias = "actor_lora_dim")]
    pub actor_lora_dim: usize,
    /// The actor's linears that get adapters: those whose name contains this (`h.`: every
    /// block's).
    #[arg(help_heading = heading::LORA, long, default_value = DEFAULT_LORA_MODULES, alias = "actor_lora_module_name", requires = "actor_lora_dim")]
    pub actor_lora_module_name: String,
    /// LoRA rank on the critic (0: none).
    #[arg(help_heading = heading::LORA, long, default_value_t = 0, alias = "critic_lora_dim")]
    pub critic_lora_dim: usize,
    /// The critic's linears that get adapters, as --actor-lora-module-name.
    #[arg(help_heading = heading::LORA, long, default_value = DEFAULT_LORA_MODULES, alias = "critic_lora_module_name", requires = "critic_lora_dim")]
    pub critic_lora_module_name: String,
    /// Train only the LoRA adapters (and the critic's score head).
    #[arg(help_heading = heading::LORA, long, alias = "only_optimize_lora")]
    pub only_optimize_lora: bool,
    /// The learning rate of the actor's LoRA adapters (DS-Chat's 5e-4).
    #[arg(help_heading = heading::LORA, long, default_value_t = DEFAULT_LORA_LEARNING_RATE, alias = "actor_lora_learning_rate", value_parser = cli::positive(), requires = "actor_lora_dim")]
    pub actor_lora_learning_rate: f64,
    /// The learning rate of the critic's LoRA adapters (DS-Chat's 5e-4).
    #[arg(help_heading = heading::LORA, long, default_value_t = DEFAULT_LORA_LEARNING_RATE, alias = "critic_lora_learning_rate", value_parser = cli::positive(), requires = "critic_lora_dim")]
    pub critic_lora_learning_rate: f64,
    /// Keep an exponential moving average of the actor (saved as actor_ema).
    #[arg(help_heading = heading::TRAINING, long, alias = "enable_ema")]
    pub enable_ema: bool,
    /// Pretraining text mixed into the actor's loss (PTX): a .jsonl/.txt/.parquet corpus,
    /// `shakespeare`, or a hub dataset (`org/name`, or any name with
    /// --unsupervised-dataset-config-name) whose train split's `text` column is read.
    #[arg(help_heading = heading::DATA, long, alias = "unsupervised_dataset_name")]
    pub unsupervised_dataset_name: Option<String>,
    /// Weight of the PTX loss (DS-Chat: 27.8, reported unstable); needs
    /// --unsupervised-dataset-name.
    #[arg(help_heading = heading::DATA, long, default_value_t = 27.8, alias = "unsup_coef", value_parser = cli::non_negative(), requires = "unsupervised_dataset_name")]
    pub unsup_coef: f64,
    /// DS-Chat's `--enable_hybrid_engine`: accepted for its scripts; rollouts are always
    /// generated in the hybrid engine's inference mode (compute-dtype weights, a KV cache kept
    /// across rollouts, the actor gathered once under ZeRO-3).
    #[arg(help_heading = heading::GENERATION, long, alias = "enable_hybrid_engine")]
    pub enable_hybrid_engine: bool,
    /// Sample rollouts (temperature, top-k, top-p) instead of DS-Chat's greedy decoding; the
    /// three sampling flags need it.
    #[arg(help_heading = heading::GENERATION, long, alias = "do_sample")]
    pub do_sample: bool,
    /// Sampling temperature T: rollouts sample from softmax(logits / T), and the old, new and
    /// reference log-probs are of that distribution (TRL's and OpenRLHF's convention).
    #[arg(help_heading = heading::GENERATION, long, default_value_t = 1.0, value_parser = cli::positive(), requires = "do_sample")]
    pub temperature: f64,
    /// Sampling: only the k likeliest tokens are drawn from (0: every token).
    #[arg(help_heading = heading::GENERATION, long, default_value_t = 0, alias = "top_k", requires = "do_sample")]
    pub top_k: usize,
    /// Sampling: only the fewest likeliest tokens whose probability reaches p are drawn from
    /// (1: every token).
    #[arg(help_heading = heading::GENERATION, long, default_value_t = 1.0, alias = "top_p", value_parser = cli::top_p(), requires = "do_sample")]
    pub top_p: f64,
    /// How a rollout's answers become advantages: `ppo` (DS-Chat: a critic, GAE, the KL to the
    /// reference as a per-token reward penalty), `grpo` (no critic: each answer's score
    /// normalised within its prompt's group; the KL a k3 loss term), `rloo` (no critic: each
    /// answer's KL-penalised reward less the mean of its group's others) or `reinforce_pp`
    /// (OpenRLHF's REINFORCE++: no critic, PPO's token-level rewards, each token's discounted
    /// return normalised over the rollout).
    #[arg(help_heading = heading::ALGORITHM, long, value_enum, default_value_t = Algorithm::Ppo)]
    pub algorithm: Algorithm,
    /// Answers sampled per prompt in a rollout (GRPO and RLOO compare them; at least 2 there).
    /// A rollout is --per-device-generation-batch-size prompts per rank times this.
    #[arg(help_heading = heading::ALGORITHM, long, default_value_t = 1, alias = "num_samples_per_prompt")]
    pub num_samples_per_prompt: usize,
    /// What GRPO divides each answer's score less its group's mean by (TRL's `scale_rewards`):
    /// `group` (the group's standard deviation, DeepSeekMath), `batch` (the standard deviation
    /// of the whole rollout's scores) or `none` (Dr. GRPO: advantages in reward units).
    #[arg(help_heading = heading::ALGORITHM, long, value_enum, default_value_t = RewardScaling::Group, alias = "scale_rewards")]
    pub scale_rewards: RewardScaling,
    /// How the policy loss (and GRPO's KL term) averages over a micro-batch's answer tokens
    /// (TRL's `loss_type`), for every algorithm: `bnpo` (token-level: each token weighs the
    /// same, over all ranks), `grpo` (DeepSeekMath: each answer's mean over its tokens, then the
    /// mean over answers), `dr_grpo` (Dr. GRPO: the token sum over answers x
    /// --max-answer-seq-len).
    #[arg(help_heading = heading::ALGORITHM, long, value_enum, default_value_t = LossType::Bnpo, alias = "loss_type")]
    pub loss_type: LossType,
    /// Centre and scale each rollout's advantages over its answer tokens, every rank's together
    /// (TRL's and OpenRLHF's default for PPO; DS-Chat does not): (A - mean) / std. REINFORCE++
    /// always does (refused with it).
    #[arg(help_heading = heading::ALGORITHM, long, alias = "whiten_advantages")]
    pub whiten_advantages: bool,
    /// A reward from outside the reward model, added to its score (repeat for several, summed):
    /// `exec:COMMAND` (a process started once per rank that reads one JSON line
    /// {"prompt": ..., "answer": ...} per answer and writes one JSON number per line, in order),
    /// `http://URL` or `https://URL` (OpenRLHF's remote reward protocol: POST {"query": [prompt +
    /// answer, ...], "prompts": [...]}, answered by {"rewards": [...]}), or `builtin:capitals` /
    /// `builtin:arithmetic` (the embedded tasks' exact-match scorers: 1 for a right answer, else 0).
    #[arg(help_heading = heading::REWARDS, long = "reward-fn", alias = "reward_fn", value_name = "SPEC")]
    pub reward_fn: Vec<crate::reward_fn::RewardFnSpec>,
    /// Seconds an `exec:` or `http` --reward-fn may take to score one rollout's answers
    /// (OpenRLHF's 180).
    #[arg(help_heading = heading::REWARDS, long, default_value_t = 180.0, alias = "reward_fn_timeout", value_parser = cli::positive())]
    pub reward_fn_timeout: f64,
    /// Tries of a rollout's scoring before its error ends the run (each within
    /// --reward-fn-timeout; an `exec:` command restarted before each next try, 1 s then twice the
    /// last pause apart). Default: 5 for `http` (OpenRLHF's), 3 for `exec:`.
    #[arg(help_heading = heading::REWARDS, long, alias = "reward_fn_tries", value_parser = clap::value_parser!(u32).range(1..))]
    pub reward_fn_tries: Option<u32>,
    /// Score with the --reward-fn alone: no reward model is read (PPO's critic still starts from
    /// --critic-model-name-or-path; GRPO, RLOO and REINFORCE++ then read nothing there and
    /// refuse the flag).
    #[arg(help_heading = heading::REWARDS, long, alias = "no_reward_model")]
    pub no_reward_model: bool,
    /// Leave the action that emits EOS out of the losses and KL terms, as DS-Chat's mask
    /// `seq[t + 1] != pad` does with GPT-2 (pad = EOS), for parity with its runs. By default it
    /// is an action like the others (TRL, OpenRLHF), so the policy learns when to stop.
    #[arg(help_heading = heading::ALGORITHM, long, alias = "mask_eos_action")]
    pub mask_eos_action: bool,
    /// The weight of the KL to the reference: PPO's and RLOO's reward penalty per token,
    /// GRPO's loss term (its beta).
    #[arg(help_heading = heading::ALGORITHM, long, default_value_t = 0.1, alias = "kl_ctl", value_parser = cli::non_negative())]
    pub kl_ctl: f64,
    /// Adapt the KL coefficient (starting at --kl-ctl) after every rollout so that the KL to the
    /// reference, summed over an answer's tokens, stays near this many nats (Ziegler et al.;
    /// OpenRLHF's --kl_target, TRL's adaptive controller).
    #[arg(help_heading = heading::ALGORITHM, long, alias = "kl_target", value_parser = cli::positive())]
    pub kl_target: Option<f64>,
    /// The adaptive controller's horizon in answers: a rollout of n answers moves the
    /// coefficient by at most 20% of n / horizon.
    #[arg(help_heading = heading::ALGORITHM, long, default_value_t = 10000.0, alias = "kl_horizon", value_parser = cli::positive(), requires = "kl_target")]
    pub kl_horizon: f64,
    /// Stop a training phase's PPO epochs early once an optimizer step's approximate KL between
    /// the rollout policy and the updated one exceeds this (OpenRLHF/TRL's target_kl).
    #[arg(help_heading = heading::ALGORITHM, long, alias = "target_kl", value_parser = cli::positive())]
    pub target_kl: Option<f64>,
    /// The score is clipped to +-this before it becomes the reward (DS-Chat's 5).
    #[arg(help_heading = heading::REWARDS, long, default_value_t = 5.0, alias = "clip_reward_value", value_parser = cli::positive())]
    pub clip_reward_value: f64,
    /// Normalise the reward model's scores by their running mean and standard deviation over
    /// the rollouts so far (OpenRLHF's --normalize_reward) before the rewards are formed (and
    /// clipped at --clip-reward-value).
    #[arg(help_heading = heading::REWARDS, long, alias = "normalize_reward")]
    pub normalize_reward: bool,
    /// PPO's policy-ratio clip: the ratio is kept within [1 - this, 1 + this] (DS-Chat's 0.2).
    #[arg(help_heading = heading::ALGORITHM, long, default_value_t = 0.2, value_parser = cli::positive())]
    pub cliprange: f64,
    /// DAPO's clip-higher (TRL's epsilon_high, verl's clip_ratio_high): the ratio's upper clip
    /// becomes 1 + this instead of 1 + --cliprange (DAPO: 0.28 with --cliprange 0.2).
    #[arg(help_heading = heading::ALGORITHM, long, alias = "cliprange_high", value_parser = cli::positive())]
    pub cliprange_high: Option<f64>,
    /// The critic's new values are kept within +-this of the rollout's (DS-Chat's 0.2).
    #[arg(help_heading = heading::ALGORITHM, long, default_value_t = 0.2, alias = "cliprange_value", value_parser = cli::positive())]
    pub cliprange_value: f64,
    /// The discount per token of GAE's (and REINFORCE++'s) returns (DS-Chat's 1).
    #[arg(help_heading = heading::ALGORITHM, long, default_value_t = 1.0, value_parser = cli::unit_interval())]
    pub gamma: f64,
    /// GAE's lambda: 1 gives the Monte Carlo returns, 0 the one-step TD error (DS-Chat's
    /// 0.95).
    #[arg(help_heading = heading::ALGORITHM, long, default_value_t = 0.95, value_parser = cli::unit_interval())]
    pub lam: f64,
    /// Held-out prompts on which the starting (SFT) actor and the PPO actor are compared at the
    /// end, by greedy answers' reward-model score and, on an embedded task's prompts, the task
    /// score: `demo`, `arithmetic` or `arithmetic-phrasings` (their held-out prompts), a jsonl with a `prompt` field or a
    /// text file with one prompt per line.
    #[arg(help_heading = heading::EVALUATION, long, alias = "eval_prompts")]
    pub eval_prompts: Option<String>,
    /// Free the generation KV cache after every rollout instead of keeping it for the next.
    #[arg(help_heading = heading::GENERATION, long, alias = "release_inference_cache")]
    pub release_inference_cache: bool,
    /// DS-Chat's hybrid engine inference tensor parallelism: for each rollout the actor is laid
    /// out over groups of this many consecutive ranks (of a node), each group generating the
    /// rows of all its ranks together with the weights split by heads, then handing each rank
    /// its own rows; training keeps its own layout.
    #[arg(help_heading = heading::PARALLELISM, long, default_value_t = 1, alias = "inference_tp_size", env = hybrid_engine::cli::dist_args::INFERENCE_TP_SIZE_ENV, value_parser = clap::value_parser!(u64).range(1..))]
    pub inference_tp_size: u64,
    /// Print decoded rollouts every this many steps (0: never; default 10, or 1 with
    /// `--print-answers`).
    #[arg(help_heading = heading::EVALUATION, long, alias = "print_answers_interval")]
    pub print_answers_interval: Option<u64>,
    /// The actor's ZeRO stage across ranks (0-3; 3 shards the weights at rest).
    #[arg(help_heading = heading::PARALLELISM, long, default_value_t = 0, alias = "actor_zero_stage")]
    pub actor_zero_stage: u8,
    /// The critic's ZeRO stage across ranks (0-3; 3 shards the weights at rest).
    #[arg(help_heading = heading::PARALLELISM, long, default_value_t = 0, alias = "critic_zero_stage")]
    pub critic_zero_stage: u8,
    #[command(flatten)]
    pub dist: DistArgs,
    #[command(flatten)]
    pub log: hybrid_engine::cli::log_args::LogArgs,
    /// AdamW's epsilon for both models (DeepSpeed's default 1e-8).
    #[arg(help_heading = heading::OPTIMIZER, long, default_value_t = 1e-8, alias = "adam_eps", value_parser = cli::positive())]
    pub adam_eps: f64,
    /// Global gradient-norm clip of each model (DS-Chat 1.0; 0: none).
    #[arg(help_heading = heading::OPTIMIZER, long, default_value_t = 1.0, alias = "gradient_clipping", value_parser = cli::non_negative())]
    pub gradient_clipping: f64,
    /// Save a resumable checkpoint every this many rollouts (0: none), under --save.
    #[arg(help_heading = heading::OUTPUT, long, default_value_t = 0, alias = "save_interval")]
    pub save_interval: u64,
    /// Checkpoint root (default: <output-dir>/checkpoints; refused when no checkpoint is saved).
    #[arg(help_heading = heading::OUTPUT, long)]
    pub save: Option<PathBuf>,
    /// Skip the resumable checkpoint a run otherwise ends with (about 9x the actor's size: four
    /// models, the AdamW moments); the trained actor and critic are saved either way.
    #[arg(help_heading = heading::OUTPUT, long, alias = "no_final_checkpoint")]
    pub no_final_checkpoint: bool,
    /// Resume from the checkpoint root's `latest` checkpoint (same flags as the saved run).
    #[arg(help_heading = heading::OUTPUT, long)]
    pub load: Option<PathBuf>,
    /// Where step3's actor, critic and actor_ema directories and metrics.jsonl go.
    #[arg(help_heading = heading::OUTPUT, long, default_value = "output/step3", alias = "output_dir")]
    pub output_dir: PathBuf,
    /// auto (CUDA device 0 when built with --features cuda and a GPU opens, else the CPU), cpu,
    /// cuda or cuda:N.
    #[arg(help_heading = heading::PRECISION, long, default_value = "auto", env = hybrid_engine::device::DEVICE_ENV)]
    pub device: String,
    #[command(flatten)]
    pub precision: PrecisionArgs,
    /// fp16: skip both the actor's and the critic's update when either overflowed (DS-Chat
    /// `--align_overflow`), so the two models stay on the same experience.
    #[arg(help_heading = heading::PRECISION, long, alias = "align_overflow")]
    pub align_overflow: bool,
}

impl PpoArgs {
    /// The flags that shape training, recorded in checkpoints: a resume must match them. The
    /// batch sizes are the global ones (per device times `world`), so a run can resume at
    /// another world size with per-device sizes that keep them.
    pub fn run_fingerprint(&self, world: usize) -> serde_json::Value {
        let mut fingerprint = serde_json::json!({
            "data_path": self.data.data_path, "data_split": self.data.data_split, "seed": self.seed,
            "actor": self.actor_model_name_or_path, "critic": self.critic_model_name_or_path,
            "batch": [self.per_device_generation_batch_size * world, self.per_device_training_batch_size * world, self.generation_batches, self.ppo_epochs, self.gradient_accumulation_steps, self.num_samples_per_prompt],
            "lengths": [self.max_prompt_seq_len, self.max_answer_seq_len],
            "lr": [self.actor_learning_rate, self.critic_learning_rate, self.actor_weight_decay, self.critic_weight_decay],
            "schedule": [format!("{:?}", self.lr_scheduler_type), self.num_warmup_steps.to_string(), self.num_train_epochs.to_string()],
            "ppo": self.ppo_config(),
            "sampling": [self.do_sample.to_string(), self.temperature.to_string(), self.top_k.to_string(), self.top_p.to_string()],
            "lora": [self.actor_lora_dim.to_string(), self.actor_lora_module_name.clone(), self.critic_lora_dim.to_string(), self.critic_lora_module_name.clone(), self.only_optimize_lora.to_string(), self.actor_lora_learning_rate.to_string(), self.critic_lora_learning_rate.to_string()],
            "precision": [self.precision.dtype.name().to_string(), self.precision.compute_fp32_loss.to_string(), self.precision.loss_scaling().window.to_string(), self.precision.loss_scaling().initial_scale_power.to_string(), self.align_overflow.to_string()],
            "optimizer": [self.adam_eps, self.gradient_clipping],
            "ema": self.enable_ema, "ptx": [self.unsupervised_dataset_name.clone().unwrap_or_default(), self.unsup_coef.to_string()],
            "kl": [format!("{:?}", self.kl_target), self.kl_horizon.to_string(), format!("{:?}", self.target_kl)],
            "normalize_reward": self.normalize_reward,
        });
        // Only when given, so that the checkpoints of earlier versions resume with the same flags.
        if !self.reward_fn.is_empty() || self.no_reward_model {
            let specs: Vec<String> = self.reward_fn.iter().map(|s| s.to_string()).collect();
            fingerprint["reward_fn"] = serde_json::json!({"specs": specs, "reward_model": !self.no_reward_model});
        }
        fingerprint
    }

    /// How the actor (`critic` false) or the critic trains over `steps` optimizer steps on the
    /// data-parallel `group` (at its ZeRO stage, said in a line naming it).
    pub fn engine_config(&self, critic: bool, steps: u64, group: &ProcessGroup) -> Result<EngineConfig> {
        let (lr, lora_lr, weight_decay, checkpoint_activations, stage, name) = match critic {
            false => (
                self.actor_learning_rate,
                self.actor_lora_learning_rate,
                self.actor_weight_decay,
                self.actor_gradient_checkpointing,
                self.actor_zero_stage,
                "actor",
            ),
            true => (
                self.critic_learning_rate,
                self.critic_lora_learning_rate,
                self.critic_weight_decay,
                self.critic_gradient_checkpointing,
                self.critic_zero_stage,
                "critic",
            ),
        };
        Ok(EngineConfig {
            optimizer: AdamWConfig::ds_chat(self.adam_eps, weight_decay),
            schedule: self.lr_scheduler_type.schedule(lr, self.num_warmup_steps, steps),
            gradient_accumulation_steps: self.gradient_accumulation_steps,
            gradient_clipping: self.gradient_clipping,
            precision: self.precision.precision(),
            loss_scaling: self.precision.loss_scaling(),
            lora_learning_rate: Some(lora_lr),
            checkpoint_activations,
            parallel: self.dist.parallel_config(group, stage, name)?,
        })
    }

    /// `--actor-dropout`, or 0 with `--disable-actor-dropout` (`None`: the model's).
    pub fn actor_dropout(&self) -> Option<f64> {
        if self.disable_actor_dropout {
            Some(0.0)
        } else {
            self.actor_dropout
        }
    }

    /// `--critic-dropout`, or 0 with `--disable-critic-dropout` (`None`: the model's).
    pub fn critic_dropout(&self) -> Option<f64> {
        if self.disable_critic_dropout {
            Some(0.0)
        } else {
            self.critic_dropout
        }
    }

    /// Every how many steps decoded rollouts are printed (0: never).
    pub fn print_answers_every(&self) -> u64 {
        self.print_answers_interval.unwrap_or(if self.print_answers { 1 } else { 10 })
    }

    /// The rollouts the run makes at most: `--test-stop-step` under `--enable-test-mode`.
    pub fn stop_after(&self) -> Option<u64> {
        self.test_stop_step.filter(|_| self.enable_test_mode)
    }

    /// The LoRA configuration of a model, `None` when its rank is 0.
    pub fn lora(dim: usize, module_name: &str) -> Option<lora::LoraConfig> {
        (dim > 0).then(|| lora::LoraConfig { dim, alpha: None, module_name: module_name.to_string() })
    }

    /// The LoRA flags of the trained model `what` ("actor", "critic"): (what, rank, module name,
    /// learning rate), `None` without LoRA on it.
    pub fn lora_of<'a>(&'a self, what: &'a str) -> Option<(&'a str, usize, &'a str, f64)> {
        let (dim, module, lr) = match what {
            "actor" => (self.actor_lora_dim, &self.actor_lora_module_name, self.actor_lora_learning_rate),
            _ => (self.critic_lora_dim, &self.critic_lora_module_name, self.critic_lora_learning_rate),
        };
        (dim > 0).then_some((what, dim, module.as_str(), lr))
    }

    pub fn ppo_config(&self) -> PpoConfig {
        PpoConfig {
            kl_ctl: self.kl_ctl,
            clip_reward_value: self.clip_reward_value,
            cliprange: self.cliprange,
            cliprange_high: self.cliprange_high,
            cliprange_value: self.cliprange_value,
            gamma: self.gamma,
            lam: self.lam,
            algorithm: self.algorithm,
            scale_rewards: self.scale_rewards,
            loss_type: self.loss_type,
            whiten_advantages: self.whiten_advantages,
            eos_action: !self.mask_eos_action,
            max_answer_len: self.max_answer_seq_len,
            temperature: if self.do_sample { self.temperature } else { 1.0 },
        }
    }

    /// Where PTX's corpus `name` comes from (with --unsupervised-dataset-config-name).
    pub fn ptx_source(&self, name: &str) -> Result<data::CorpusSource> {
        data::CorpusSource::with_config(name, self.unsupervised_dataset_config_name.as_deref())
            .map_err(|e| anyhow::anyhow!("--unsupervised-dataset-name: {e}"))
    }

    /// Checks the counts and the flags that depend on each other (float ranges are checked while
    /// parsing).
    pub fn validate(&self) -> Result<()> {
        if let Some(name) = &self.unsupervised_dataset_name {
            self.ptx_source(name)?;
        }
        let positive = [
            ("--per-device-generation-batch-size", self.per_device_generation_batch_size),
            ("--per-device-training-batch-size", self.per_device_training_batch_size),
            ("--generation-batches", self.generation_batches),
            ("--ppo-epochs", self.ppo_epochs),
            ("--max-prompt-seq-len", self.max_prompt_seq_len),
            ("--max-answer-seq-len", self.max_answer_seq_len),
            ("--num-train-epochs", self.num_train_epochs),
            ("--gradient-accumulation-steps", self.gradient_accumulation_steps),
            ("--num-samples-per-prompt", self.num_samples_per_prompt),
        ];
        for (flag, v) in positive {
            if v == 0 {
                bail!("{flag} must be at least 1");
            }
        }
        if self.max_prompt_seq_len.checked_add(self.max_answer_seq_len).is_none() {
            bail!("--max-prompt-seq-len + --max-answer-seq-len overflows: give lengths within the models' context (e.g. 256 and 256)");
        }
        if self.only_optimize_lora && self.actor_lora_dim == 0 && self.critic_lora_dim == 0 {
            bail!("--only-optimize-lora trains only LoRA adapters, but --actor-lora-dim and --critic-lora-dim are 0: add e.g. --actor-lora-dim 8");
        }
        if self.scale_rewards != RewardScaling::Group && self.algorithm != Algorithm::Grpo {
            bail!(
                "--scale-rewards scales GRPO's group advantages, and the algorithm is {}: drop it (or use --algorithm grpo)",
                self.algorithm.name()
            );
        }
        if self.no_reward_model && self.reward_fn.is_empty() {
            bail!("--no-reward-model leaves nothing to score the answers: add a --reward-fn (e.g. --reward-fn builtin:capitals)");
        }
        self.refuse_flags_without_effect()?;
        self.refuse_critic_flags_without_a_critic()?;
        self.precision.validate()?;
        self.log.validate()?;
        self.data.refuse_sft_only_data("PPO's step 3")?;
        if self.align_overflow && self.precision.dtype != Dtype::Fp16 {
            bail!(
                "--align-overflow aligns fp16 overflow skips, and the dtype is {}: add --dtype fp16 or drop it",
                self.precision.dtype.name()
            );
        }
        for (flag, stage) in
            [("--actor-zero-stage", self.actor_zero_stage), ("--critic-zero-stage", self.critic_zero_stage)]
        {
            if stage > 3 {
                bail!("{flag} {stage}: DeepSpeed's ZeRO stages are 0, 1, 2 and 3");
            }
        }
        hybrid_engine::device::check_device(&self.device)?;
        Ok(())
    }

    /// Flags the rest of the command makes without effect: each one line naming what it needs.
    fn refuse_flags_without_effect(&self) -> Result<()> {
        let defaults = PpoArgs::parse_from(["ppo"]);
        let gathers = |stage: u8| ZeroStage::number_gathers_after_the_step(stage.into());
        if self.dist.allgather_bucket_size != defaults.dist.allgather_bucket_size
            && !gathers(self.actor_zero_stage)
            && !gathers(self.critic_zero_stage)
        {
            bail!(
                "--allgather-bucket-size sizes the weights' all-gather after each step of ZeRO stages 1 and 2; the actor's stage {} and the critic's {} have none: drop the flag",
                self.actor_zero_stage,
                self.critic_zero_stage
            );
        }
        let external = self.reward_fn.iter().any(|spec| !matches!(spec, crate::reward_fn::RewardFnSpec::Builtin(_)));
        if self.reward_fn_timeout != defaults.reward_fn_timeout && !external {
            bail!("--reward-fn-timeout bounds a command's or a server's answer, and no --reward-fn is one (built-in scorers answer at once): drop it, or add --reward-fn exec:CMD or http://URL");
        }
        if self.reward_fn_tries.is_some() && !external {
            bail!("--reward-fn-tries tries a command or a server again, and no --reward-fn is one (built-in scorers are tried once: their errors are the prompt's): drop it, or add --reward-fn exec:CMD or http://URL");
        }
        if self.no_reward_model
            && !self.algorithm.has_critic()
            && self.critic_model_name_or_path != defaults.critic_model_name_or_path
        {
            bail!(
                "--critic-model-name-or-path is read for the critic or the reward model, and --algorithm {} trains no critic and --no-reward-model reads none: drop it",
                self.algorithm.name()
            );
        }
        if self.save.is_some() && self.no_final_checkpoint && self.save_interval == 0 {
            bail!("--save is where checkpoints go, and --no-final-checkpoint with --save-interval 0 saves none: drop --save, or add --save-interval N");
        }
        if self.lr_scheduler_type == HfScheduler::Constant && self.num_warmup_steps != defaults.num_warmup_steps {
            bail!("--num-warmup-steps warms up the learning rates, and --lr-scheduler-type constant has no warm-up: use constant_with_warmup, or drop --num-warmup-steps");
        }
        for (who, rank, modules, lr) in [
            ("actor", self.actor_lora_dim, &self.actor_lora_module_name, self.actor_lora_learning_rate),
            ("critic", self.critic_lora_dim, &self.critic_lora_module_name, self.critic_lora_learning_rate),
        ] {
            if let Some(flag) = lora_flag_set(modules, lr, &format!("{who}-")).filter(|_| rank == 0) {
                bail!("{flag} sets the {who}'s LoRA adapters, but --{who}-lora-dim is 0 (none): add --{who}-lora-dim (e.g. 8) or drop {flag}");
            }
        }
        if self.whiten_advantages && self.algorithm == Algorithm::ReinforcePp {
            bail!(
                "--whiten-advantages: --algorithm reinforce_pp always whitens its advantages over the batch: drop it"
            );
        }
        Ok(())
    }

    /// GRPO, RLOO and REINFORCE++ train no critic: the critic's flags (and GAE's) would have no
    /// effect (REINFORCE++ discounts its returns by --gamma). GRPO and RLOO compare answers to
    /// the same prompt: they need two answers per prompt, sampled.
    fn refuse_critic_flags_without_a_critic(&self) -> Result<()> {
        let name = self.algorithm.name();
        if self.algorithm.has_critic() {
            return Ok(());
        }
        if self.algorithm.compares_answers() && self.num_samples_per_prompt < 2 {
            bail!(
                "--algorithm {name} compares answers to the same prompt: add --num-samples-per-prompt 4 (at least 2)"
            );
        }
        if self.algorithm.compares_answers() && !self.do_sample {
            bail!(
                "--algorithm {name} compares the answers to one prompt, and greedy answers are all the same (every advantage 0: nothing trains): add --do-sample"
            );
        }
        let defaults = PpoArgs::parse_from(["ppo"]);
        let critic_only = [
            ("--critic-learning-rate", self.critic_learning_rate != defaults.critic_learning_rate),
            ("--critic-weight-decay", self.critic_weight_decay != defaults.critic_weight_decay),
            ("--critic-dropout", self.critic_dropout().is_some()),
            ("--critic-gradient-checkpointing", self.critic_gradient_checkpointing),
            ("--critic-lora-dim", self.critic_lora_dim != 0),
            ("--critic-zero-stage", self.critic_zero_stage != 0),
            ("--cliprange-value", self.cliprange_value != defaults.cliprange_value),
            ("--gamma", self.gamma != defaults.gamma && self.algorithm != Algorithm::ReinforcePp),
            ("--lam", self.lam != defaults.lam),
            ("--align-overflow", self.align_overflow),
        ];
        if let Some((flag, _)) = critic_only.iter().find(|(_, given)| *given) {
            bail!("{flag} sets the critic or its GAE, and --algorithm {name} trains no critic: drop {flag} (or use --algorithm ppo)");
        }
        Ok(())
    }
}
