//! Checks the CUDA path against the CPU on the same weights, one line per check, and exits 1 if
//! any fails (scripts/gpu-check.sh runs it on the GPU machine):
//!
//! - `logits`: fp32 logits of a (2, T) batch, CUDA against CPU (max |diff| <= 1e-4);
//! - `grads`: the LM loss and the gradient of every parameter (each max |diff| <= 1e-4 of that
//!   gradient's largest value; a parameter without a gradient fails);
//! - `logits-bf16`, `logits-fp16`: the model in half precision on CUDA against fp32 on the CPU
//!   (max |diff| <= 5% of the largest logit: rounding, not a wrong kernel);
//! - `generate`: greedy generation with the KV cache, the same tokens on both devices;
//! - `nccl`: a one-rank NCCL communicator's all-reduce, reduce-scatter, all-gather and broadcast
//!   on a CUDA tensor (the identity at world size 1: NCCL loads, and its calls go through).
//!
//! Usage: `gpu_check [--model tiny|gpt2|gpt2-medium | --path MODEL_DIR] [--device cuda:N] [--seq T]`
//! (default: a random-init gpt2, cuda:0, T = 128).

use anyhow::{anyhow, bail, Result};
use candle_core::{DType, Device, Tensor};
use hybrid_engine::checkpoints::hf_io::{load_model_dir, resolve_model_dir};
use hybrid_engine::generation::generate::{generate, SamplingConfig};
use hybrid_engine::model::gpt2::Positions;
use hybrid_engine::{Gpt2Config, ParamStore};

struct Args {
    model: String,
    path: Option<String>,
    device: String,
    seq: usize,
}

fn parse_args() -> Result<Args> {
    let mut args = Args { model: "gpt2".into(), path: None, device: "cuda:0".into(), seq: 128 };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| anyhow!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => args.model = value()?,
            "--path" => args.path = Some(value()?),
            "--device" => args.device = value()?,
            "--seq" => args.seq = value()?.parse().map_err(|_| anyhow!("--seq takes a number of tokens"))?,
            _ => bail!("unknown flag {flag}: gpu_check [--model NAME | --path MODEL_DIR] [--device cuda:N] [--seq T]"),
        }
    }
    Ok(args)
}

/// The largest |a - b| and the largest |b|, over all elements (both moved to the CPU as f32).
fn max_diff(a: &Tensor, b: &Tensor) -> Result<(f32, f32)> {
    let a = a.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?;
    let b = b.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.flatten_all()?;
    let diff = (&a - &b)?.abs()?.max(0)?.to_scalar::<f32>()?;
    Ok((diff, b.abs()?.max(0)?.to_scalar::<f32>()?))
}

/// Prints one check's line; returns whether it passed.
fn report(name: &str, pass: bool, detail: String) -> bool {
    println!("{} {name}: {detail}", if pass { "PASS" } else { "FAIL" });
    pass
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let cuda = hybrid_engine::device::parse_device(&args.device)?;
    let cpu = Device::Cpu;
    let (cfg, tensors) = match &args.path {
        Some(p) => {
            let files = load_model_dir(&resolve_model_dir(p)?, &cpu)?;
            (files.config, files.tensors)
        }
        None => {
            let cfg = Gpt2Config::from_preset(&args.model).ok_or_else(|| anyhow!("no model preset {}", args.model))?;
            let tensors = ParamStore::init(&cfg, 1234, &cpu)?.tensors();
            (cfg, tensors)
        }
    };
    let what = args.path.clone().unwrap_or_else(|| format!("random-init {}", args.model));
    println!(
        "gpu_check: {what}, {} parameters, {} against cpu",
        cfg.checked_parameter_count().unwrap_or(0),
        args.device
    );
    let on_cpu = ParamStore::from_tensors(&cfg, &tensors, &cpu)?;
    let on_gpu = ParamStore::from_tensors(&cfg, &tensors, &cuda)?;
    let (m_cpu, m_gpu) = (on_cpu.model(&cfg)?, on_gpu.model(&cfg)?);

    let (b, t) = (2, args.seq.min(cfg.n_positions));
    let vocab = cfg.vocab_size.min(50257) as u32;
    let ids: Vec<u32> = (0..(b * t) as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let targets: Vec<u32> = ids.iter().map(|i| (i * 31 + 7) % vocab).collect();
    let ids_cpu = Tensor::from_vec(ids, (b, t), &cpu)?;
    let targets_cpu = Tensor::from_vec(targets, (b, t), &cpu)?;
    let (ids_gpu, targets_gpu) = (ids_cpu.to_device(&cuda)?, targets_cpu.to_device(&cuda)?);
    let mut ok = true;

    let logits_cpu = m_cpu.forward(&ids_cpu, &Positions::default(), None, None)?;
    let logits_gpu = m_gpu.forward(&ids_gpu, &Positions::default(), None, None)?;
    let (d, scale) = max_diff(&logits_gpu, &logits_cpu)?;
    ok &= report(
        "logits",
        d <= 1e-4,
        format!("fp32 {:?}: max |diff| {d:.3e} (largest |logit| {scale:.3})", logits_cpu.dims()),
    );

    let loss_cpu = m_cpu.lm_loss(&ids_cpu, &targets_cpu, None)?;
    let loss_gpu = m_gpu.lm_loss(&ids_gpu, &targets_gpu, None)?;
    let (g_cpu, g_gpu) = (loss_cpu.backward()?, loss_gpu.backward()?);
    let (l_cpu, l_gpu) = (loss_cpu.to_scalar::<f32>()?, loss_gpu.to_device(&cpu)?.to_scalar::<f32>()?);
    let (mut worst, mut worst_name, mut missing) = (0f32, String::new(), vec![]);
    for ((name, v_cpu), (_, v_gpu)) in on_cpu.iter().zip(on_gpu.iter()) {
        let (Some(gc), Some(gg)) = (g_cpu.get(v_cpu.as_tensor()), g_gpu.get(v_gpu.as_tensor())) else {
            missing.push(name.to_string());
            continue;
        };
        let (d, scale) = max_diff(gg, gc)?;
        let rel = d / scale.max(f32::MIN_POSITIVE);
        if rel > worst {
            (worst, worst_name) = (rel, name.to_string());
        }
    }
    let loss_ok = (l_cpu - l_gpu).abs() <= 1e-4 * l_cpu.abs().max(1.0);
    ok &= report(
        "grads",
        loss_ok && worst <= 1e-4 && missing.is_empty(),
        format!(
            "loss cpu {l_cpu:.6} cuda {l_gpu:.6}; worst gradient {worst_name}: max |diff| / max |grad| {worst:.3e}; \
             {} of {} parameters without a gradient {missing:?}",
            missing.len(),
            on_cpu.names.len()
        ),
    );

    for (label, dtype) in [("logits-bf16", DType::BF16), ("logits-fp16", DType::F16)] {
        let half = on_gpu.compute_copy(dtype)?.model(&cfg)?;
        let logits = half.forward(&ids_gpu, &Positions::default(), None, None)?;
        let (d, scale) = max_diff(&logits, &logits_cpu)?;
        ok &= report(
            label,
            d <= 0.05 * scale,
            format!("max |diff| {d:.3e} against fp32 cpu (largest |logit| {scale:.3})"),
        );
    }

    let prompts: Vec<Vec<u32>> = vec![(1..9).collect(), (100..104).collect()];
    let greedy = SamplingConfig::greedy(24, None, 0, cfg.vocab_size);
    let (tok_cpu, tok_gpu) = (generate(&m_cpu, &prompts, &greedy, &cpu)?, generate(&m_gpu, &prompts, &greedy, &cuda)?);
    ok &= report(
        "generate",
        tok_cpu == tok_gpu,
        format!("greedy, 2 prompts x 24 tokens: cpu {tok_cpu:?} cuda {tok_gpu:?}"),
    );

    ok &= nccl_check(&cuda)?;
    if !ok {
        bail!("gpu_check: some checks failed");
    }
    println!("gpu_check: all passed");
    Ok(())
}

#[cfg(feature = "nccl")]
fn nccl_check(device: &Device) -> Result<bool> {
    use hybrid_engine::comm::nccl::NcclComm;
    if !device.is_cuda() {
        return Ok(report("nccl", true, "skipped: not a CUDA device".into()));
    }
    use hybrid_engine::comm::tcp::{ReduceOp, TcpRing};
    let comm = NcclComm::new(&TcpRing::single(), device)?;
    let x = Tensor::arange(0f32, 1024.0, device)?;
    let outs = [
        ("all-reduce", comm.all_reduce(&x, ReduceOp::Sum)?),
        ("reduce-scatter", comm.reduce_scatter(&x)?),
        ("all-gather", comm.all_gather(&x)?),
        ("broadcast", comm.broadcast(&x, 0)?),
    ];
    let mut pass = true;
    let mut detail = vec![];
    for (name, out) in &outs {
        let (d, _) = max_diff(out, &x)?;
        pass &= d == 0.0 && out.dims() == x.dims();
        detail.push(format!("{name} {:?} max |diff| {d}", out.dims()));
    }
    Ok(report("nccl", pass, format!("one rank: {}", detail.join(", "))))
}

#[cfg(not(feature = "nccl"))]
fn nccl_check(_: &Device) -> Result<bool> {
    Ok(report("nccl", true, "skipped: built without the nccl feature".into()))
}
