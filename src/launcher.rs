//! `train`: the pipeline launcher, DS-Chat's `e2e_rlhf.py`. Each step runs as its own process: the
//! recipe for the step, deployment type and model size (a bash script under `scripts/recipes/`,
//! embedded in the binary) calls `sft` / `reward` / `ppo`, which are this same binary under another name
//! (links in `<output>/.bin`), so one static binary is the whole pipeline. Each step's output goes
//! to the terminal and to `<output>/<model>/training.log`.
//!
//! With no arguments it runs the embedded demo: the three steps on a tiny GPT-2 and the demo data,
//! on the CPU, then a summary of what each step achieved.
//!
//! single_node and multi_node tell the step binary which ranks to start through the
//! environment: a count for this machine (src/ranks.rs), or the hosts of a DeepSpeed hostfile
//! (src/hostfile.rs, src/nodes.rs).

use crate::hostfile::{self, Node};
use crate::nodes::{Launcher, NodesPlan};
use crate::ranks::{tee, Echo};
use anyhow::{bail, Context, Result};
use clap::Parser;
use hybrid_engine::cli::step_args::{model_source, ModelSource, RANDOM_PREFIX};
use hybrid_engine::generation::generate::SamplingConfig;
use hybrid_engine::training::precision::Dtype;
use std::io::{BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(
    args_override_self = true,
    name = "train",
    about = "Run the RLHF pipeline, each step as its own process (with no arguments: the embedded CPU demo)"
)]
pub struct TrainArgs {
    /// Steps to run (1: SFT, 2: reward model, 3: PPO).
    #[arg(long, num_args = 1..)]
    pub step: Vec<u32>,
    /// single_gpu, single_node or multi_node (default single_gpu, as DS-Chat).
    #[arg(long, alias = "deployment_type")]
    pub deployment_type: Option<String>,
    /// Actor (step 1) model: a GPT-2 size (the hub's pretrained checkpoint), HF directory, hub id,
    /// or random:<size> for random weights (default: gpt2-xl, pretrained, the GPT-2 analogue of
    /// DS-Chat's OPT-1.3b; the demo uses tiny, random).
    #[arg(long, alias = "actor_model")]
    pub actor_model: Option<String>,
    /// Reward (step 2) model, as --actor-model (default: gpt2-medium, pretrained, the analogue of
    /// DS-Chat's OPT-350m).
    #[arg(long, alias = "reward_model")]
    pub reward_model: Option<String>,
    #[arg(long, default_value_t = 0, alias = "actor_zero_stage")]
    pub actor_zero_stage: u8,
    #[arg(long, default_value_t = 0, alias = "reward_zero_stage")]
    pub reward_zero_stage: u8,
    /// Megatron's tensor parallelism in steps 1 and 2: each layer split over this many
    /// consecutive ranks of a node, the rest data parallel (single_node or multi_node; it must
    /// divide the ranks per node and the attention heads). Steps 1 and 2 get it as
    /// RLHF_TENSOR_MODEL_PARALLEL_SIZE, the default of their --tensor-model-parallel-size.
    #[arg(long, default_value_t = 1, aliases = ["tensor_model_parallel_size", "tp-size", "tp_size"], value_parser = clap::value_parser!(u64).range(1..))]
    pub tensor_model_parallel_size: u64,
    #[arg(long, default_value = "output", alias = "output_dir")]
    pub output_dir: PathBuf,
    /// single_node: ranks (processes) per step (DeepSpeed's --num_gpus). Default: every visible
    /// GPU on CUDA; on the CPU, one per core, at least 2. multi_node: at most this many ranks on
    /// each host, its first slots (DeepSpeed's --num_gpus; not with --include/--exclude).
    #[arg(long, alias = "num_gpus", value_parser = clap::value_parser!(u64).range(1..))]
    pub num_gpus: Option<u64>,
    /// multi_node: the DeepSpeed hostfile, one `host slots=N` per line (default /job/hostfile,
    /// as DeepSpeed).
    #[arg(long)]
    pub hostfile: Option<PathBuf>,
    /// multi_node: only these hosts and slots, as DeepSpeed's: HOST[:SLOT[,SLOT...]] joined by
    /// `@` (`worker-0@worker-1:0,2`: every slot of worker-0, slots 0 and 2 of worker-1).
    #[arg(long)]
    pub include: Option<String>,
    /// multi_node: every host and slot but these (the format of --include; `worker-1:0`).
    #[arg(long)]
    pub exclude: Option<String>,
    /// multi_node: rank 0's address, which every host must reach (default: the first host; with
    /// --launcher srun, the first host SLURM gives the step).
    #[arg(long, alias = "master_addr")]
    pub master_addr: Option<String>,
    /// multi_node: rank 0's rendezvous port (default 29500, as DeepSpeed).
    #[arg(long, alias = "master_port", value_parser = clap::value_parser!(u16).range(1..))]
    pub master_port: Option<u16>,
    /// multi_node: how the hosts' ranks start: ssh (one session per host) or srun (inside a SLURM
    /// allocation). Default: srun when SLURM_JOB_ID is set, else ssh.
    #[arg(long, value_enum)]
    pub launcher: Option<Launcher>,
    /// Read recipes from this directory (laid out as scripts/recipes) instead of the embedded ones.
    #[arg(long, alias = "recipe_dir")]
    pub recipe_dir: Option<PathBuf>,
    /// Run the pretraining demo instead (a tiny GPT-2 on the embedded Shakespeare corpus); it
    /// takes --output-dir, --device and --dtype, and refuses the pipeline's flags.
    #[arg(long, alias = "pretrain_demo", conflicts_with_all = PIPELINE_ONLY_FLAGS)]
    pub pretrain_demo: bool,
    /// Where every step computes: auto (CUDA device 0 when built with --features cuda and a GPU
    /// opens, else the CPU), cpu, cuda or cuda:N. The steps get it as RLHF_DEVICE, the default
    /// of their --device.
    #[arg(long, default_value = "auto", env = hybrid_engine::device::DEVICE_ENV)]
    pub device: String,
    /// Compute dtype of every step: fp32, fp16 or bf16 (see the steps' --dtype). The steps get it
    /// as RLHF_DTYPE, the default of their --dtype.
    #[arg(long, value_enum, default_value_t = Dtype::Fp32, env = hybrid_engine::training::precision::DTYPE_ENV)]
    pub dtype: Dtype,
}

/// The flags that choose the RLHF pipeline's steps, models and recipes: --pretrain-demo has no
/// use for them, so it refuses them rather than drop them silently.
const PIPELINE_ONLY_FLAGS: [&str; 15] = [
    "step",
    "deployment_type",
    "actor_model",
    "reward_model",
    "actor_zero_stage",
    "reward_zero_stage",
    "tensor_model_parallel_size",
    "recipe_dir",
    "num_gpus",
    "hostfile",
    "include",
    "exclude",
    "master_addr",
    "master_port",
    "launcher",
];

/// How many processes each step runs as, and where.
enum Ranks {
    /// single_gpu: the step's own process.
    One,
    /// single_node: this many ranks on this machine.
    Local(usize),
    /// multi_node: the hosts' ranks.
    Nodes(NodesPlan),
}

/// The recipes shipped with the binary: (step directory, deployment type, script text).
const RECIPES: &[(&str, &str, &str)] = &[
    ("step1_sft", "single_gpu", include_str!("../scripts/recipes/step1_sft/single_gpu.sh")),
    ("step1_sft", "single_node", include_str!("../scripts/recipes/step1_sft/single_node.sh")),
    ("step1_sft", "multi_node", include_str!("../scripts/recipes/step1_sft/multi_node.sh")),
    ("step2_reward", "single_gpu", include_str!("../scripts/recipes/step2_reward/single_gpu.sh")),
    ("step2_reward", "single_node", include_str!("../scripts/recipes/step2_reward/single_node.sh")),
    ("step2_reward", "multi_node", include_str!("../scripts/recipes/step2_reward/multi_node.sh")),
    ("step3_ppo", "single_gpu", include_str!("../scripts/recipes/step3_ppo/single_gpu.sh")),
    ("step3_ppo", "single_node", include_str!("../scripts/recipes/step3_ppo/single_node.sh")),
    ("step3_ppo", "multi_node", include_str!("../scripts/recipes/step3_ppo/multi_node.sh")),
];

const DEPLOYMENTS: [&str; 3] = ["single_gpu", "single_node", "multi_node"];

/// One step of a run, resolved.
struct StepPlan {
    number: u32,
    recipe_dir: &'static str,
    model: String,
    zero_stage: u8,
    output: PathBuf,
    /// Step 3: the critic's starting model (the step-2 reward model) and ZeRO stage.
    critic: Option<(PathBuf, u8)>,
}

pub fn run(args: &TrainArgs) -> Result<()> {
    hybrid_engine::device::check_device(&args.device)?;
    if args.pretrain_demo {
        return pretrain_demo(args);
    }
    let demo = args.step.is_empty()
        && args.deployment_type.is_none()
        && args.actor_model.is_none()
        && args.reward_model.is_none();
    let steps: Vec<u32> = if args.step.is_empty() { vec![1, 2, 3] } else { args.step.clone() };
    let deployment = args.deployment_type.clone().unwrap_or_else(|| "single_gpu".into());
    if !DEPLOYMENTS.contains(&deployment.as_str()) {
        bail!("--deployment-type {deployment:?} is not one of single_gpu, single_node, multi_node");
    }
    if let Some(&n) = steps.iter().find(|&&s| !(1..=3).contains(&s)) {
        bail!("--step {n} does not exist: the steps are 1 (SFT), 2 (reward model) and 3 (PPO)");
    }
    let multi_node_flags = [
        ("--hostfile", args.hostfile.is_some()),
        ("--include", args.include.is_some()),
        ("--exclude", args.exclude.is_some()),
        ("--master-addr", args.master_addr.is_some()),
        ("--master-port", args.master_port.is_some()),
        ("--launcher", args.launcher.is_some()),
    ];
    if let (Some((flag, _)), false) = (multi_node_flags.iter().find(|(_, given)| *given), deployment == "multi_node") {
        bail!("{flag} sets up --deployment-type multi_node: add it, or drop {flag}");
    }
    let tp = args.tensor_model_parallel_size;
    if tp > 1 && deployment == "single_gpu" {
        bail!("--tensor-model-parallel-size {tp} splits each layer over {tp} ranks: add --deployment-type single_node (or multi_node)");
    }
    if tp > 1 && steps.contains(&3) {
        bail!("--tensor-model-parallel-size {tp} splits the models of steps 1 and 2; step 3 does not split its models yet: run --step 1 2 with it and --step 3 without");
    }
    if let (Some(n), "single_gpu") = (args.num_gpus, deployment.as_str()) {
        bail!("--num-gpus {n} sets the ranks of --deployment-type single_node (per host with multi_node): add one, or drop --num-gpus");
    }
    // multi_node's plan is complete once the step binaries have a directory (below); a refused
    // run creates no output, so the hosts are checked first.
    let hosts = if deployment == "multi_node" { Some(multi_node_hosts(args)?) } else { None };
    let local_ranks = if deployment == "single_node" {
        let n = match args.num_gpus {
            Some(n) => n as usize,
            None => default_ranks(&args.device)?,
        };
        check_no_outer_job(n, &format!("the {n} ranks of single_node"))?;
        println!("single_node: each step runs as {n} ranks on this machine (rank logs: <step output>/rank-<r>.log)");
        Some(n)
    } else {
        None
    };
    // The demo's reward model starts from the step-1 actor (InstructGPT initialises its reward
    // model from the SFT model): a random 7M-parameter trunk learns the pairs too slowly.
    let actor_dir = args.output_dir.join("actor");
    let (default_actor, default_reward) = if demo {
        ("tiny".to_string(), actor_dir.display().to_string())
    } else {
        ("gpt2-xl".into(), "gpt2-medium".into())
    };
    // As in DS-Chat, the models name where steps 1 and 2 start; step 3 always continues from
    // their outputs. Named without the step that reads them, they would do nothing.
    for (flag, given, step) in [("--actor-model", &args.actor_model, 1), ("--reward-model", &args.reward_model, 2)] {
        if given.is_some() && !steps.contains(&step) {
            bail!(
                "{flag} names the model step {step} starts from, and step {step} is not run (step 3 continues from {}): drop {flag} or add --step {step}",
                args.output_dir.join(if step == 1 { "actor" } else { "reward" }).display()
            );
        }
    }
    let actor = args.actor_model.clone().unwrap_or(default_actor);
    let reward = args.reward_model.clone().unwrap_or(default_reward);
    // DS-Chat fine-tunes pretrained models: say which weights each step starts from.
    for (step, what, name) in [(1, "actor", &actor), (2, "reward model", &reward)] {
        if steps.contains(&step) {
            println!("step {step} {what}: {}", describe_model(name)?);
        }
    }
    if steps.contains(&2)
        && !steps.contains(&1)
        && Path::new(&reward) == actor_dir
        && !actor_dir.join("config.json").is_file()
    {
        bail!(
            "step 2 starts from the step-1 actor at {} and there is none: run `train --step 1 --output-dir {}` first",
            actor_dir.display(),
            args.output_dir.display()
        );
    }
    let mut plans = Vec::new();
    for &n in &steps {
        plans.push(match n {
            1 => StepPlan {
                number: 1,
                recipe_dir: "step1_sft",
                model: actor.clone(),
                zero_stage: args.actor_zero_stage,
                output: args.output_dir.join("actor"),
                critic: None,
            },
            2 => StepPlan {
                number: 2,
                recipe_dir: "step2_reward",
                model: reward.clone(),
                zero_stage: args.reward_zero_stage,
                output: args.output_dir.join("reward"),
                critic: None,
            },
            3 => {
                // Step 3 reads both earlier outputs: say which command makes a missing one.
                for (dir, step) in [("actor", 1), ("reward", 2)] {
                    let path = args.output_dir.join(dir);
                    if !steps.contains(&step) && !path.join("config.json").is_file() {
                        bail!(
                            "step 3 needs the step-{step} model at {} and there is none: run `train --step {step} --output-dir {}` first",
                            path.display(),
                            args.output_dir.display()
                        );
                    }
                }
                StepPlan {
                    number: 3,
                    recipe_dir: "step3_ppo",
                    model: args.output_dir.join("actor").display().to_string(),
                    zero_stage: args.actor_zero_stage,
                    output: args.output_dir.join("step3"),
                    critic: Some((args.output_dir.join("reward"), args.reward_zero_stage)),
                }
            }
            _ => bail!("--step {n} does not exist: the steps are 1 (SFT), 2 (reward model) and 3 (PPO)"),
        });
    }

    let bin_dir = step_binaries(&args.output_dir)?;
    let ranks = match (local_ranks, hosts) {
        (Some(n), _) => Ranks::Local(n),
        (None, Some((nodes, launcher))) => Ranks::Nodes(NodesPlan {
            nodes,
            launcher,
            master_addr: args.master_addr.clone(),
            master_port: args.master_port.unwrap_or(hybrid_engine::comm::env::DEFAULT_MASTER_PORT),
            bin_dir: bin_dir.clone(),
        }),
        (None, None) => Ranks::One,
    };
    let started = Instant::now();
    for plan in &plans {
        let script = recipe(args.recipe_dir.as_deref(), plan.recipe_dir, &deployment)?;
        println!("---=== Running Step {} ===---", plan.number);
        let t0 = Instant::now();
        run_recipe(&script, plan, &bin_dir, (&args.device, args.dtype, tp), &ranks)?;
        println!("---=== Finished Step {} in {} ===---", plan.number, duration(t0.elapsed().as_secs()));
    }
    println!("---=== Finished Steps {steps:?} in {} ===---", duration(started.elapsed().as_secs()));
    print_summary(&args.output_dir, &steps)?;
    let chat_with =
        if steps.contains(&3) { args.output_dir.join("step3/actor") } else { args.output_dir.join("actor") };
    if steps.iter().any(|s| *s == 1 || *s == 3) {
        println!("Chat with the actor: chat --path {}", chat_with.display());
    }
    Ok(())
}

/// "1min 23s" (DS-Chat's e2e_rlhf.py duration format).
fn duration(secs: u64) -> String {
    format!("{}min {}s", secs / 60, secs % 60)
}

/// `<output>/.bin` with `sft` and `reward` linked to this executable, which dispatches on its
/// name (see `src/bin/train.rs`).
fn step_binaries(output: &Path) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot locate the train executable")?;
    let dir = output.join(".bin");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    for name in ["sft", "reward", "ppo"] {
        let link = dir.join(name);
        let _ = std::fs::remove_file(&link); // a stale link from an older build
        std::os::unix::fs::symlink(&exe, &link).with_context(|| format!("cannot create {}", link.display()))?;
    }
    std::fs::canonicalize(&dir).with_context(|| format!("cannot resolve {}", dir.display()))
}

/// The recipe text: from `--recipe-dir` when given, else the embedded one.
fn recipe(dir: Option<&Path>, step: &str, deployment: &str) -> Result<String> {
    if let Some(dir) = dir {
        let path = dir.join(step).join(format!("{deployment}.sh"));
        return std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read recipe {} (from --recipe-dir)", path.display()));
    }
    RECIPES
        .iter()
        .find(|(s, d, _)| *s == step && *d == deployment)
        .map(|(_, _, text)| text.to_string())
        .with_context(|| format!("internal error: no embedded recipe for {step}/{deployment}"))
}

/// single_node's ranks when --num-gpus is not given: the visible GPUs on CUDA (none visible is
/// an error), else one per core and at least 2.
fn default_ranks(device: &str) -> Result<usize> {
    let dev = hybrid_engine::device::parse_device(device)?;
    if dev.is_cuda() {
        let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        if let Some(list) = visible.as_deref().filter(|l| !l.trim().is_empty()) {
            return Ok(list.split(',').count());
        }
        let listed = Command::new("nvidia-smi").arg("-L").output().ok().filter(|o| o.status.success());
        let gpus =
            listed.map_or(0, |o| String::from_utf8_lossy(&o.stdout).lines().filter(|l| l.starts_with("GPU ")).count());
        if gpus == 0 {
            bail!("cannot count this machine's GPUs (nvidia-smi -L listed none): pass --num-gpus");
        }
        return Ok(gpus);
    }
    Ok(std::thread::available_parallelism().map_or(2, |n| n.get()).max(2))
}

/// multi_node's hosts, from the hostfile with --include/--exclude/--num-gpus applied, and how
/// their ranks start; prints what will run.
fn multi_node_hosts(args: &TrainArgs) -> Result<(Vec<Node>, Launcher)> {
    if args.num_gpus.is_some() && (args.include.is_some() || args.exclude.is_some()) {
        bail!("--num-gpus cannot be combined with --include or --exclude (as in DeepSpeed): pick the slots with one of them");
    }
    if args.master_addr.as_deref().is_some_and(|a| a.trim().is_empty()) {
        bail!("--master-addr is empty: give rank 0's host name or address, or drop it for the first host");
    }
    let path = args.hostfile.clone().unwrap_or_else(|| PathBuf::from(hostfile::DEFAULT_HOSTFILE));
    let pool = hostfile::read(&path)?;
    let mut nodes = hostfile::filter(&pool, args.include.as_deref(), args.exclude.as_deref())?;
    if let Some(n) = args.num_gpus {
        hostfile::limit_slots(&mut nodes, n as usize);
    }
    let world = hostfile::world_size(&nodes);
    let described = format!("{} ({})", path.display(), hostfile::describe(&nodes));
    check_no_outer_job(world, &format!("the {world} ranks of the hostfile {described}"))?;
    let launcher = args.launcher.unwrap_or(if std::env::var_os("SLURM_JOB_ID").is_some() {
        Launcher::Srun
    } else {
        Launcher::Ssh
    });
    if launcher == Launcher::Srun {
        crate::nodes::check_srun_layout(&nodes)?;
    }
    let master = match (&args.master_addr, launcher) {
        (Some(addr), _) => addr.clone(),
        (None, Launcher::Ssh) => nodes[0].host.clone(),
        (None, Launcher::Srun) => "SLURM's first host".into(),
    };
    let port = args.master_port.unwrap_or(hybrid_engine::comm::env::DEFAULT_MASTER_PORT);
    let logs = match launcher {
        Launcher::Ssh => {
            "node logs: <step output>/node-<host>.log here, rank logs: <step output>/rank-<r>.log on each host"
        }
        Launcher::Srun => "rank logs: <step output>/rank-<r>.log",
    };
    println!(
        "multi_node: each step runs as {world} ranks on {} hosts of {described} over {}, rank 0 at {master}:{port} ({logs})",
        nodes.len(),
        if launcher == Launcher::Ssh { "ssh" } else { "srun" },
    );
    Ok((nodes, launcher))
}

/// The step binary takes a launcher's `RANK` for its own place and would start no ranks, and a
/// `WORLD_SIZE` other than the job's says the user expects another job: either is one line.
fn check_no_outer_job(world: usize, job: &str) -> Result<()> {
    if let Some(rank) = std::env::var_os("RANK") {
        bail!("RANK={rank:?} is set in the environment, so each step would run as that one rank instead of {job}: unset RANK");
    }
    if let Some(w) = std::env::var_os("WORLD_SIZE").filter(|w| w.to_str().map(str::trim) != Some(&world.to_string())) {
        bail!(
            "WORLD_SIZE={w:?} is set in the environment and disagrees with {job}: unset WORLD_SIZE or make it {world}"
        );
    }
    Ok(())
}

/// Where a step's starting model comes from, for the log.
fn describe_model(name: &str) -> Result<String> {
    Ok(match model_source(name)? {
        ModelSource::Random(size) => format!("{name}, random weights of size {size}"),
        ModelSource::Files(source) if source != name => {
            format!("{name}, the pretrained {source} (Hugging Face hub; random weights: {RANDOM_PREFIX}{name})")
        }
        ModelSource::Files(source) => source,
    })
}

/// The recipe key for a model: the preset it is (`gpt2-medium`, also as
/// `openai-community/gpt2-medium` or `random:gpt2-medium`), the preset a local directory's shape
/// matches, or `custom`.
fn model_size(model: &str) -> String {
    let base = model.rsplit('/').next().unwrap_or(model);
    let base = base.strip_prefix(RANDOM_PREFIX).unwrap_or(base);
    if hybrid_engine::Gpt2Config::from_preset(base).is_some() && !Path::new(model).exists() {
        return base.to_string();
    }
    let config = Path::new(model).join("config.json");
    if let Ok(cfg) = hybrid_engine::checkpoints::hf_io::read_config(&config) {
        for name in ["tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"] {
            let p = hybrid_engine::Gpt2Config::from_preset(name).expect("known preset");
            if (p.n_layer, p.n_embd) == (cfg.n_layer, cfg.n_embd) {
                return name.to_string();
            }
        }
    }
    "custom".to_string()
}

/// Runs one step's recipe with bash, its output copied to the terminal and to training.log;
/// `device` (`--device`), `dtype` (`--dtype`) and `tp` (`--tensor-model-parallel-size`) reach the
/// step binaries as the defaults of their flags, `ranks` as the variables src/ranks.rs and
/// src/nodes.rs read.
fn run_recipe(
    script: &str,
    plan: &StepPlan,
    bin_dir: &Path,
    (device, dtype, tp): (&str, Dtype, u64),
    ranks: &Ranks,
) -> Result<()> {
    std::fs::create_dir_all(&plan.output).with_context(|| format!("cannot create {}", plan.output.display()))?;
    let log_path = plan.output.join("training.log");
    let mut log = std::fs::File::create(&log_path).with_context(|| format!("cannot create {}", log_path.display()))?;
    let path = path_with(bin_dir, std::env::var_os("PATH").as_deref())?;
    let mut cmd = Command::new("bash");
    // Only what this run asks for says which ranks to start: nothing left in the environment.
    for k in [
        crate::nodes::NODES_ENV,
        crate::ranks::FIRST_RANK_ENV,
        crate::ranks::WORLD_SIZE_ENV,
        crate::ranks::MASTER_ADDR_ENV,
        crate::ranks::MASTER_PORT_ENV,
    ] {
        cmd.env_remove(k);
    }
    match ranks {
        Ranks::One => cmd.env(crate::ranks::NPROC_ENV, "1"),
        Ranks::Local(n) => cmd.env(crate::ranks::NPROC_ENV, n.to_string()),
        Ranks::Nodes(nodes) => cmd.env_remove(crate::ranks::NPROC_ENV).env(crate::nodes::NODES_ENV, nodes.to_env()?),
    };
    let mut child = cmd
        .arg("-c")
        .arg(script)
        .arg(format!("{}/{}", plan.recipe_dir, plan.number))
        .arg(&plan.output)
        .arg(plan.zero_stage.to_string())
        .arg(&plan.model)
        .arg(model_size(&plan.model))
        .args(plan.critic.iter().flat_map(|(dir, zero)| [dir.display().to_string(), zero.to_string()]))
        .env("PATH", path)
        // The step's model save replaces this directory; the log must survive it.
        .env(hybrid_engine::durable::LIVE_LOG_ENV, &log_path)
        .env(hybrid_engine::device::DEVICE_ENV, device)
        .env(hybrid_engine::training::precision::DTYPE_ENV, dtype.name())
        .env(hybrid_engine::cli::dist_args::TP_SIZE_ENV, tp.to_string())
        // The step binary starts its ranks itself (crate::ranks, crate::nodes), logging into its output.
        .env(crate::ranks::RANK_LOG_DIR_ENV, &plan.output)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot start bash to run the step's recipe")?;
    // Both streams into the log in arrival order: stderr on its own thread.
    let stderr = child.stderr.take().expect("piped stderr");
    let err_log = log.try_clone()?;
    let err_thread = std::thread::spawn(move || tee(BufReader::new(stderr), err_log, Echo::Stderr));
    tee(BufReader::new(child.stdout.take().expect("piped stdout")), log.try_clone()?, Echo::Stdout)?;
    let err_tail = err_thread.join().map_err(|_| anyhow::anyhow!("the log thread panicked"))??;
    let status = child.wait()?;
    log.flush()?;
    if !status.success() {
        // The step's own one-line error, without its "error: " (ours adds one).
        let last =
            err_tail.map_or_else(|| format!("exit status {status}"), |l| l.trim_start_matches("error: ").to_string());
        bail!("step {} failed: {last} (full log: {})", plan.number, log_path.display());
    }
    Ok(())
}

/// `PATH` with `bin_dir` first, so the recipe's `sft`/`reward`/`ppo` are this launcher. Built
/// with `join_paths`, which refuses a directory containing the separator (`:`) instead of
/// silently splitting it into two wrong entries.
fn path_with(bin_dir: &Path, path: Option<&std::ffi::OsStr>) -> Result<std::ffi::OsString> {
    let rest = path.map(|p| std::env::split_paths(p).collect::<Vec<_>>()).unwrap_or_default();
    std::env::join_paths(std::iter::once(bin_dir.to_path_buf()).chain(rest)).map_err(|_| {
        anyhow::anyhow!(
            "the output directory's path {} contains ':', which cannot be put on PATH for the steps: choose an --output-dir without ':'",
            bin_dir.display()
        )
    })
}

/// What each finished step achieved, read from its output directory.
fn print_summary(output: &Path, steps: &[u32]) -> Result<()> {
    println!("---=== Summary ===---");
    if steps.contains(&1) {
        let end = last_record(&output.join("actor/metrics.jsonl"))?;
        let ppl: Vec<f64> =
            end["summary"]["perplexity"].as_array().map_or(vec![], |a| a.iter().filter_map(|v| v.as_f64()).collect());
        println!("step 1 (SFT): eval perplexity {}", sft::finetune::describe_perplexity(&ppl));
    }
    if steps.contains(&2) {
        let path = output.join("reward/reward_eval.json");
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
        let acc = |k: &str| v[k]["accuracy"].as_f64().map_or("n/a".into(), |a| format!("{a:.3}"));
        println!(
            "step 2 (reward): eval accuracy {} -> {}, mean chosen score {:.3}, mean rejected score {:.3}",
            acc("before_training"),
            acc("final"),
            v["final"]["chosen_mean_score"].as_f64().unwrap_or(f64::NAN),
            v["final"]["rejected_mean_score"].as_f64().unwrap_or(f64::NAN),
        );
    }
    if steps.contains(&3) {
        let end = last_record(&output.join("step3/metrics.jsonl"))?;
        let s = &end["summary"];
        println!(
            "step 3 (PPO): rollout reward {:.3} (first step) -> {:.3} (last step)",
            s["first_reward"].as_f64().unwrap_or(f64::NAN),
            s["last_reward"].as_f64().unwrap_or(f64::NAN)
        );
        if let (Some(sft), Some(ppo)) = (s["sft_eval"].as_object(), s["ppo_eval"].as_object()) {
            let task = |e: &serde_json::Map<String, serde_json::Value>| {
                e.get("task_success").and_then(|t| t.as_f64()).map_or("n/a".into(), |t| format!("{t:.3}"))
            };
            println!(
                "held-out prompts ({}): reward-model score SFT actor {:.3} -> PPO actor {:.3}; task score SFT {} -> PPO {}",
                sft.get("prompts").and_then(|p| p.as_u64()).unwrap_or(0),
                sft.get("reward_mean").and_then(|v| v.as_f64()).unwrap_or(f64::NAN),
                ppo.get("reward_mean").and_then(|v| v.as_f64()).unwrap_or(f64::NAN),
                task(sft),
                task(ppo)
            );
        }
    }
    Ok(())
}

/// The last JSON record of a metrics.jsonl (a torn last line, from an interrupted write, skipped).
fn last_record(path: &Path) -> Result<serde_json::Value> {
    hybrid_engine::training::metrics::read_records(path)?.pop().with_context(|| format!("{} is empty", path.display()))
}

/// The pretraining demo (issue 2's): a tiny GPT-2 on the embedded Shakespeare corpus, then a sample.
fn pretrain_demo(args: &TrainArgs) -> Result<()> {
    let out = args.output_dir.join("pretrain");
    println!("---=== Pretraining demo: tiny GPT-2 on the embedded Shakespeare corpus ===---");
    let started = Instant::now();
    let iters = 200u64;
    let pretrain_args = pretrain_demo_args(args, &out, iters);
    let summary = sft::pretrain::run(&pretrain_args)?;
    println!("---=== Pretraining finished in {:.0}s ===---", started.elapsed().as_secs_f64());
    if let (Some(first), Some(last)) = (summary.first_loss, summary.last_loss) {
        println!("train loss {first:.3} -> {last:.3}");
    }
    if let Some(ppl) = summary.valid_ppl {
        println!("validation perplexity {ppl:.1}");
    }
    let device = hybrid_engine::device::parse_device(&args.device)?;
    let chat = crate::chat::ChatModel::load(&out.display().to_string(), &device)?;
    let prompt = "ROMEO:";
    let eos = chat.tokenizer.eos_id();
    let sampling = SamplingConfig {
        max_new_tokens: 48,
        temperature: Some(0.8),
        top_k: Some(50),
        top_p: Some(0.95),
        eos_token_id: Some(eos),
        pad_token_id: eos,
        vocab_limit: chat.tokenizer.vocab_size(),
        seed: 1,
    };
    let ids = chat.tokenizer.encode(prompt)?;
    let completion = chat.tokenizer.decode(&chat.complete(&ids, &sampling)?)?;
    println!("---=== Sample from {} ===---\n{prompt}{completion}", out.display());
    println!("Chat with it: chat --path {}", out.display());
    Ok(())
}

/// The demo's `sft --from-scratch` flags: `iters` iterations of tiny into `out`, on the
/// launcher's --device and in its --dtype.
fn pretrain_demo_args(args: &TrainArgs, out: &Path, iters: u64) -> sft::pretrain_args::PretrainArgs {
    sft::pretrain_args::PretrainArgs::parse_from([
        "sft".to_string(),
        "--from-scratch".into(),
        "--model".into(),
        "tiny".into(),
        "--micro-batch-size".into(),
        "4".into(),
        "--train-iters".into(),
        iters.to_string(),
        "--lr-warmup-iters".into(),
        (iters / 10).to_string(),
        "--eval-interval".into(),
        (iters / 4).to_string(),
        "--eval-iters".into(),
        "8".into(),
        "--save-interval".into(),
        (iters / 2).to_string(),
        "--output-dir".into(),
        out.display().to_string(),
        "--device".into(),
        args.device.clone(),
        "--dtype".into(),
        args.dtype.name().into(),
    ])
}

#[cfg(test)]
mod pretrain_demo_tests {
    use super::*;

    #[test]
    fn the_pretrain_demo_trains_in_the_launchers_dtype_and_device() {
        for dtype in ["fp32", "fp16", "bf16"] {
            let train = TrainArgs::parse_from(["train", "--pretrain-demo", "--dtype", dtype, "--device", "cpu"]);
            let demo = pretrain_demo_args(&train, Path::new("out/pretrain"), 8);
            assert_eq!(demo.precision.dtype.name(), dtype);
            assert_eq!((demo.device.as_str(), demo.output_dir.as_path()), ("cpu", Path::new("out/pretrain")));
        }
    }
}

#[cfg(test)]
mod path_tests {
    use super::*;

    #[test]
    fn the_step_binaries_come_first_on_path_and_a_colon_is_refused() {
        let path = path_with(Path::new("/out/.bin"), Some("/usr/bin:/bin".as_ref())).unwrap();
        assert_eq!(path, "/out/.bin:/usr/bin:/bin");
        assert_eq!(path_with(Path::new("/out/.bin"), None).unwrap(), "/out/.bin");
        let err = path_with(Path::new("/a:b/.bin"), Some("/usr/bin".as_ref())).unwrap_err().to_string();
        assert!(err.contains("contains ':'") && err.contains("--output-dir"), "{err}");
    }
}

#[cfg(test)]
mod model_name_tests {
    use super::*;

    #[test]
    fn size_names_are_described_as_pretrained_and_random_weights_as_asked_for() {
        let line = describe_model("gpt2-xl").unwrap();
        assert!(line.contains("pretrained openai-community/gpt2-xl") && line.contains("random:gpt2-xl"), "{line}");
        assert_eq!(describe_model("random:gpt2").unwrap(), "random:gpt2, random weights of size gpt2");
        assert_eq!(describe_model("tiny").unwrap(), "tiny, random weights of size tiny");
        assert_eq!(describe_model("output/actor").unwrap(), "output/actor");
        assert!(describe_model("random:huge").is_err());
        // Random weights of a size run that size's recipe.
        assert_eq!(model_size("random:gpt2-medium"), "gpt2-medium");
        assert_eq!(model_size("openai-community/gpt2-large"), "gpt2-large");
    }
}
