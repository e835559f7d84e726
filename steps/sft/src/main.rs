//! `sft`: step 1 (supervised fine-tuning), or GPT-2 pretraining with `--from-scratch`.

fn main() {
    hybrid_engine::runtime::init();
    hybrid_engine::runtime::contain_panics_when(data::panics::panic_is_contained);
    sft::main_with_args();
}
