//! Step 2: the reward model. Filled by the SFT/reward issue; nothing here yet.
