//! Step 3 of the pipeline: PPO (DS-Chat `step3_rlhf_finetuning`): PPO's math as pure functions
//! (`ppo`), the rollout record (`experience`), its advantages (`advantages`: GAE, GRPO's and
//! RLOO's), rewards from outside the reward model (`reward_fn`), one PPO update over the four
//! models (`trainer`), the step's memory plan (`memory_plan`), and the loop (`run`).

pub mod advantages;
pub mod args;
pub mod checkpoint;
pub mod eval;
pub mod experience;
pub mod memory_plan;
pub mod models;
pub mod ppo;
pub mod reward_fn;
pub mod run;
pub mod trainer;

pub use args::PpoArgs;
pub use ppo::PpoConfig;

/// `ppo` with the process arguments. Exits 2 on any error.
pub fn main_with_args() {
    let argv = hybrid_engine::cli::deepspeed_config::expand::<PpoArgs>(std::env::args_os().collect())
        .unwrap_or_else(|e| hybrid_engine::cli::exit_with(e));
    let args: PpoArgs = hybrid_engine::cli::parse_from_or_exit(argv);
    if let Err(e) = run::run(&args) {
        hybrid_engine::cli::exit_with(e);
    }
}
