//! `ppo`: step 3 (PPO).

fn main() {
    hybrid_engine::runtime::init();
    hybrid_engine::runtime::contain_panics_when(data::panics::panic_is_contained);
    ppo::main_with_args();
}
