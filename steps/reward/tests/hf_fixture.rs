//! What steps 1 and 2 save loads in transformers with our numbers: the committed fixture holds
//! `GPT2LMHeadModel` logits and `GPT2ForSequenceClassification` scores computed by transformers
//! on directories our code wrote (`scripts/fixtures/make_step_outputs_fixture.py`). Here we
//! rebuild the same directories, check they are byte-identical to what transformers read, load
//! them back with our loaders and compare.

use candle_core::{Device, Tensor};
use hybrid_engine::checkpoints::hf_io::load_model_dir;
use hybrid_engine::model::positions::Positions;
use hybrid_engine::model::reward_model::{RewardModel, SCORE_WEIGHT};
use hybrid_engine::ParamStore;
use reward::fixture::{fixture_models, save_fixture_models, FIXTURE_EOS};
use reward::loss::{batch_spans, end_scores};
use serde_json::Value;

fn fixture() -> Value {
    let text = include_str!("fixtures/step_outputs.json");
    serde_json::from_str(text).expect("fixture is JSON")
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

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn saved_actor_and_reward_model_give_transformers_logits_and_scores() -> anyhow::Result<()> {
    let fx = fixture();
    let dir = tempfile::tempdir()?;
    let (cfg, actor, rm) = fixture_models()?;
    save_fixture_models(dir.path(), &cfg, &actor, &rm)?;
    for (kind, key) in [("actor", "actor_weights_fnv1a64"), ("reward", "reward_weights_fnv1a64")] {
        let bytes = std::fs::read(dir.path().join(kind).join("model.safetensors"))?;
        assert_eq!(
            format!("{:016x}", data::cache::fnv1a64(&bytes)),
            fx[key].as_str().unwrap_or_default(),
            "{kind}/model.safetensors differs from the file transformers read: regenerate the fixture"
        );
    }
    let ids: Vec<Vec<u32>> = serde_json::from_value(fx["input_ids"].clone())?;
    let (b, t) = (ids.len(), ids[0].len());
    let flat: Vec<u32> = ids.concat();
    let input = Tensor::from_slice(&flat, (b, t), &Device::Cpu)?;

    // The actor, read back as any step reads a model directory.
    let files = load_model_dir(&dir.path().join("actor"), &Device::Cpu)?;
    let model = ParamStore::from_tensors(&files.config, &files.tensors, &Device::Cpu)?.model(&files.config)?;
    let logits = model.forward(&input, &Positions::default(), None, None)?;
    let d = max_abs_diff(&logits.flatten_all()?.to_vec1()?, &floats(&fx["actor_logits"]));
    println!("actor logits: max |ours - transformers| = {d:e}");
    assert!(d < 1e-5, "actor logits differ by {d}");

    // The reward model: every token's score, and the pooled score at the last non-pad token.
    let files = load_model_dir(&dir.path().join("reward"), &Device::Cpu)?;
    assert_eq!(files.config.extra["architectures"][0], "GPT2ForSequenceClassification");
    assert_eq!(files.config.extra["pad_token_id"], FIXTURE_EOS);
    let mut params = ParamStore::from_tensors(&files.config, &files.tensors, &Device::Cpu)?;
    params.push(SCORE_WEIGHT, &files.extra_tensors[SCORE_WEIGHT])?;
    let rm = RewardModel::new(&params, &files.config)?;
    let scores = rm.token_scores(&rm.trunk.forward_blocks(&input, &Positions::default(), None, None)?)?;
    let d = max_abs_diff(&scores.flatten_all()?.to_vec1()?, &floats(&fx["reward_token_scores"]));
    println!("reward token scores: max |ours - transformers| = {d:e}");
    assert!(d < 1e-5, "token scores differ by {d}");
    // Our reported score (DS-Chat's: the token before the first pad) is where transformers pools.
    // Pair the rows with themselves: end_scores takes chosen rows then rejected rows.
    let doubled: Vec<u32> = [flat.clone(), flat].concat();
    let spans = batch_spans(&doubled, b, t, FIXTURE_EOS);
    let (ours, _) = end_scores(&Tensor::cat(&[&scores, &scores], 0)?, &spans)?;
    let d = max_abs_diff(&ours.to_vec1()?, &floats(&fx["reward_scores"]));
    println!("pooled reward scores: max |ours - transformers| = {d:e}");
    assert!(d < 1e-5, "pooled scores differ by {d}");
    Ok(())
}
