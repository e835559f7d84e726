//! Candle's CPU storages read in place: a tensor's values as a slice of the storage it lives in
//! (the kernels', the collectives' and the optimizer's view of their operands; no copy).

use candle_core::{CpuStorage, Layout, Result};

pub(crate) fn contiguous_f32<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let (start, end) =
        l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg(format!("{what} must be contiguous")))?;
    match s {
        CpuStorage::F32(v) => Ok(&v[start..end]),
        _ => candle_core::bail!("{what} must be f32"),
    }
}

/// [`contiguous_f32`], mutable: an in-place op's output.
pub(crate) fn contiguous_f32_mut<'a>(s: &'a mut CpuStorage, l: &Layout, what: &str) -> Result<&'a mut [f32]> {
    let (start, end) =
        l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg(format!("{what} must be contiguous")))?;
    match s {
        CpuStorage::F32(v) => Ok(&mut v[start..end]),
        _ => candle_core::bail!("{what} must be f32"),
    }
}

pub(crate) fn contiguous_u32<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [u32]> {
    let (start, end) =
        l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg(format!("{what} must be contiguous")))?;
    match s {
        CpuStorage::U32(v) => Ok(&v[start..end]),
        _ => candle_core::bail!("{what} must be u32"),
    }
}
