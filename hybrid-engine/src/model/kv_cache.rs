//! The KV cache of one attention layer, preallocated for the whole rollout (prompt + longest
//! answer) and reusable across rollouts without reallocating: `reset` only rewinds the length.
//! candle-nn's `KvCache` frees its buffers on reset, so a hybrid engine that keeps its inference
//! cache between rollouts (DS-Chat without `--release_inference_cache`) could not keep them.
//!
//! Shapes: B rows, NH heads, S cached positions (at most `capacity`), HD head size.

use candle_core::{Result, Tensor};

pub struct KvCache {
    capacity: usize,
    /// (B, NH, capacity, HD) each, allocated on the first append.
    buffers: Option<(Tensor, Tensor)>,
    len: usize,
}

impl KvCache {
    /// A cache for up to `capacity` positions (nothing is allocated until the first append).
    pub fn new(capacity: usize) -> Self {
        Self { capacity, buffers: None, len: 0 }
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
        self.buffers = None;
    }

    /// Bytes held by the buffers.
    pub fn allocated_bytes(&self) -> usize {
        self.buffers.as_ref().map_or(0, |(k, _)| 2 * k.elem_count() * k.dtype().size_in_bytes())
    }

    /// Appends `k`, `v` (B, NH, T, HD) and returns every cached position: (B, NH, S + T, HD).
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, nh, t, hd) = k.dims4()?;
        if self.len + t > self.capacity {
            candle_core::bail!(
                "KV cache overflow: {} cached + {t} new positions exceed its capacity {}",
                self.len,
                self.capacity
            );
        }
        let fits = self
            .buffers
            .as_ref()
            .is_some_and(|(kb, _)| kb.dims() == [b, nh, self.capacity, hd] && kb.dtype() == k.dtype());
        if !fits {
            // First use, or another batch shape: (re)allocate for the full capacity once.
            let zeros = Tensor::zeros((b, nh, self.capacity, hd), k.dtype(), k.device())?;
            self.buffers = Some((zeros.clone(), zeros.copy()?));
            self.len = 0;
        }
        let (kb, vb) = self.buffers.as_ref().expect("allocated above");
        kb.slice_set(&k.contiguous()?, 2, self.len)?;
        vb.slice_set(&v.contiguous()?, 2, self.len)?;
        self.len += t;
        Ok((kb.narrow(2, 0, self.len)?, vb.narrow(2, 0, self.len)?))
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
