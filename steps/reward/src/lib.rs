//! Step 2 of the pipeline: the reward model (DS-Chat `step2_reward_model_finetuning`): a GPT-2
//! trunk with a scalar score head, trained on chosen/rejected pairs with DS-Chat's pairwise loss;
//! or, with `--algorithm dpo`, DPO of the step-1 actor on the same pairs.

pub mod args;
pub mod dpo;
pub mod fixture;
pub mod loss;
pub mod train;

pub use args::RewardArgs;

/// `reward` with the process arguments. Exits 2 on any error.
pub fn main_with_args() {
    let argv = hybrid_engine::cli::deepspeed_config::expand::<RewardArgs>(std::env::args_os().collect())
        .unwrap_or_else(|e| hybrid_engine::cli::exit_with(e));
    let args: RewardArgs = hybrid_engine::cli::parse_from_or_exit(argv);
    let result = args.refuse_other_algorithms_flags().and_then(|()| match args.algorithm {
        args::Step2Algorithm::RewardModel => train::run(&args).map(drop),
        args::Step2Algorithm::Dpo => dpo::run(&args).map(drop),
    });
    if let Err(e) = result {
        hybrid_engine::cli::exit_with(e);
    }
}
