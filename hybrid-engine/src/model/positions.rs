//! Where a forward pass's tokens sit, for every architecture: position ids and the attention
//! mask (left padding, cached keys), and the causal bias made from them.

use candle_core::{Device, Result, Tensor};

/// Where the tokens of a forward pass sit: positions and which keys may be attended to.
#[derive(Default, Clone, Copy)]
pub struct Positions<'a> {
    /// (B, T) u32 position ids; default `P..P+T` for every row.
    pub position_ids: Option<&'a Tensor>,
    /// (B, S) with 1 for real tokens and 0 for padding, over cached and new tokens alike. Read
    /// on the host, where the additive bias is built: on a GPU keep it a CPU tensor (one copy
    /// of the bias to the device, instead of the mask there and back first).
    pub attention_mask: Option<&'a Tensor>,
}

/// The mask value: large enough that exp() underflows to 0, finite so fully masked (padding)
/// rows stay finite instead of NaN.
pub const MASKED: f32 = -1e9;

/// The causal bias (1, 1, T, S) of T new tokens after `past` cached ones, without padding: 0 where
/// j <= past + i, else [`MASKED`]. The last one made is kept and handed out again (read-only), so
/// that a training step at a fixed length neither fills T x S values on the host nor uploads them.
pub(crate) fn causal_bias(t: usize, past: usize, device: &Device) -> Result<Tensor> {
    type Kept = Option<((usize, usize, candle_core::DeviceLocation), Tensor)>;
    static LAST: std::sync::Mutex<Kept> = std::sync::Mutex::new(None);
    let key = (t, past, device.location());
    let mut last =
        LAST.lock().map_err(|_| candle_core::Error::Msg("the causal bias cache's lock is poisoned".into()))?;
    if let Some((k, bias)) = last.as_ref() {
        if *k == key && bias.device().same_device(device) {
            return Ok(bias.clone());
        }
    }
    let s = past + t;
    let bias: Vec<f32> = (0..t).flat_map(|i| (0..s).map(move |j| if j <= past + i { 0.0 } else { MASKED })).collect();
    let bias = Tensor::from_vec(bias, (1, 1, t, s), device)?;
    *last = Some((key, bias.clone()));
    Ok(bias)
}
