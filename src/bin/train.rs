//! `train`: see `rlhf::launcher`.

fn main() {
    hybrid_engine::memory::retain_freed_memory();
    let args: rlhf::launcher::TrainArgs = hybrid_engine::cli::parse_or_exit();
    if let Err(e) = rlhf::launcher::run(&args) {
        hybrid_engine::cli::exit_with(e);
    }
}
