//! The headings `--help` groups the steps' options under, the same in every binary (`sft`,
//! `reward`, `ppo`, pretraining): each option names its heading (`help_heading`), and a test
//! checks that none is left under clap's bare "Options".

pub const DATA: &str = "Data";
pub const MODEL: &str = "Model";
pub const TRAINING: &str = "Training";
pub const OPTIMIZER: &str = "Optimizer";
pub const LORA: &str = "LoRA";
pub const ALGORITHM: &str = "Algorithm";
pub const REWARDS: &str = "Rewards";
pub const GENERATION: &str = "Generation (rollouts)";
pub const PARALLELISM: &str = "Parallelism, ZeRO and launch";
pub const PRECISION: &str = "Device and precision";
pub const EVALUATION: &str = "Evaluation";
pub const LOGGING: &str = "Logging and monitoring";
pub const OUTPUT: &str = "Output and checkpoints";
