//! `sft`: step 1 (supervised fine-tuning), or GPT-2 pretraining with `--from-scratch`.

fn main() {
    hybrid_engine::runtime::init();
    sft::main_with_args();
}
