//! `chat`: see `rlhf::chat`.

fn main() {
    hybrid_engine::runtime::init();
    hybrid_engine::runtime::contain_panics_when(data::panics::panic_is_contained);
    let args: rlhf::chat::ChatArgs = hybrid_engine::cli::parse_or_exit();
    if let Err(e) = rlhf::chat::run(&args) {
        hybrid_engine::cli::exit_with(e);
    }
}
