//! Writes our logits for a model directory, for `scripts/fixtures/make_gpt2_parity.py check-ours`
//! to compare against transformers loading the same directory:
//! `cargo run --release -p hybrid-engine --example dump_logits -- MODEL_DIR OUT.safetensors`.

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use hybrid_engine::checkpoints::hf_io::{load_model_dir, resolve_model_dir};
use hybrid_engine::model::positions::Positions;
use hybrid_engine::ParamStore;
use std::collections::HashMap;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 3 {
        bail!("usage: dump_logits MODEL_DIR OUT.safetensors");
    }
    let dir = resolve_model_dir(&args[1])?;
    let files = load_model_dir(&dir, &Device::Cpu)?;
    let params = ParamStore::from_tensors(&files.config, &files.tensors, &Device::Cpu)?;
    let model = params.model(&files.config)?;
    let (b, t) = (2, 12.min(files.config.n_positions));
    let vocab = files.config.vocab_size.min(50257) as u32;
    let ids: Vec<u32> = (0..(b * t) as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let ids = Tensor::from_vec(ids, (b, t), &Device::Cpu)?;
    let logits = model.forward(&ids, &Positions::default(), None, None)?;
    let out = HashMap::from([("input_ids".to_string(), ids.to_dtype(DType::I64)?), ("logits".to_string(), logits)]);
    candle_core::safetensors::save(&out, &args[2])?;
    println!("wrote logits {:?} of {} to {}", out["logits"].dims(), dir.display(), args[2]);
    Ok(())
}
