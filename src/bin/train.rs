//! `train`: see `rlhf::launcher`. The same executable is also `sft`, `reward` and `ppo` when invoked under
//! those names (the launcher links them into `<output>/.bin`), so the whole pipeline is one binary.

fn main() {
    hybrid_engine::runtime::init();
    hybrid_engine::runtime::contain_panics_when(data::panics::panic_is_contained);
    let name = std::env::args_os()
        .next()
        .and_then(|a| std::path::Path::new(&a).file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_default();
    let is_step = matches!(name.as_str(), "sft" | "reward" | "ppo");
    if is_step {
        // A single_node recipe's step: start its ranks and supervise them.
        match rlhf::ranks::ranks_to_spawn().and_then(|n| n.map(rlhf::ranks::spawn_local_ranks).transpose()) {
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
            let args: rlhf::launcher::TrainArgs = hybrid_engine::cli::parse_or_exit();
            if let Err(e) = rlhf::launcher::run(&args) {
                hybrid_engine::cli::exit_with(e);
            }
        }
    }
}
