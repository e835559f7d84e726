//! `reward`: step 2 (the reward model).

fn main() {
    hybrid_engine::runtime::init();
    hybrid_engine::runtime::contain_panics_when(data::panics::panic_is_contained);
    reward::main_with_args();
}
