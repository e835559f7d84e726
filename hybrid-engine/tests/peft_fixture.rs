//! PEFT loads our adapters and reproduces our numbers: the committed fixture holds the logits
//! and token scores that `peft.PeftModel.from_pretrained` computed from a base directory and two
//! adapter directories our code wrote (`scripts/fixtures/make_peft_fixture.py`). Here we rebuild
//! the same files, check they are byte-identical to what PEFT read, read them back with our
//! loaders and compare both our unfused (training) and fused (merged) forwards with PEFT's.

#[path = "peft/models.rs"]
mod models;

use anyhow::Result;
use candle_core::{Device, Tensor};
use hybrid_engine::checkpoints::hf_io::load_model_dir;
use hybrid_engine::lora::peft::{load_peft_adapter, ADAPTER_WEIGHTS};
use hybrid_engine::model::positions::Positions;
use hybrid_engine::model::reward_model::{RewardModel, SCORE_WEIGHT};
use hybrid_engine::ParamStore;
use serde_json::Value;

fn fixture() -> Value {
    serde_json::from_str(include_str!("fixtures/peft_adapter.json")).expect("fixture is JSON")
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("array")
        .iter()
        .flat_map(|x| match x {
            Value::Array(_) => floats(x),
            _ => vec![x.as_f64().expect("number") as f32],
        })
        .collect()
}

fn max_abs_diff(ours: &Tensor, theirs: &[f32]) -> Result<f32> {
    let ours: Vec<f32> = ours.flatten_all()?.to_vec1()?;
    assert_eq!(ours.len(), theirs.len());
    Ok(ours.iter().zip(theirs).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max))
}

#[test]
fn peft_applies_our_adapters_with_our_logits_and_scores() -> Result<()> {
    let fx = fixture();
    let dir = tempfile::tempdir()?;
    models::save_peft_fixture(dir.path(), &models::peft_fixture()?)?;
    for (file, key) in [
        ("base/model.safetensors", "base_weights_fnv1a64"),
        (&format!("adapter_lm/{ADAPTER_WEIGHTS}"), "lm_adapter_fnv1a64"),
        (&format!("adapter_rm/{ADAPTER_WEIGHTS}"), "rm_adapter_fnv1a64"),
    ] {
        let bytes = std::fs::read(dir.path().join(file))?;
        assert_eq!(
            format!("{:016x}", hybrid_engine::lora::fnv1a64(&bytes)),
            fx[key].as_str().unwrap_or_default(),
            "{file} differs from the file PEFT read: regenerate the fixture"
        );
    }
    let ids: Vec<Vec<u32>> = serde_json::from_value(fx["input_ids"].clone())?;
    let input = Tensor::from_slice(&ids.concat(), (ids.len(), ids[0].len()), &Device::Cpu)?;
    let d = Device::Cpu;
    let base = load_model_dir(&dir.path().join("base"), &d)?;
    let cfg = &base.config;

    // The causal LM adapter (DS-Chat scaling 1/r, every linear).
    let lm = load_peft_adapter(&dir.path().join("adapter_lm"), &d)?;
    let mut params = ParamStore::from_tensors(cfg, &base.tensors, &d)?;
    params.add_adapters(lm.scaling(), &lm.adapters)?;
    let want = floats(&fx["lm_logits"]);
    let forward =
        |p: &ParamStore| -> Result<Tensor> { Ok(p.model(cfg)?.forward(&input, &Positions::default(), None, None)?) };
    let unfused = max_abs_diff(&forward(&params)?, &want)?;
    let fused = max_abs_diff(&forward(&params.merged()?)?, &want)?;
    println!(
        "LM logits vs PEFT: unfused max |diff| = {unfused:e}, fused {fused:e} (adapter effect {})",
        fx["lm_adapter_effect"]
    );
    assert!(unfused < 1e-5 && fused < 1e-5, "LM logits differ from PEFT's: unfused {unfused}, fused {fused}");

    // The reward-model adapter (alpha/r, MLPs only, the score head in modules_to_save).
    let rm = load_peft_adapter(&dir.path().join("adapter_rm"), &d)?;
    assert_eq!(rm.task_type, "SEQ_CLS");
    let mut params = ParamStore::from_tensors(cfg, &base.tensors, &d)?;
    let (head_name, head) = &rm.modules_to_save[0];
    assert_eq!(head_name, SCORE_WEIGHT);
    params.push(SCORE_WEIGHT, head)?;
    params.add_adapters(rm.scaling(), &rm.adapters)?;
    let scores = |p: &ParamStore| -> Result<Tensor> {
        let model = RewardModel::new(p, cfg)?;
        Ok(model.token_scores(&model.trunk.forward_blocks(&input, &Positions::default(), None, None)?)?)
    };
    let want = floats(&fx["rm_token_scores"]);
    let unfused = max_abs_diff(&scores(&params)?, &want)?;
    let fused = max_abs_diff(&scores(&params.merged()?)?, &want)?;
    println!("reward token scores vs PEFT: unfused max |diff| = {unfused:e}, fused {fused:e}");
    assert!(unfused < 1e-5 && fused < 1e-5, "token scores differ from PEFT's: unfused {unfused}, fused {fused}");
    Ok(())
}
