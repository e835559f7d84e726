//! `ppo`: step 3 (PPO).

fn main() {
    hybrid_engine::runtime::init();
    ppo::main_with_args();
}
