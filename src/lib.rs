//! The user-facing binaries' logic: `chat` (talk to a trained model), `prompt_eval` and the
//! `train` launcher.
//! Each binary's `main` only parses flags, calls `run` and maps errors to exit code 2.

pub mod chat;
pub mod hostfile;
pub mod inference_ranks;
pub mod launcher;
pub mod nodes;
pub mod plot;
pub mod ranks;
pub mod report;
pub mod wandb_sync;
