//! The flags of data-parallel training every step shares: how long to wait for other ranks, the
//! gradient bucket, DS-Chat's `--offload`. Which rank a process is comes from the environment
//! (`comm::env`), set by our launcher, torchrun or SLURM.

use crate::cli::heading;
use crate::comm::{Backend, ProcessGroup, RankEnv, WireDtype};
use crate::engine::ParallelConfig;
use crate::training::tensor_parallel::TensorParallel;
use crate::training::zero::{ZeroStage, DEFAULT_BUCKET};
use anyhow::{bail, Result};
use clap::Args;
use std::sync::Arc;
use std::time::Duration;

/// The environment variable `train --tensor-model-parallel-size` sets for the steps: the default
/// of their `--tensor-model-parallel-size`.
pub const TP_SIZE_ENV: &str = "RLHF_TENSOR_MODEL_PARALLEL_SIZE";

/// The environment variable `train --inference-tp-size` sets for step 3: the default of its
/// `--inference-tp-size`.
pub const INFERENCE_TP_SIZE_ENV: &str = "RLHF_INFERENCE_TP_SIZE";

#[derive(Args, Clone, Debug)]
pub struct DistArgs {
    /// Seconds to wait for another rank, at the rendezvous and in every collective; a rank that
    /// died or hangs makes the others fail after this long, naming it (on GPUs NCCL's watchdog:
    /// the collective named, the communicator aborted).
    #[arg(help_heading = heading::PARALLELISM, long, default_value_t = 300, alias = "dist_timeout", value_parser = clap::value_parser!(u64).range(1..))]
    pub dist_timeout: u64,
    /// Gradient values per bucket (DeepSpeed's reduce_bucket_size): stage 0's all-reduces, stage
    /// 1's reduce-scatter in rounds, stage 2's reduce-scatters made during backward as gradients
    /// complete (a rank holds a bucket of them rather than a micro-batch's whole gradient), and
    /// stage 3's reduce-scatter of each block's gradients in rounds.
    #[arg(help_heading = heading::PARALLELISM, long, default_value_t = DEFAULT_BUCKET as u64, alias = "reduce_bucket_size", value_parser = clap::value_parser!(u64).range(1..))]
    pub reduce_bucket_size: u64,
    /// Weight values per round of the all-gather that follows each step at stages 1 and 2
    /// (DeepSpeed's allgather_bucket_size): each round's buffer is this many values, written
    /// into the weights as it arrives, rather than the whole model's. Refused at stages 0 and 3,
    /// which have no such gather.
    #[arg(help_heading = heading::PARALLELISM, long, default_value_t = DEFAULT_BUCKET as u64, alias = "allgather_bucket_size", value_parser = clap::value_parser!(u64).range(1..))]
    pub allgather_bucket_size: u64,
    /// The type gradients travel in through their reductions over the data-parallel ranks
    /// (DeepSpeed's communication_data_type): fp32, or fp16/bf16 for half the bytes, added in
    /// that type at every hop (the CPU ring, or NCCL on GPUs).
    #[arg(help_heading = heading::PARALLELISM, long, default_value = "fp32", alias = "communication_data_type", value_parser = parse_wire)]
    pub communication_data_type: WireDtype,
    /// DS-Chat's ZeRO-Offload (DeepSpeed's offload_optimizer: cpu): each rank's shard of the
    /// fp32 masters and its Adam moments in host memory, stepped there, on GPUs at ZeRO stages
    /// 1-3 across ranks; without it they stay on the GPU and step there (stage 3 gathers its units
    /// from them there). Refused on a CPU run (all in host
    /// memory) and on a GPU at stage 0 or alone (the optimizer stays on the GPU).
    #[arg(help_heading = heading::PARALLELISM, long)]
    pub offload: bool,
    /// Megatron's tensor parallelism: every layer split over this many consecutive ranks (on one
    /// node; it must divide the attention heads), the ranks forming TP x DP groups; batch sizes
    /// are per data-parallel rank. With ZeRO stages 0-2; pretraining and all three steps.
    #[arg(help_heading = heading::PARALLELISM, long, default_value_t = 1, env = TP_SIZE_ENV, aliases = ["tensor_model_parallel_size", "tp-size", "tp_size"], value_parser = clap::value_parser!(u64).range(1..))]
    pub tensor_model_parallel_size: u64,
    /// DS-Chat's `--deepspeed` (deepspeed.add_config_arguments; `--deepscale` its old name):
    /// accepted for its scripts; the engine it turns on is always on here.
    #[arg(help_heading = heading::PARALLELISM, long, alias = "deepscale")]
    pub deepspeed: bool,
    /// DeepSpeed's JSON config: its batch sizes, accumulation, clipping, ZeRO stage and bucket,
    /// fp16/bf16, AdamW and warmup schedule become this command's flags (a flag that contradicts
    /// it is an error; keys with no meaning here are listed as ignored). In step 3 they apply to
    /// both models. See cli/deepspeed_config.rs.
    #[arg(help_heading = heading::PARALLELISM, long, aliases = ["deepspeed_config", "deepscale-config", "deepscale_config"])]
    pub deepspeed_config: Option<std::path::PathBuf>,
    /// What carries collectives between GPUs (Megatron's --distributed-backend): nccl (the
    /// default where this build has it), or gloo, the TCP ring through host memory (ranks
    /// sharing one GPU, which NCCL refuses). CPU tensors always take the ring, so nccl is refused
    /// with --device cpu.
    #[arg(help_heading = heading::PARALLELISM, long, value_enum, alias = "distributed_backend")]
    pub distributed_backend: Option<Backend>,
    /// The rank on this node, as DeepSpeed's and torch.distributed.launch's launchers pass it: it
    /// must agree with the environment's LOCAL_RANK (the ranks are read from the environment).
    #[arg(help_heading = heading::PARALLELISM, long, alias = "local_rank")]
    pub local_rank: Option<usize>,
}

/// `--communication-data-type`'s value parser: one clear line for a bad name.
fn parse_wire(name: &str) -> Result<WireDtype, String> {
    WireDtype::parse(name).map_err(|e| e.to_string())
}

/// The arguments less `--local_rank N` / `--local-rank=N`, the one flag in which the ranks of
/// DeepSpeed's and torch.distributed.launch's launchers differ.
fn without_local_rank(args: impl Iterator<Item = String>) -> Vec<String> {
    let mut kept = Vec::new();
    let mut skip_value = false;
    for arg in args {
        if std::mem::take(&mut skip_value) {
            continue;
        }
        match arg.split_once('=').map_or(arg.as_str(), |(flag, _)| flag) {
            "--local_rank" | "--local-rank" => skip_value = !arg.contains('='),
            _ => kept.push(arg),
        }
    }
    kept
}

impl DistArgs {
    /// Joins the job the environment describes (one rank when none does), its collectives
    /// carried for tensors on `device`. Every rank's command line must match rank 0's: the store
    /// compares their hashes.
    pub fn join(&self, device: &candle_core::Device) -> Result<Arc<ProcessGroup>> {
        if self.distributed_backend == Some(Backend::Nccl) {
            if device.is_cpu() {
                bail!("--distributed-backend nccl carries CUDA tensors, and this run's are on the CPU (they take the TCP ring): drop the flag, or use --device cuda");
            }
            if !cfg!(feature = "nccl") {
                bail!("--distributed-backend nccl: this build has no NCCL; rebuild with --features cuda,nccl, or use --distributed-backend gloo");
            }
        }
        let env = RankEnv::from_process()?;
        if let Some(local) = self.local_rank.filter(|&l| l != env.local_rank) {
            let from = match env.source {
                "none" => "no launcher's variables in the environment: one process, local rank 0".to_string(),
                source => format!("{source}'s LOCAL_RANK is {}", env.local_rank),
            };
            bail!(
                "--local_rank {local} disagrees with the environment ({from}): start the ranks with a launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, or drop --local_rank"
            );
        }
        // The ranks' command lines must match, but for the one flag a launcher gives each its own.
        let flags = without_local_rank(std::env::args().skip(1));
        let group = ProcessGroup::init(env, Duration::from_secs(self.dist_timeout), &flags.join("\0"))?;
        Ok(Arc::new(group.with_backend(self.distributed_backend.unwrap_or_default())))
    }

    /// The tensor-parallel layout of `world` (`None` without `--tensor-model-parallel-size`);
    /// every ZeRO stage shards across its data-parallel groups.
    pub fn tensor_parallel(&self, world: &ProcessGroup) -> Result<Option<TensorParallel>> {
        TensorParallel::new(world, self.tensor_model_parallel_size as usize)
    }

    /// How a model trains over `group`: ZeRO `stage` and the bucket, with a line saying what
    /// they do (`model` names which of a step's models, as step 3's "actor"; "" for the only one).
    pub fn parallel_config(&self, group: &ProcessGroup, stage: u8, model: &str) -> Result<ParallelConfig> {
        let zero_stage = ZeroStage::from_number(stage)?;
        let prefix = if model.is_empty() { String::new() } else { format!("{model}: ") };
        let gather_bucket_set = self.allgather_bucket_size != DEFAULT_BUCKET as u64;
        if group.world() == 1 {
            if stage > 0 {
                println!("{prefix}ZeRO stage {stage} with 1 process: nothing to shard, training as stage 0");
            }
            // Set for a script shared with runs on several ranks: said once, not refused.
            let unused: Vec<&str> = [
                (self.reduce_bucket_size != DEFAULT_BUCKET as u64, "--reduce-bucket-size"),
                (gather_bucket_set, "--allgather-bucket-size"),
                (self.communication_data_type != WireDtype::F32, "--communication-data-type"),
            ]
            .into_iter()
            .filter_map(|(set, flag)| set.then_some(flag))
            .collect();
            if !unused.is_empty() {
                println!("{prefix}{}: no effect with one data-parallel rank (nothing is reduced)", unused.join(", "));
            }
        } else if gather_bucket_set && !zero_stage.gathers_after_the_step() {
            // Step 3's models are checked together (one of them may gather).
            if model.is_empty() {
                bail!(
                    "--allgather-bucket-size sizes the weights' all-gather after each step of ZeRO stages 1 and 2; stage {stage} has none (stage 3 gathers each block when it runs): drop the flag"
                );
            }
            println!("{prefix}--allgather-bucket-size: no effect at ZeRO stage {stage} (only stages 1 and 2 gather after the step)");
        }
        if group.world() > 1 {
            let what = match zero_stage {
                ZeroStage::Disabled => "gradients all-reduced, every rank updates the whole model",
                ZeroStage::OptimizerStates => {
                    "Adam moments (in fp16/bf16 the fp32 masters too) sharded, gradients reduce-scattered at the step, weights all-gathered"
                }
                ZeroStage::Parameters => {
                    "weights, gradients and Adam moments sharded; each block's weights gathered when it runs"
                }
                ZeroStage::Gradients => {
                    "Adam moments (in fp16/bf16 the fp32 masters too) and gradients sharded (reduce-scattered every micro-batch), weights all-gathered"
                }
            };
            let wire = match self.communication_data_type {
                WireDtype::F32 => String::new(),
                wire => format!("; gradients reduced in {}", wire.name()),
            };
            println!("{prefix}data parallel: {} ranks, ZeRO stage {stage}: {what}{wire}", group.world());
        }
        Ok(ParallelConfig {
            zero_stage,
            reduce_bucket_size: self.reduce_bucket_size as usize,
            allgather_bucket_size: self.allgather_bucket_size as usize,
            offload: self.offload,
            communication_data_type: self.communication_data_type,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        dist: DistArgs,
    }

    /// `--allgather-bucket-size` sizes the gather after the step of stages 1 and 2: at stages 0
    /// and 3 across ranks a step with one model refuses it in one line, step 3's models each
    /// say so (their check is together, in ppo's arguments); on one rank it only says it has no
    /// effect, as the other communication flags do.
    #[test]
    fn a_gather_bucket_is_refused_where_no_gather_follows_the_step() {
        let dist = |extra: &[&str]| Cli::try_parse_from([&["x"], extra].concat()).unwrap().dist;
        let set = dist(&["--allgather-bucket-size", "1000", "--reduce-bucket-size", "1000"]);
        for result in crate::comm::on_groups(2, |group| {
            for stage in [0, 3] {
                let refused = set.parallel_config(&group, stage, "").unwrap_err().to_string();
                assert!(refused.contains("--allgather-bucket-size") && refused.contains(&format!("stage {stage}")));
                set.parallel_config(&group, stage, "critic")?;
            }
            for stage in [1, 2] {
                assert_eq!(set.parallel_config(&group, stage, "")?.allgather_bucket_size, 1000);
            }
            dist(&[]).parallel_config(&group, 3, "")?;
            Ok(())
        }) {
            result.unwrap();
        }
        let one = set.parallel_config(&ProcessGroup::single(), 3, "").unwrap();
        assert_eq!((one.reduce_bucket_size, one.allgather_bucket_size), (1000, 1000));
    }

    #[test]
    fn the_ranks_command_lines_compare_without_the_launchers_local_rank() {
        let args = |s: &str| s.split(' ').map(str::to_string).collect::<Vec<_>>().into_iter();
        let want = ["--zero-stage", "2", "--output-dir", "out"];
        for line in [
            "--local_rank=3 --zero-stage 2 --output-dir out",
            "--zero-stage 2 --local-rank 1 --output-dir out",
            "--zero-stage 2 --output-dir out --local_rank 0",
        ] {
            assert_eq!(without_local_rank(args(line)), want, "{line}");
        }
    }
}
