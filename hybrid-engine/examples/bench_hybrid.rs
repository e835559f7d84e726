//! Generation in the hybrid engine's mode versus a naive path, the comparison DS-Chat made for
//! its hybrid engine (it reported up to 9x over HF generate with LoRA on OPT-1.3b):
//!
//! * hybrid: once per rollout, LoRA fused into the weights and dropout off
//!   (`GenerationMode::model`), then KV-cache generation into a cache kept across rollouts;
//! * naive: the training view of the model (LoRA unfused, its two extra matmuls per linear), and
//!   for every new token a full forward over the whole sequence (no KV cache).
//!
//! Both decode greedily with EOS disabled and must produce the same tokens (checked). Reports the
//! median over `--reps` rollouts after one warmup: `tokens_per_s` = B * N / rollout time.
//! Output: one JSON line per path.
//!
//! Run: `cargo run --release -p hybrid-engine --example bench_hybrid -- --model tiny --batch 16
//! --prompt-len 24 --new-tokens 16 --lora-dim 8 --reps 3`.

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor, D};
use hybrid_engine::generation::generate::{LeftPadded, SamplingConfig};
use hybrid_engine::generation::mode::GenerationMode;
use hybrid_engine::model::gpt2::{Gpt2, GPT2_VOCAB};
use hybrid_engine::model::positions::Positions;
use hybrid_engine::{Gpt2Config, ParamStore};
use std::time::Instant;

struct Args {
    model: String,
    batch: usize,
    prompt_len: usize,
    new_tokens: usize,
    lora_dim: usize,
    reps: usize,
}

fn parse() -> Result<Args> {
    let mut a = Args { model: "tiny".into(), batch: 16, prompt_len: 24, new_tokens: 16, lora_dim: 8, reps: 3 };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    for pair in argv.chunks(2) {
        let value = pair.get(1).with_context(|| format!("{} needs a value", pair[0]))?;
        match pair[0].as_str() {
            "--model" => a.model = value.clone(),
            "--batch" => a.batch = value.parse()?,
            "--prompt-len" => a.prompt_len = value.parse()?,
            "--new-tokens" => a.new_tokens = value.parse()?,
            "--lora-dim" => a.lora_dim = value.parse()?,
            "--reps" => a.reps = value.parse()?,
            other => bail!("unknown flag {other}"),
        }
    }
    Ok(a)
}

/// Greedy decoding without a KV cache: a full forward over the whole sequence per new token.
fn naive_generate(model: &Gpt2, prompts: &LeftPadded, new_tokens: usize, device: &Device) -> Result<Vec<Vec<u32>>> {
    let (b, p) = (prompts.b, prompts.p);
    let mut rows: Vec<Vec<u32>> = prompts.ids.chunks(p).map(<[u32]>::to_vec).collect();
    let mut mask: Vec<Vec<u32>> = prompts.mask.chunks(p).map(<[u32]>::to_vec).collect();
    for _ in 0..new_tokens {
        let t = rows[0].len();
        let flat_mask: Vec<u32> = mask.concat();
        let ids = Tensor::from_vec(rows.concat(), (b, t), device)?;
        let m = Tensor::from_vec(flat_mask.clone(), (b, t), device)?;
        let pos =
            Tensor::from_vec(hybrid_engine::generation::generate::position_ids(&flat_mask, b, t), (b, t), device)?;
        let logits =
            model.forward(&ids, &Positions { position_ids: Some(&pos), attention_mask: Some(&m) }, None, None)?;
        let last = logits.narrow(1, t - 1, 1)?.squeeze(1)?.narrow(D::Minus1, 0, GPT2_VOCAB)?; // (B, V)
        let next: Vec<u32> = last.argmax(D::Minus1)?.to_vec1()?;
        for (r, tok) in next.into_iter().enumerate() {
            rows[r].push(tok);
            mask[r].push(1);
        }
    }
    Ok(rows.into_iter().map(|r| r[p..].to_vec()).collect())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    hybrid_engine::runtime::init();
    let args = parse()?;
    let device = Device::Cpu;
    let mut cfg = Gpt2Config::from_preset(&args.model).with_context(|| format!("unknown preset {}", args.model))?;
    cfg.pad_vocab(128);
    let mut params = ParamStore::init(&cfg, 1234, &device)?;
    if args.lora_dim > 0 {
        let lora = lora::LoraConfig { dim: args.lora_dim, alpha: None, module_name: "h.".into() };
        params.add_lora(&cfg, &lora, 7)?;
        for (name, var) in params.iter() {
            if name.ends_with("lora_B.weight") {
                var.set(&Tensor::randn(0f32, 0.02, var.shape(), &device)?)?; // trained adapters are non-zero
            }
        }
    }
    let prompts: Vec<Vec<u32>> = (0..args.batch)
        .map(|r| (0..args.prompt_len).map(|i| ((r * 7919 + i * 104729) % 50000) as u32).collect())
        .collect();
    let padded = LeftPadded::new(&prompts, args.prompt_len, 50256);
    let sampling = SamplingConfig::greedy(args.new_tokens, None, 50256, GPT2_VOCAB);

    let mut engine = GenerationMode::new(args.prompt_len, args.new_tokens, false);
    let hybrid = |engine: &mut GenerationMode| -> Result<(f64, Vec<Vec<u32>>)> {
        let t0 = Instant::now();
        let model = engine.model(&params, &cfg)?; // once per rollout: fuse LoRA, dropout off
        let out = engine.generate(&model, &padded, &sampling, &device)?;
        Ok((t0.elapsed().as_secs_f64(), out.tokens))
    };
    let training_view =
        params.model(&Gpt2Config { resid_pdrop: 0.0, embd_pdrop: 0.0, attn_pdrop: 0.0, ..cfg.clone() })?;
    let naive = || -> Result<(f64, Vec<Vec<u32>>)> {
        let t0 = Instant::now();
        let out = naive_generate(&training_view, &padded, args.new_tokens, &device)?;
        Ok((t0.elapsed().as_secs_f64(), out))
    };

    let (_, reference) = hybrid(&mut engine)?; // warmup
    let (_, naive_tokens) = naive()?;
    if reference != naive_tokens {
        bail!("the hybrid and naive paths generated different tokens");
    }
    let tokens = (args.batch * args.new_tokens) as f64;
    for (path, secs) in [
        ("hybrid", median((0..args.reps).map(|_| hybrid(&mut engine).map(|r| r.0)).collect::<Result<_>>()?)),
        ("naive", median((0..args.reps).map(|_| naive().map(|r| r.0)).collect::<Result<_>>()?)),
    ] {
        println!(
            "{}",
            serde_json::json!({
                "path": path, "model": args.model, "batch": args.batch, "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens, "lora_dim": args.lora_dim, "secs_per_rollout": secs,
                "tokens_per_s": tokens / secs,
            })
        );
    }
    Ok(())
}
