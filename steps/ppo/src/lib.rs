//! Step 3: PPO on the hybrid engine. Filled by the PPO issue; nothing here yet.
