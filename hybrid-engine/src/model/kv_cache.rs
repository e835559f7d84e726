//! The KV cache of one attention layer, preallocated for the whole rollout (prompt + longest
//! answer) and reusable across rollouts without reallocating: `reset` only rewinds the length.
//! candle-nn's `KvCache` frees its buffers on reset, so a hybrid engine that keeps its inference
//! cache between rollouts (DS-Chat without `--release_inference_cache`) could not keep them.
//!
//! Shapes: B rows, NH heads, S cached positions (at most `capacity`), HD head size.

use candle_core::{DType, Device, IndexOp, Result, Tensor};

pub struct KvCache {
    capacity: usize,
    /// (2, B, NH, capacity, HD): the keys, then the values; allocated on the first append.
    buffer: Option<Tensor>,
    len: usize,
}

impl KvCache {
    /// A cache for up to `capacity` positions (nothing is allocated until the first append).
    pub fn new(capacity: usize) -> Self {
        Self { capacity, buffer: None, len: 0 }
    }

    /// Positions it can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Positions cached (S).
    pub fn current_seq_len(&self) -> usize {
        self.len
    }

    /// Forgets the cached positions but keeps the buffers for the next rollout of the same shape.
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// Frees the buffers (`--release-inference-cache`).
    pub fn release(&mut self) {
        self.len = 0;
        self.buffer = None;
    }

    /// Bytes held by the buffers.
    pub fn allocated_bytes(&self) -> usize {
        self.buffer.as_ref().map_or(0, |kv| kv.elem_count() * kv.dtype().size_in_bytes())
    }

    /// The buffer, with room for `t` more positions of B rows, NH heads of HD values: allocated
    /// for the full capacity on first use or for another shape (which forgets what was cached).
    fn room_for(
        &mut self,
        (b, nh, t, hd): (usize, usize, usize, usize),
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        if self.len + t > self.capacity {
            candle_core::bail!(
                "KV cache overflow: {} cached + {t} new positions exceed its capacity {}",
                self.len,
                self.capacity
            );
        }
        let shape = [2, b, nh, self.capacity, hd];
        match &self.buffer {
            Some(kv) if kv.dims() == shape && kv.dtype() == dtype => Ok(kv.clone()),
            _ => {
                let kv = Tensor::zeros(&shape, dtype, device)?;
                self.buffer = Some(kv.clone());
                self.len = 0;
                Ok(kv)
            }
        }
    }

    /// Appends `k`, `v` (B, NH, T, HD) and returns every cached position: (B, NH, S + T, HD).
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, nh, t, hd) = k.dims4()?;
        let kv = self.room_for((b, nh, t, hd), k.dtype(), k.device())?;
        let (keys, values) = (kv.i(0)?, kv.i(1)?);
        keys.slice_set(&k.contiguous()?, 2, self.len)?;
        values.slice_set(&v.contiguous()?, 2, self.len)?;
        self.len += t;
        Ok((keys.narrow(2, 0, self.len)?, values.narrow(2, 0, self.len)?))
    }

    /// Appends the new tokens' keys and values straight from c_attn's output `qkv` (B, T, 3C) of
    /// `n_head` heads, or its gemm's output and its bias `qkv_bias` (3C), in one launch on a GPU
    /// (`ops::kv_cache_append`); returns the whole buffer (2, B, NH, capacity, HD) and the
    /// positions cached before these tokens, what `ops::decode_attention` takes.
    pub fn append_qkv(&mut self, qkv: &Tensor, qkv_bias: Option<&Tensor>, n_head: usize) -> Result<(Tensor, usize)> {
        let (b, t, c3) = qkv.dims3()?;
        let kv = self.room_for((b, n_head, t, c3 / 3 / n_head), qkv.dtype(), qkv.device())?;
        let start = self.len;
        crate::kernels::ops::kv_cache_append(&kv, qkv, qkv_bias, n_head, start)?;
        self.len += t;
        Ok((kv, start))
    }

    /// [`Self::append_qkv`] at the position a u32 on the device holds (`start_at`, (1,)): a
    /// decoding step captured as a CUDA graph, which serves every position. The length here does
    /// not move: the caller sets it once the steps are made ([`Self::set_len`]) and has made sure
    /// that they fit. Returns the whole buffer.
    pub fn append_qkv_at(
        &mut self,
        qkv: &Tensor,
        qkv_bias: Option<&Tensor>,
        n_head: usize,
        start_at: &Tensor,
    ) -> Result<Tensor> {
        let (b, _, c3) = qkv.dims3()?;
        let Some(kv) = self.buffer.clone().filter(|kv| kv.dims() == [2, b, n_head, self.capacity, c3 / 3 / n_head])
        else {
            candle_core::bail!("a decoding step at a position on the device needs the cache its prompt filled");
        };
        let start = crate::kernels::ops::CacheStart::Device(start_at.clone());
        crate::kernels::ops::kv_cache_append(&kv, qkv, qkv_bias, n_head, start)?;
        Ok(kv)
    }

    /// Sets the positions cached to `len` (after steps appended at positions on the device).
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        if len > self.capacity || (len > 0 && self.buffer.is_none()) {
            candle_core::bail!("a KV cache of {} positions cannot hold {len}", self.capacity);
        }
        self.len = len;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn appends_accumulate_and_reset_keeps_the_buffers() -> Result<()> {
        let dev = Device::Cpu;
        let mut cache = KvCache::new(5);
        let k1 = Tensor::arange(0f32, 12.0, &dev)?.reshape((1, 2, 3, 2))?;
        let (k, v) = cache.append(&k1, &k1.neg()?)?;
        assert_eq!(k.dims(), [1, 2, 3, 2]);
        assert_eq!(k.flatten_all()?.to_vec1::<f32>()?, k1.flatten_all()?.to_vec1::<f32>()?);
        assert_eq!(v.flatten_all()?.to_vec1::<f32>()?, k1.neg()?.flatten_all()?.to_vec1::<f32>()?);
        let k2 = Tensor::ones((1, 2, 1, 2), candle_core::DType::F32, &dev)?;
        let (k, _) = cache.append(&k2, &k2)?;
        assert_eq!(k.dims(), [1, 2, 4, 2]);
        assert_eq!(k.narrow(2, 3, 1)?.flatten_all()?.to_vec1::<f32>()?, [1.0; 4]);
        assert_eq!(k.narrow(2, 0, 3)?.flatten_all()?.to_vec1::<f32>()?, k1.flatten_all()?.to_vec1::<f32>()?);
        assert!(cache.append(&k1, &k1).is_err(), "4 + 3 positions overflow a capacity of 5");

        let bytes = cache.allocated_bytes();
        assert_eq!(bytes, 2 * 2 * 5 * 2 * 4);
        cache.reset();
        assert_eq!((cache.current_seq_len(), cache.allocated_bytes()), (0, bytes), "reset keeps the memory");
        let (k, _) = cache.append(&k2, &k2)?;
        assert_eq!(k.dims(), [1, 2, 1, 2], "old positions are not visible after a reset");
        cache.release();
        assert_eq!(cache.allocated_bytes(), 0);
        Ok(())
    }
}
