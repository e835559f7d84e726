//! `policy_eval`: actors side by side on held-out prompts, as step 3 compares the SFT and the
//! PPO actor at its end: the reward model's score of their greedy answers, the demo task score,
//! the answers' length and each actor's KL to the reference (the SFT model) on sampled answers.
//! This is how PPO, GRPO, RLOO and DPO actors of the same SFT model are compared
//! (`scripts/compare-algorithms.sh`).

use anyhow::{bail, Result};
use clap::Parser;
use ppo::eval::{evaluate_policy, PolicyEval};
use ppo::models::{read_model, read_reward_model};

#[derive(Parser, Debug)]
#[command(name = "policy_eval", about = "Score actors on held-out prompts against a reward model and their reference")]
struct Args {
    /// Actors to evaluate, each `NAME=DIR` (e.g. `ppo=output/step3/actor`).
    #[arg(long = "actor", required = true)]
    actors: Vec<String>,
    /// The SFT model the KL is measured against (it is evaluated too, as `sft`).
    #[arg(long, alias = "reference")]
    reference: String,
    /// The step-2 reward model that scores the answers.
    #[arg(long, alias = "reward_model")]
    reward_model: String,
    /// `demo`, `arithmetic` or `arithmetic-phrasings` (an embedded task's held-out prompts), a
    /// jsonl with a `prompt` field or a text file with one prompt per line.
    #[arg(long, default_value = "demo", alias = "eval_prompts")]
    eval_prompts: String,
    #[arg(long, default_value_t = 24, alias = "max_prompt_seq_len")]
    max_prompt_seq_len: usize,
    #[arg(long, default_value_t = 16, alias = "max_answer_seq_len")]
    max_answer_seq_len: usize,
    #[arg(long, default_value_t = 16, alias = "batch_size")]
    batch_size: usize,
    /// Also probe the reward model on the demo task: every city of the table in every answer
    /// template of each held-out prompt, scored (how many wrong cities beat the capital).
    #[arg(long, alias = "probe_demo_reward_model")]
    probe_demo_reward_model: bool,
    /// Also write the evaluations (answers included) here as JSON.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    #[arg(long, default_value = "auto", env = hybrid_engine::device::DEVICE_ENV)]
    device: String,
}

fn run(args: &Args) -> Result<()> {
    let device = hybrid_engine::device::parse_device(&args.device)?;
    let mut named = Vec::new();
    for spec in &args.actors {
        let Some((name, dir)) = spec.split_once('=') else {
            bail!("--actor {spec:?}: give NAME=DIR, e.g. --actor ppo=output/step3/actor");
        };
        named.push((name.to_string(), dir.to_string()));
    }
    let (ref_cfg, ref_params, ref_files) = read_model(&args.reference, "--reference", Some(0.0), &device)?;
    let tok = data::Tokenizer::from_model_dir_or_default(&ref_files.dir)?;
    let reference = ref_params.model(&ref_cfg)?;
    let (rm_cfg, rm_params) = read_reward_model(&args.reward_model, "--reward-model", Some(0.0), &device)?;
    let reward = hybrid_engine::training::train_step::TrainedModel::reward(
        hybrid_engine::model::reward_model::RewardModel::new(&rm_params, &rm_cfg)?,
    );
    let prompts = data::prompts::read_prompts(&args.eval_prompts, usize::MAX)?;
    let evaluate = |actor: (&str, &hybrid_engine::Gpt2)| -> Result<PolicyEval> {
        evaluate_policy(
            actor,
            &reference,
            Some(&reward),
            &tok,
            &prompts,
            args.max_prompt_seq_len,
            args.max_answer_seq_len,
            args.batch_size,
            &device,
        )
    };
    let mut rows = vec![("sft".to_string(), evaluate(("sft", &reference))?)];
    for (name, dir) in &named {
        let (cfg, params, _) = read_model(dir, &format!("--actor {name}="), Some(0.0), &device)?;
        rows.push((name.clone(), evaluate((name, &params.model(&cfg)?))?));
    }
    let countries = rows[0].1.heldout_country_prompts;
    println!("held-out prompts: {} (held-out countries: {countries})", rows[0].1.prompts);
    println!("| actor | reward-model score | task score | held-out countries' task score | KL to SFT (nats) | answer length |");
    println!("|---|---|---|---|---|---|");
    for (name, e) in &rows {
        let score = e.reward_mean.unwrap_or(f64::NAN);
        println!(
            "| {name} | {score:.3} | {} | {} | {:.3} | {:.1} |",
            ppo::eval::score_text(e.task_success),
            ppo::eval::score_text(e.heldout_country_task_success),
            e.kl_to_reference,
            e.answer_len_mean
        );
    }
    if args.probe_demo_reward_model {
        let p = ppo::eval::probe_demo_reward_model(&reward, &tok, args.max_prompt_seq_len, &device)?;
        println!(
            "reward model on the demo task: the capital scores above every other of the {} cities in {:.3} of {} (prompt, template) probes; on average {:.2} wrong cities score above it; its best-scored answer (any city in any template, or a true answer about another country) names the capital for {:.3} of the prompts",
            p.cities, p.capital_first, p.probes, p.wrong_above_capital, p.best_answer_correct
        );
    }
    if let Some(path) = &args.json {
        let json: serde_json::Map<String, serde_json::Value> =
            rows.iter().map(|(n, e)| Ok((n.clone(), serde_json::to_value(e)?))).collect::<Result<_>>()?;
        hybrid_engine::durable::write_file_atomically(path, serde_json::to_string_pretty(&json)?.as_bytes())?;
    }
    Ok(())
}

fn main() {
    let args: Args = hybrid_engine::cli::parse_or_exit();
    if let Err(e) = run(&args) {
        hybrid_engine::cli::exit_with(e);
    }
}
