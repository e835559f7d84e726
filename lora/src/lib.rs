//! LoRA adapters (DS-Chat convention). Filled by the step-3 issue; nothing here yet.
