//! `reward`: step 2 (the reward model).

fn main() {
    hybrid_engine::runtime::init();
    reward::main_with_args();
}
