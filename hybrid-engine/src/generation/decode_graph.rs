//! Decoding on a GPU without the host in each step: the decoding step captured once as a CUDA
//! graph and replayed for every token (issue 43: at batch 32 a token of gpt2 took 1.43 ms of
//! launches on the host for a step the GPU computes in less).
//!
//! A replayed graph runs the kernels with the arguments they were captured with, so nothing in
//! the step may depend on a number the host knows: the KV cache's length is a u32 on the device
//! (the cache's kernels read it, `ops::CacheStart::Device`), the attention's mask a buffer over the
//! cache's whole capacity, the input tokens and positions fixed buffers, and the step ends with
//! `ops::advance_decoding`, which does on the device what generate.rs's loop does on the host
//! between two steps (finished rows get the pad token; each step's tokens and log-probabilities
//! recorded; the next input; the next uniform draws). Sampling's draws are drawn on the host
//! before the first step, each row's from its own stream in the order the host loop draws them
//! (a running row takes one a step), so the graph samples the host loop's tokens. The host reads
//! how many rows are still running every [`CHECK_EVERY`] steps (a stop test four bytes long),
//! and the tokens once at the end.
//!
//! The prompt's step runs as before (its shape is the prompt's), and the first decoding step runs
//! the graph's code without capture: it loads the kernels, makes cuBLAS's plans and fills
//! candle's cache of small uploads, none of which may happen during a capture. Every tensor the
//! step makes is dropped inside it, so the graph's allocations are its own (freed within it);
//! what outlives a step is in the fixed buffers. Where the capture fails, the steps go on without
//! a graph (the same code, launched from the host), after a one-line warning.
//!
//! Opt-in (`HYBRID_ENGINE_DECODE_GRAPH=1`) until measured on a GPU. The same loop runs on the
//! CPU in f32, without a graph (the decoding ops' CPU forwards): its tests hold the bookkeeping to
//! the host loop's without a GPU.

// Without CUDA only the tests run the loop (on the CPU).
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use crate::generation::batch::{row_rng, Generation, LeftPadded, SamplingConfig};
use crate::kernels::ops::{self, DecodeState};
use crate::model::gpt2::{Gpt2, Gpt2Cache};
use crate::model::positions::{Positions, MASKED};
#[cfg(feature = "cuda")]
use anyhow::anyhow;
use anyhow::Result;
#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::{result, sys, CudaGraph, CudaStream};
use candle_core::{DType, Device, Tensor};
use rand::Rng;
#[cfg(feature = "cuda")]
use std::sync::Arc;

/// Steps between two reads of the rows still running: at most this many steps are made after
/// every row has stopped (their tokens are the pad token and are not kept).
pub const CHECK_EVERY: usize = 8;

/// Decoding steps replayed from a graph in this process (tests and benchmarks read it: a
/// failed capture decodes the same tokens without one).
pub static REPLAYED_STEPS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Whether generation on a GPU decodes through a CUDA graph (`HYBRID_ENGINE_DECODE_GRAPH=1`).
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("HYBRID_ENGINE_DECODE_GRAPH").is_ok_and(|v| v == "1"))
}

/// [`crate::generation::generate::generate_observed`] with the decoding steps replayed from a
/// CUDA graph, or `None` where it does not apply (not a GPU, a model the fused decoding blocks do
/// not compute, a rollout the cache cannot hold: the host loop then runs, and says why if
/// anything is wrong). The same tokens and log-probabilities as the host loop.
pub fn generate(
    model: &Gpt2,
    batch: &LeftPadded,
    cfg: &SamplingConfig,
    cache: &mut Gpt2Cache,
    device: &Device,
    on_token: &mut dyn FnMut(),
) -> Result<Option<Generation>> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = device {
        return decode_with_state_in_memory(model, batch, cfg, cache, device, on_token, Some(cuda));
    }
    let _ = (model, batch, cfg, cache, device, on_token);
    Ok(None)
}

/// The GPU's device for the capture, or none: the steps launched from the host (the CPU runs
/// them so, in f32, to test the bookkeeping without a GPU).
#[cfg(feature = "cuda")]
type Capture<'a> = Option<&'a candle_core::CudaDevice>;
#[cfg(not(feature = "cuda"))]
type Capture<'a> = Option<&'a std::convert::Infallible>;

/// [`generate`]'s decoding: the state in memory on `device`, each step replayed from a graph
/// captured on `capture`'s GPU after the first, or launched from the host without one.
fn decode_with_state_in_memory(
    model: &Gpt2,
    batch: &LeftPadded,
    cfg: &SamplingConfig,
    cache: &mut Gpt2Cache,
    device: &Device,
    on_token: &mut dyn FnMut(),
    capture_on: Capture,
) -> Result<Option<Generation>> {
    let (b, p, n_pos) = (batch.b, batch.p, model.cfg.max_positions());
    if b == 0 || p == 0 || p >= n_pos {
        return Ok(None);
    }
    let steps = cfg.max_new_tokens.min(n_pos - p);
    let capacity = cache.capacity();
    if steps == 0 || capacity < p + steps {
        return Ok(None);
    }
    let bias = mask_over_capacity(batch, capacity, device)?;
    let fused = match device {
        Device::Cpu => model.fuses_decoding_blocks() && model.dtype() == DType::F32,
        _ => model.decodes_fused_on_cuda(&bias, None),
    };
    if !fused {
        return Ok(None);
    }
    let state = decode_state(batch, cfg, steps, device)?;

    // The prompt: its own shape, run as the host loop runs it, then its picks advanced in
    // memory as every later step's are.
    cache.reset();
    let input = Tensor::from_slice(&batch.ids, (b, p), device)?;
    let positions = Tensor::from_vec(batch.position_ids(), (b, p), device)?;
    let mask = Tensor::from_slice(&batch.mask, (b, p), &Device::Cpu)?;
    let prompt = Positions { position_ids: Some(&positions), attention_mask: Some(&mask) };
    let hidden = model.forward_blocks(&input, &prompt, Some(&mut *cache), None)?; // (B, P, C)
    pick_and_advance(model, &hidden.narrow(1, p - 1, 1)?.squeeze(1)?, cfg, &state, p)?;
    drop((hidden, input, positions));
    on_token();

    let start = state.state.narrow(0, 0, 1)?;
    let step = |cache: &mut Gpt2Cache| -> Result<()> {
        let hidden = model.decoding_step_at(&state.ids, &state.positions, &start, &bias, cache)?; // (B, 1, C)
        pick_and_advance(model, &hidden.squeeze(1)?, cfg, &state, p)
    };
    #[cfg(feature = "cuda")]
    let _cached_uploads = capture_on.map(|cuda| cuda.enable_cuda_graph_htod_cache());
    #[cfg(feature = "cuda")]
    let mut graph: Option<CudaGraph> = None;
    let mut made = 1;
    while made < steps {
        if (made == 1 || made.is_multiple_of(CHECK_EVERY)) && running(&state)? == 0 {
            break;
        }
        #[cfg(feature = "cuda")]
        let replayed = match &graph {
            Some(graph) => {
                graph.launch().map_err(|e| anyhow!("replaying the decoding step's CUDA graph: {e:?}"))?;
                REPLAYED_STEPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                true
            }
            None => false,
        };
        #[cfg(not(feature = "cuda"))]
        let replayed = false;
        if !replayed {
            step(cache)?;
        }
        made += 1;
        on_token();
        #[cfg(feature = "cuda")]
        if let Some(cuda) = capture_on.filter(|_| made == 2 && made < steps) {
            // The first decoding step ran the code: its kernels are loaded and its uploads cached.
            match capture(&cuda.cuda_stream(), || step(cache)) {
                Ok(captured) => {
                    static SAID: std::sync::Once = std::sync::Once::new();
                    SAID.call_once(|| {
                        println!("decoding: each step replayed from a CUDA graph (HYBRID_ENGINE_DECODE_GRAPH=1)")
                    });
                    graph = Some(captured);
                }
                Err(e) => eprintln!("warning: decoding without a CUDA graph (its capture failed: {e})"),
            }
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = capture_on;
    cache.set_len(p + made - 1)?;
    Ok(Some(generation_of(&state, made, cfg)?))
}

/// The additive mask every decoding step reads, (B, 1, 1, capacity) f32: the prompt's padding
/// masked, every later position (the answers, one a step, all real) visible; a step reads it up
/// to the positions cached.
fn mask_over_capacity(batch: &LeftPadded, capacity: usize, device: &Device) -> Result<Tensor> {
    let (b, p) = (batch.b, batch.p);
    let mut bias = vec![0f32; b * capacity];
    for (row, mask) in bias.chunks_mut(capacity).zip(batch.mask.chunks(p)) {
        for (value, &real) in row.iter_mut().zip(mask) {
            if real == 0 {
                *value = MASKED;
            }
        }
    }
    Ok(Tensor::from_vec(bias, (b, 1, 1, capacity), device)?)
}

/// The decoding state before the prompt's step: no row done, the cache's length at the prompt's
/// (`ops::advance_decoding` sets it from the step), each row's position at its last prompt token
/// (`cumsum(mask) - 1`, which the step advances), and with sampling every step's draws.
fn decode_state(batch: &LeftPadded, cfg: &SamplingConfig, steps: usize, device: &Device) -> Result<DecodeState> {
    let (b, p) = (batch.b, batch.p);
    // A row without prompt tokens is at position u32::MAX, which the advance wraps to 0, as the
    // host loop's first decoding step is (its `sum(mask)`).
    let last_positions: Vec<u32> = batch.mask.chunks(p).map(|m| m.iter().sum::<u32>().wrapping_sub(1)).collect();
    let u32s = |values: Vec<u32>, shape: &[usize]| Tensor::from_vec(values, shape, device);
    let draws = match cfg.sampling_params() {
        None => None,
        Some(_) => {
            // Row r's draw for step s is its stream's s-th: a running row draws once a step.
            let mut all = vec![0f64; steps * b];
            for (r, &key) in batch.keys.iter().enumerate() {
                let mut rng = row_rng(cfg.seed, key);
                (0..steps).for_each(|s| all[s * b + r] = rng.random::<f64>());
            }
            let now = Tensor::from_slice(&all[..b], b, device)?;
            Some((now, Tensor::from_vec(all, (steps, b), device)?))
        }
    };
    Ok(DecodeState {
        ids: u32s(vec![cfg.pad_token_id; b], &[b, 1])?,
        positions: u32s(last_positions, &[b, 1])?,
        done: u32s(vec![0; b], &[b])?,
        state: u32s(vec![p as u32, 0, b as u32], &[3])?,
        tokens: Tensor::zeros((steps, b), DType::U32, device)?,
        logprobs: Tensor::zeros((steps, b), DType::F32, device)?,
        draws,
    })
}

/// The LM head on the last hidden state (B, C), each row's pick on the device (greedy, or
/// sampled with the step's draws) and the step advanced.
fn pick_and_advance(model: &Gpt2, last: &Tensor, cfg: &SamplingConfig, state: &DecodeState, p: usize) -> Result<()> {
    let logits = model.lm_head(last)?; // (B, V)
    let picks = match (cfg.sampling_params(), &state.draws) {
        (Some(params), Some((draws, _))) => ops::sample_pick_in_place(&logits, draws, &params)?,
        _ => ops::greedy_pick_in_place(&logits, cfg.vocab_limit)?,
    };
    Ok(ops::advance_decoding(&picks, state, p, cfg.pad_token_id, cfg.eos_token_id)?)
}

/// The rows still running after the last step (a read of four bytes, which waits for it).
fn running(state: &DecodeState) -> Result<u32> {
    Ok(state.state.narrow(0, 2, 1)?.to_vec1::<u32>()?[0])
}

/// `record` captured on `stream` as a CUDA graph, instantiated. Whatever happens in `record`, the
/// capture is ended, so that the stream runs work again: an invalidated capture makes every later
/// call on the stream fail, among them the frees of what `record` made, which cudarc stores in
/// the context and returns first from its next call (end_capture's included), so they are cleared
/// before the capture is ended, and it is ended again directly if it is still on.
#[cfg(feature = "cuda")]
fn capture(stream: &Arc<CudaStream>, record: impl FnOnce() -> Result<()>) -> Result<CudaGraph> {
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    stream.begin_capture(mode).map_err(|e| anyhow!("beginning the capture: {e:?}"))?;
    let recorded = record();
    let stored = stream.context().check_err();
    let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    if ended.is_err() {
        let _ = stream.context().check_err();
        let none = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        if stream.capture_status() != Ok(none) {
            // SAFETY: the stream is this device's; the graph it returns, if any, is destroyed here.
            if let Ok(graph) = unsafe { result::stream::end_capture(stream.cu_stream()) } {
                if !graph.is_null() {
                    let _ = unsafe { result::graph::destroy(graph) };
                }
            }
        }
    }
    recorded?;
    stored.map_err(|e| anyhow!("during the capture: {e:?}"))?;
    ended.map_err(|e| anyhow!("ending the capture: {e:?}"))?.ok_or_else(|| anyhow!("the capture recorded nothing"))
}

/// Each row's tokens and log-probabilities from the first `made` steps' records: up to and with
/// its EOS, as the host loop keeps them.
fn generation_of(state: &DecodeState, made: usize, cfg: &SamplingConfig) -> Result<Generation> {
    let tokens = state.tokens.narrow(0, 0, made)?.to_vec2::<u32>()?;
    let logprobs = state.logprobs.narrow(0, 0, made)?.to_vec2::<f32>()?;
    let b = tokens.first().map_or(0, Vec::len);
    let mut out = Generation { tokens: vec![Vec::new(); b], logprobs: vec![Vec::new(); b] };
    let mut done = vec![false; b];
    for (step_tokens, step_logprobs) in tokens.iter().zip(&logprobs) {
        for r in 0..b {
            if !done[r] {
                out.tokens[r].push(step_tokens[r]);
                out.logprobs[r].push(step_logprobs[r]);
                done[r] = cfg.eos_token_id == Some(step_tokens[r]);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generation::generate::generate_with_cache;

    /// The tests' rollouts: a small model's config, left-padded rows with their own streams (row
    /// 4 has no prompt token at all: every position padding, which the host loop starts at 0),
    /// more steps than the stop test's period, greedy and sampled settings.
    fn rollouts() -> (crate::Gpt2Config, LeftPadded, usize, [SamplingConfig; 3]) {
        let cfg = crate::Gpt2Config { n_layer: 2, vocab_size: 300, n_positions: 64, ..crate::Gpt2Config::tiny() };
        let prompts = vec![vec![5, 6, 7], vec![9], vec![1, 2, 3, 4, 5], vec![200, 3], vec![]];
        let batch = LeftPadded::new(&prompts, 5, 0).with_keys(vec![4, 9, 2, 7, 1]);
        let max_new = 3 * CHECK_EVERY + 2;
        let greedy = SamplingConfig::greedy(max_new, None, 0, cfg.vocab_size);
        let sampled = |temperature, top_k, top_p| SamplingConfig {
            temperature: Some(temperature),
            top_k,
            top_p,
            seed: 17,
            ..greedy.clone()
        };
        let settings = [greedy.clone(), sampled(1.0, Some(40), Some(0.9)), sampled(0.7, None, None)];
        (cfg, batch, max_new, settings)
    }

    /// `sampling` with its EOS at the token row 0 makes fourth without one (so that it stops
    /// early), and the host loop's generation under it.
    fn with_early_eos(
        model: &Gpt2,
        batch: &LeftPadded,
        sampling: &SamplingConfig,
        device: &Device,
    ) -> Result<(SamplingConfig, Generation)> {
        let host = |sampling: &SamplingConfig| {
            let mut cache = Gpt2Cache::new(&model.cfg, batch.p + sampling.max_new_tokens);
            generate_with_cache(model, batch, sampling, &mut cache, device)
        };
        let eos = host(sampling)?.tokens[0][3];
        let sampling = SamplingConfig { eos_token_id: Some(eos), ..sampling.clone() };
        let expected = host(&sampling)?;
        assert!(expected.tokens[0].len() <= 4, "row 0 stops at its EOS");
        Ok((sampling, expected))
    }

    /// The decoding loop with its state in memory, on the CPU without a graph (the decoding
    /// ops' CPU forwards), against the host loop: the same tokens and log-probabilities within
    /// rounding (the fused ops add in another order than the split heads), greedy and sampled,
    /// left-padded rows (one all padding) stopping at EOS at different steps, more steps than the
    /// stop test's period, the KV cache's length at the end; and a rollout the cache cannot hold
    /// is left to the host loop.
    #[test]
    fn the_loop_with_its_state_in_memory_is_the_host_loop_on_the_cpu() -> Result<()> {
        let dev = Device::Cpu;
        let (cfg, batch, max_new, settings) = rollouts();
        let model = crate::ParamStore::init(&cfg, 5, &dev)?.model(&cfg)?;
        for sampling in &settings {
            let (sampling, expected) = with_early_eos(&model, &batch, sampling, &dev)?;
            let mut cache = Gpt2Cache::new(&cfg, batch.p + max_new);
            let mut tokens_seen = 0;
            let in_memory = decode_with_state_in_memory(
                &model,
                &batch,
                &sampling,
                &mut cache,
                &dev,
                &mut || tokens_seen += 1,
                None,
            )?
            .expect("it applies on the CPU in f32");
            let what = format!("{sampling:?}");
            assert_eq!(in_memory.tokens, expected.tokens, "{what}");
            for (a, b) in in_memory.logprobs.iter().flatten().zip(expected.logprobs.iter().flatten()) {
                assert!((a - b).abs() < 1e-4, "{what}: log-prob {a} vs {b}");
            }
            assert_eq!(
                in_memory.logprobs.iter().map(Vec::len).collect::<Vec<_>>(),
                expected.logprobs.iter().map(Vec::len).collect::<Vec<_>>()
            );
            let longest = expected.tokens.iter().map(Vec::len).max().unwrap_or(0);
            // The steps made: every row's, and at most a stop-test period more once all stopped.
            assert!(
                tokens_seen >= longest && tokens_seen < longest + CHECK_EVERY,
                "{what}: {tokens_seen} steps for {longest}"
            );
            assert_eq!(cache.len(), batch.p + tokens_seen - 1, "{what}: the cache's length");
        }
        let mut small = Gpt2Cache::new(&cfg, batch.p + 2);
        let greedy = &settings[0];
        assert!(decode_with_state_in_memory(&model, &batch, greedy, &mut small, &dev, &mut || {}, None)?.is_none());
        Ok(())
    }

    /// On a GPU: generation with the decoding step replayed from a CUDA graph gives the host
    /// loop's tokens and log-probabilities bit for bit (the same kernels on the same values),
    /// greedy and sampled (temperature, top-k, top-p), for left-padded rows that stop at EOS at
    /// different steps, over more steps than the stop test's period, in f32 and bf16; and the
    /// graph did replay steps.
    #[cfg(feature = "cuda")]
    #[test]
    #[ignore = "needs a GPU: scripts/gpu-check.sh runs it (cargo test --features cuda -- --include-ignored)"]
    fn the_graph_decodes_the_host_loops_tokens() -> Result<()> {
        let gpu = crate::kernels::ops::test_support::gpu();
        let (cfg, batch, max_new, settings) = rollouts();
        let params = crate::ParamStore::init(&cfg, 5, &Device::Cpu)?;
        for dtype in [DType::F32, DType::BF16] {
            let weights = params
                .tensors()
                .into_iter()
                .map(|(k, v)| Ok((k, v.to_dtype(dtype)?.to_device(&gpu)?)))
                .collect::<Result<std::collections::HashMap<_, _>>>()?;
            let model = Gpt2::load(candle_nn::VarBuilder::from_tensors(weights, dtype, &gpu), &cfg)?;
            for sampling in &settings {
                let (sampling, expected) = with_early_eos(&model, &batch, sampling, &gpu)?;
                let replayed = REPLAYED_STEPS.load(std::sync::atomic::Ordering::Relaxed);
                let mut cache = Gpt2Cache::new(&cfg, batch.p + max_new);
                let graphed = generate(&model, &batch, &sampling, &mut cache, &gpu, &mut || {})?.expect("it applies");
                let what = format!("{dtype:?}, {sampling:?}");
                assert_eq!(graphed.tokens, expected.tokens, "{what}");
                let bits = |g: &Generation| g.logprobs.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&graphed), bits(&expected), "{what}: log-probabilities");
                let longest = expected.tokens.iter().map(Vec::len).max().unwrap_or(0);
                if longest > 2 {
                    assert!(REPLAYED_STEPS.load(std::sync::atomic::Ordering::Relaxed) > replayed, "{what}: replayed");
                }
            }
        }
        Ok(())
    }
}
