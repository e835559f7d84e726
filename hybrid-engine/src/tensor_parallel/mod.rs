//! Tensor parallelism in Megatron's layout (`megatron/core/tensor_parallel`, `parallel_state`):
//! the 2-D layout of the ranks into tensor- and data-parallel groups ([`layout`]), the
//! conjugate communication operators ([`mappings`]) and the parallel linears that put them
//! around their matmuls ([`layers`]), which slice of each parameter a rank holds ([`shard`]), and the vocabulary
//! split over the ranks: embedding and cross-entropy without the full logits ([`vocab`]).

pub mod layers;
pub mod layout;
pub mod mappings;
pub mod shard;
pub mod vocab;

#[cfg(test)]
mod tests {
    use crate::comm::on_groups;
    use crate::model::gpt2::layout::split_of;
    use crate::model::gpt2::{Gpt2, Gpt2Config};
    use crate::tensor_parallel::shard::shard;
    use crate::ParamStore;
    use candle_core::{DType, Device, Tensor, Var};
    use candle_nn::VarBuilder;
    use std::collections::HashMap;
    use std::sync::Arc;

    /// `n_layer` blocks of 4 heads, a vocabulary of 24 tokens, no dropout.
    fn small(n_layer: usize) -> Gpt2Config {
        Gpt2Config {
            n_layer,
            n_embd: 16,
            n_head: 4,
            n_positions: 8,
            vocab_size: 24,
            resid_pdrop: 0.0,
            embd_pdrop: 0.0,
            attn_pdrop: 0.0,
            ..Gpt2Config::tiny()
        }
    }

    /// GPT-2 split over 2 and 4 ranks (4 heads; the 24-token vocabulary padded to 128 x T rows)
    /// gives the one-rank loss, and every rank's gradient of each parameter is its slice of the
    /// one-rank gradient (itself checked against finite differences): whole parameters get the
    /// whole gradient on every rank, with no reduction, and the padding rows none. Greedy generation with the KV cache
    /// (each rank caching its heads) gives the one-rank tokens.
    #[test]
    fn a_tensor_parallel_gpt2_gives_the_one_rank_loss_and_gradients() -> anyhow::Result<()> {
        let cfg = small(2);
        let cpu = Device::Cpu;
        let params = ParamStore::init(&cfg, 3, &cpu)?;
        let ids = Tensor::new(&[[1u32, 2, 3, 4, 5], [6, 7, 8, 9, 10]], &cpu)?;
        let targets = Tensor::new(&[[2u32, 3, 4, 5, 6], [7, 8, 9, 10, 11]], &cpu)?;
        let want = params.model(&cfg)?.lm_loss(&ids, &targets, None)?;
        let grads = want.backward()?;
        let want = want.to_scalar::<f32>()?;
        // The one-rank gradients are themselves checked against central differences of the loss,
        // at the largest entry of every parameter's gradient. In f32 (the composed ops are not
        // f64 throughout): a step of 1e-2 keeps the loss's rounding (1e-7) below 1e-5 of slope.
        let loss_of = |weights: &HashMap<String, Tensor>| -> anyhow::Result<f64> {
            let model = Gpt2::load(VarBuilder::from_tensors(weights.clone(), DType::F32, &cpu), &cfg)?;
            Ok(f64::from(model.lm_loss(&ids, &targets, None)?.to_scalar::<f32>()?))
        };
        let base = params.tensors();
        for (name, var) in params.iter() {
            let g: Vec<f32> = grads.get(var.as_tensor()).unwrap().flatten_all()?.to_vec1()?;
            let k = (0..g.len()).max_by(|&a, &b| g[a].abs().total_cmp(&g[b].abs())).unwrap();
            let loss_at = |delta: f32| -> anyhow::Result<f64> {
                let mut v = base[name].flatten_all()?.to_vec1::<f32>()?;
                v[k] += delta;
                let mut moved = base.clone();
                moved.insert(name.to_string(), Tensor::from_vec(v, base[name].shape(), &cpu)?);
                loss_of(&moved)
            };
            let fd = (loss_at(1e-2)? - loss_at(-1e-2)?) / 2e-2;
            let g = f64::from(g[k]);
            assert!((g - fd).abs() <= 1e-2 * fd.abs() + 3e-5, "{name}[{k}]: autograd {g} vs finite differences {fd}");
        }
        let prompts = [vec![1u32, 2, 3], vec![4, 5, 6, 7]];
        let greedy = crate::generation::generate::SamplingConfig::greedy(6, None, 0, cfg.vocab_size);
        let want_tokens = crate::generation::generate::generate(&params.model(&cfg)?, &prompts, &greedy, &cpu)?;
        for ranks in [2, 4] {
            let results = on_groups(ranks, |group| {
                let tp = Arc::new(group);
                let vars: Vec<(String, Var)> = params
                    .iter()
                    .map(|(name, v)| {
                        Ok((name.to_string(), Var::from_tensor(&shard(v, split_of(name), tp.rank(), ranks)?)?))
                    })
                    .collect::<anyhow::Result<_>>()?;
                let named: HashMap<String, Tensor> =
                    vars.iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect();
                let model = Gpt2::load_tensor_parallel(VarBuilder::from_tensors(named, DType::F32, &cpu), &cfg, &tp)?;
                let loss = model.lm_loss(&ids, &targets, None)?;
                let store = loss.backward()?;
                let grads: Vec<(String, Vec<f32>)> = vars
                    .iter()
                    .map(|(n, v)| Ok((n.clone(), store.get(v.as_tensor()).unwrap().flatten_all()?.to_vec1()?)))
                    .collect::<anyhow::Result<_>>()?;
                let tokens = crate::generation::generate::generate(&model, &prompts, &greedy, &cpu)?;
                Ok((loss.to_scalar::<f32>()?, grads, tokens))
            });
            for (rank, res) in results.into_iter().enumerate() {
                let (loss, got, tokens) = res?;
                assert_eq!(tokens, want_tokens, "{ranks} ranks, rank {rank}: generation");
                assert!((loss - want).abs() < 1e-5, "{ranks} ranks, rank {rank}: loss {loss} vs {want}");
                for (name, g) in got {
                    let full = grads.get(params.get(&name).unwrap().as_tensor()).unwrap();
                    let w: Vec<f32> = shard(full, split_of(&name), rank, ranks)?.flatten_all()?.to_vec1()?;
                    assert_eq!(g.len(), w.len(), "{name}");
                    let scale = w.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
                    let diff = g.iter().zip(&w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                    assert!(
                        diff <= 1e-5 * scale + 1e-7,
                        "{ranks} ranks, rank {rank}: {name} off by {diff:e} (scale {scale:e})"
                    );
                }
            }
        }
        Ok(())
    }
    /// LoRA on all four linears of every block, each adapter cut as its linear: over 2 and 4
    /// ranks the loss is the one-rank loss and every rank's gradient of each parameter, the
    /// adapters' included, is its slice of the one-rank gradient; the slices' adapters fused into
    /// their weights give the slices of the fused weights (what generation runs on).
    #[test]
    fn lora_under_tensor_parallelism_gives_the_one_rank_loss_and_gradients() -> anyhow::Result<()> {
        let cfg = small(1);
        let cpu = Device::Cpu;
        let mut params = ParamStore::init(&cfg, 3, &cpu)?;
        let lora = lora::LoraConfig { dim: 4, alpha: Some(8.0), module_name: "h.".into() };
        assert_eq!(params.add_lora(&cfg, &lora, 5)?.len(), 4);
        // B starts at zero (PEFT's init): give it values, so that A gets a gradient too.
        for (i, (name, var)) in params.iter().enumerate() {
            if name.ends_with(lora::LORA_B) {
                var.set(&(Tensor::randn(0f32, 0.3, var.shape(), &cpu)? + i as f64 * 1e-3)?)?;
            }
        }
        let ids = Tensor::new(&[[1u32, 2, 3, 4, 5], [6, 7, 8, 9, 10]], &cpu)?;
        let targets = Tensor::new(&[[2u32, 3, 4, 5, 6], [7, 8, 9, 10, 11]], &cpu)?;
        let want = params.model(&cfg)?.lm_loss(&ids, &targets, None)?;
        let grads = want.backward()?;
        let want = want.to_scalar::<f32>()?;
        let fused = params.merged()?;
        for ranks in [2, 4] {
            let results = on_groups(ranks, |group| {
                let tp = Arc::new(group);
                let mut slices = ParamStore::default();
                for (name, v) in params.iter() {
                    slices.push(name, &shard(v, split_of(name), tp.rank(), ranks)?)?;
                }
                slices.set_layout(params.frozen(), params.lora_scaling())?;
                let loss = slices.model_tensor_parallel(&cfg, &tp)?.lm_loss(&ids, &targets, None)?;
                let store = loss.backward()?;
                let grads: Vec<(String, Vec<f32>)> = slices
                    .iter()
                    .map(|(n, v)| Ok((n.to_string(), store.get(v.as_tensor()).unwrap().flatten_all()?.to_vec1()?)))
                    .collect::<anyhow::Result<_>>()?;
                let merged: Vec<(String, Vec<f32>)> = slices
                    .merged()?
                    .iter()
                    .map(|(n, v)| Ok((n.to_string(), v.flatten_all()?.to_vec1()?)))
                    .collect::<anyhow::Result<_>>()?;
                Ok((loss.to_scalar::<f32>()?, grads, merged))
            });
            for (rank, res) in results.into_iter().enumerate() {
                let (loss, got, merged) = res?;
                assert!((loss - want).abs() < 1e-5, "{ranks} ranks, rank {rank}: loss {loss} vs {want}");
                let adapters = got.iter().filter(|(n, _)| lora::is_adapter_name(n)).count();
                assert_eq!(adapters, 8, "every adapter's A and B");
                for (name, g) in got {
                    let full = grads.get(params.get(&name).unwrap().as_tensor()).unwrap();
                    let w: Vec<f32> = shard(full, split_of(&name), rank, ranks)?.flatten_all()?.to_vec1()?;
                    let scale = full.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                    assert!(scale > 1e-6, "{name}: the one-rank gradient is zero, the check would say nothing");
                    let diff = g.iter().zip(&w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                    assert!(
                        diff <= 1e-5 * scale,
                        "{ranks} ranks, rank {rank}: {name} off by {diff:e} (scale {scale:e})"
                    );
                }
                for (name, v) in merged {
                    let w = shard(fused.get(&name).unwrap().as_tensor(), split_of(&name), rank, ranks)?;
                    let diff =
                        v.iter().zip(w.flatten_all()?.to_vec1::<f32>()?).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                    assert!(diff < 1e-6, "{ranks} ranks, rank {rank}: fused {name} off by {diff:e}");
                }
            }
        }
        Ok(())
    }
}
