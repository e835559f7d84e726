//! GPT-2's parameters by role: the tables the engine's parallel layouts read by a parameter's HF
//! name (without `transformer.`). How tensor parallelism cuts each (Megatron's layout on Conv1D
//! `(in, out)` weights): `c_attn` by heads (each rank the q, k and v columns of its heads, so
//! attention needs no communication), `c_fc` by columns, both `c_proj` by rows with their biases
//! whole (added once, after the sum), LayerNorms and the position embedding whole on every rank,
//! the token embedding by vocabulary rows. A LoRA adapter is cut as its linear: `B` (out, r) by
//! the rows of a column-parallel linear's outputs, `A` (r, in) by the columns of a row-parallel
//! one's inputs, the other factor whole. Which block a parameter belongs to (ZeRO-3 gathers a
//! block's parameters together, and the rest as one outer unit).

use crate::tensor_parallel::shard::Split;

/// The tensor-parallel split of parameter `name`.
pub fn split_of(name: &str) -> Split {
    // LoRA's A (r, in) and B (out, r) of the linear `module`.
    if let Some(module) = name.strip_suffix(".lora_A.weight") {
        return match module.ends_with(".c_proj") {
            true => Split::Columns { segments: 1 },
            false => Split::Whole,
        };
    }
    if let Some(module) = name.strip_suffix(".lora_B.weight") {
        return match module {
            m if m.ends_with(".attn.c_attn") => Split::Rows { segments: 3 },
            m if m.ends_with(".mlp.c_fc") => Split::Rows { segments: 1 },
            _ => Split::Whole,
        };
    }
    if name == "wte.weight" {
        Split::VocabRows
    } else if name.contains(".attn.c_attn.") {
        Split::Columns { segments: 3 }
    } else if name.contains(".mlp.c_fc.") {
        Split::Columns { segments: 1 }
    } else if name.ends_with(".c_proj.weight") {
        Split::Rows { segments: 1 }
    } else {
        Split::Whole
    }
}

/// The block parameter `name` belongs to: `Some(i)` for block `i`'s (`h.<i>.…`), `None`
/// outside the blocks (the embeddings, the final LayerNorm, the heads beside the trunk); an
/// error for a name under the blocks without an index.
pub fn block_of(name: &str) -> anyhow::Result<Option<usize>> {
    let Some(rest) = name.strip_prefix("h.") else { return Ok(None) };
    match rest.split('.').next().and_then(|i| i.parse::<usize>().ok()) {
        Some(i) => Ok(Some(i)),
        None => anyhow::bail!("internal error: parameter {name} names no block"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor_parallel::shard::shard;
    use anyhow::Result;
    use candle_core::{Device, Tensor};

    #[test]
    fn c_attn_is_cut_by_heads_in_each_of_q_k_and_v() -> Result<()> {
        // C = 4, two heads of 2 over 2 ranks: q = 0..4, k = 4..8, v = 8..12.
        let bias = Tensor::arange(0f32, 12.0, &Device::Cpu)?;
        let split = split_of("h.0.attn.c_attn.bias");
        assert_eq!(shard(&bias, split, 0, 2)?.to_vec1::<f32>()?, [0.0, 1.0, 4.0, 5.0, 8.0, 9.0]);
        assert_eq!(shard(&bias, split, 1, 2)?.to_vec1::<f32>()?, [2.0, 3.0, 6.0, 7.0, 10.0, 11.0]);
        let w = Tensor::arange(0f32, 24.0, &Device::Cpu)?.reshape((2, 12))?;
        assert_eq!(shard(&w, split_of("h.3.attn.c_attn.weight"), 1, 2)?.dims(), [2, 6]);
        let proj = Tensor::arange(0f32, 8.0, &Device::Cpu)?.reshape((4, 2))?;
        let rows = shard(&proj, split_of("h.0.mlp.c_proj.weight"), 1, 2)?;
        assert_eq!(rows.to_vec2::<f32>()?, [[4.0, 5.0], [6.0, 7.0]]);
        for whole in ["h.0.attn.c_proj.bias", "h.0.mlp.c_proj.bias", "h.0.ln_1.weight", "wpe.weight"] {
            assert_eq!(split_of(whole), Split::Whole, "{whole}");
        }
        assert_eq!(split_of("h.0.mlp.c_fc.bias"), Split::Columns { segments: 1 });
        // LoRA: B of c_attn (3C, r) by heads in each of q, k and v; A of c_proj (r, in) by inputs.
        let b = Tensor::arange(0f32, 12.0, &Device::Cpu)?.reshape((12, 1))?;
        let mine = shard(&b, split_of("h.0.attn.c_attn.lora_B.weight"), 1, 2)?;
        assert_eq!(mine.flatten_all()?.to_vec1::<f32>()?, [2.0, 3.0, 6.0, 7.0, 10.0, 11.0]);
        assert_eq!(split_of("h.0.mlp.c_proj.lora_A.weight"), Split::Columns { segments: 1 });
        for whole in ["h.0.attn.c_attn.lora_A.weight", "h.0.mlp.c_fc.lora_A.weight", "h.0.attn.c_proj.lora_B.weight"] {
            assert_eq!(split_of(whole), Split::Whole, "{whole}");
        }
        // The embedding: 300 rows padded to 512 over 2 ranks, the second slice partly padding.
        let wte = Tensor::ones((300, 2), candle_core::DType::F32, &Device::Cpu)?;
        let second = shard(&wte, split_of("wte.weight"), 1, 2)?;
        assert_eq!(second.dims(), [256, 2]);
        assert_eq!(second.sum_all()?.to_scalar::<f32>()?, 2.0 * 44.0);
        Ok(())
    }
}
