//! `train`: see `rlhf::launcher`.

fn main() {
    let args: rlhf::launcher::TrainArgs = hybrid_engine::cli::parse_or_exit();
    if let Err(e) = rlhf::launcher::run(&args) {
        hybrid_engine::cli::exit_with(e);
    }
}
