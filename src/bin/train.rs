//! `train`: see `rlhf::launcher`. The same executable is also `sft`, `reward` and `ppo` when invoked under
//! those names (the launcher links them into `<output>/.bin`), so the whole pipeline is one binary.
//! `train plot DIR` redraws a run's training curves (`rlhf::plot`); `train wandb-sync DIR` uploads
//! the wandb runs kept on disk (`rlhf::wandb_sync`).

fn main() {
    hybrid_engine::runtime::init();
    hybrid_engine::runtime::contain_panics_when(data::panics::panic_is_contained);
    let name = std::env::args_os()
        .next()
        .and_then(|a| std::path::Path::new(&a).file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_default();
    let is_step = matches!(name.as_str(), "sft" | "reward" | "ppo");
    if is_step {
        // A single_node or multi_node recipe's step: start the job's ranks and supervise them.
        match launch_ranks() {
            Ok(Some(code)) => std::process::exit(code),
            Ok(None) => {}
            Err(e) => hybrid_engine::cli::exit_with(e),
        }
    }
    match name.as_str() {
        "sft" => sft::main_with_args(),
        "reward" => reward::main_with_args(),
        "ppo" => ppo::main_with_args(),
        _ => {
            use rlhf::launcher::TrainCommand;
            let args: rlhf::launcher::TrainArgs = hybrid_engine::cli::parse_or_exit();
            let done = match &args.command {
                Some(TrainCommand::Plot(plot)) => rlhf::plot::main(plot),
                Some(TrainCommand::WandbSync(sync)) => rlhf::wandb_sync::main(sync),
                None => rlhf::launcher::run(&args),
            };
            if let Err(e) = done {
                hybrid_engine::cli::exit_with(e);
            }
        }
    }
}

/// A multi_node job's launch (the hosts), else a node's ranks (single_node, or one host of a
/// multi_node job); `None` when this process is to run the step itself.
fn launch_ranks() -> anyhow::Result<Option<i32>> {
    if let Some(plan) = rlhf::nodes::NodesPlan::from_env()? {
        return rlhf::nodes::launch(&plan).map(Some);
    }
    rlhf::ranks::NodeRanks::from_env()?.map(|node| rlhf::ranks::spawn_local_ranks(&node)).transpose()
}
