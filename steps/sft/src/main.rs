//! `sft`: parse flags, run step 1, print any error as one line and exit 2.

fn main() {
    hybrid_engine::memory::retain_freed_memory();
    let args: sft::SftArgs = hybrid_engine::cli::parse_or_exit();
    if let Err(e) = sft::pretrain::run(&args) {
        hybrid_engine::cli::exit_with(e);
    }
}
