//! The small models of the transformers fixture: a seeded GPT-2 of an unusual shape saved as our
//! step 1 saves its actor and as our step 2 saves a reward model. Shared by the example that
//! writes them for the Python script and by the test that compares our outputs with
//! transformers'.

use anyhow::Result;
use candle_core::Device;
use hybrid_engine::checkpoints::resume::save_model_dir;
use hybrid_engine::model::gpt2::Gpt2Config;
use hybrid_engine::model::reward_model::{add_score_head, causal_lm_config, sequence_classification_config};
use hybrid_engine::ParamStore;
use std::path::Path;

/// The fixture's EOS and pad id (the last row of its small vocabulary).
pub const FIXTURE_EOS: u32 = 95;

/// (config, actor parameters, reward parameters with `score.weight`), all seeded.
pub fn fixture_models() -> Result<(Gpt2Config, ParamStore, ParamStore)> {
    let cfg = Gpt2Config {
        vocab_size: 96,
        bos_token_id: Some(FIXTURE_EOS),
        eos_token_id: Some(FIXTURE_EOS),
        ..Gpt2Config::tiny().with_shape(Some(2), Some(48), Some(3), Some(24))
    };
    let actor = ParamStore::init(&cfg, 11, &Device::Cpu)?;
    let mut rm = ParamStore::init(&cfg, 12, &Device::Cpu)?;
    add_score_head(&mut rm, &cfg, 12, &Device::Cpu)?;
    // Lift the zero biases and unit LayerNorm gains a little, so a dropped bias or a wrong
    // LayerNorm shows in the comparison.
    for (store, salt) in [(&actor, 1.0f64), (&rm, 2.0)] {
        for (i, (name, var)) in store.iter().enumerate() {
            if name.ends_with(".bias") || name.contains("ln_") {
                let n = var.elem_count();
                let bump: Vec<f32> =
                    (0..n).map(|k| (((k * 7 + i * 13) % 17) as f64 * 0.01 * salt - 0.08) as f32).collect();
                let t = (var.as_tensor() + candle_core::Tensor::from_vec(bump, var.shape(), &Device::Cpu)?)?;
                var.set(&t)?;
            }
        }
    }
    Ok((cfg, actor, rm))
}

/// Saves `dir/actor` (GPT2LMHeadModel) and `dir/reward` (GPT2ForSequenceClassification).
pub fn save_fixture_models(dir: &Path, cfg: &Gpt2Config, actor: &ParamStore, rm: &ParamStore) -> Result<()> {
    save_model_dir(&dir.join("actor"), &causal_lm_config(cfg), actor, &|_| Ok(()))?;
    save_model_dir(&dir.join("reward"), &sequence_classification_config(cfg, FIXTURE_EOS), rm, &|_| Ok(()))
}
