//! Dropout masks as pure functions of where they are drawn: the key of a (step, micro-batch)
//! and the site's (layer, index), so recomputation and resumption draw the same masks.

use crate::kernels::rowops::{splitmix64, GOLDEN_GAMMA};

/// Identifies one dropout site in one step, so its mask is a pure function of where it is used.
///
/// Counter-based rather than a stream: activation checkpointing recomputes a block in backward
/// and must draw the very same mask, and a resumed run must draw the masks the uninterrupted
/// run would have drawn, with no RNG state to carry. The fused kernel also regenerates the mask
/// in backward instead of keeping it, and draws it in parallel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropoutKey {
    pub seed: u64,
    pub step: u64,
    pub micro_batch: u64,
}

impl DropoutKey {
    /// The mask of site `site` of layer `layer` (layer `u64::MAX` = embeddings) with drop
    /// probability `p`.
    pub fn mask(&self, p: f64, layer: u64, site: u64) -> DropoutMask {
        let mut h = self.seed ^ GOLDEN_GAMMA;
        for v in [self.step, self.micro_batch, layer, site] {
            h = splitmix64(h ^ v);
        }
        let threshold = (p * 4_294_967_296.0).round().clamp(0.0, u32::MAX as f64) as u32;
        DropoutMask { seed: h, threshold, scale: (1.0 / (1.0 - p)) as f32 }
    }
}

/// The keep/drop pattern of one dropout site: element `i` is kept, and scaled by 1 / (1 - p),
/// when the high half of SplitMix64's `i`-th output from the site's seed is at least p * 2^32.
/// A counter-based generator: any element's draw is computed directly from its index.
#[derive(Clone, Copy, Debug)]
pub struct DropoutMask {
    seed: u64,
    threshold: u32,
    scale: f32,
}

impl DropoutMask {
    /// Elements per unit of parallel work in the fused kernel.
    pub const CHUNK: usize = 16 * 1024;

    /// The multiplier of element `i`: 0 or 1 / (1 - p).
    pub fn factor(&self, i: usize) -> f32 {
        crate::kernels::rowops::dropout_factor(self.seed, self.threshold, self.scale, i as u64)
    }

    /// `out[j] = x[j] * factor(start + j)`.
    pub fn apply(&self, start: usize, x: &[f32], out: &mut [f32]) {
        crate::kernels::rowops::dropout(self.seed, self.threshold, self.scale, start as u64, x, out)
    }

    /// The site's seed, the drop threshold on a draw's high 32 bits and the keep scale: what a
    /// GPU kernel needs to draw the same factors.
    pub fn parts(&self) -> (u64, u32, f32) {
        (self.seed, self.threshold, self.scale)
    }

    /// `x[j] *= factor(start + j)`.
    pub fn apply_in_place(&self, start: usize, x: &mut [f32]) {
        crate::kernels::rowops::dropout_in_place(self.seed, self.threshold, self.scale, start as u64, x)
    }
}
