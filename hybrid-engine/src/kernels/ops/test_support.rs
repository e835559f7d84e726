//! What the ops' tests share: seeded normal draws, the comparison of an op with its composed
//! reference (values and gradients), finite differences, attention masks; and for the GPU tests,
//! the device, differences across devices and an op's value and gradients on a device.

use candle_core::{DType, Device, Result, Shape, Tensor, Var};

thread_local! {
    static RNG: std::cell::RefCell<rand::rngs::StdRng> =
        std::cell::RefCell::new(rand::SeedableRng::seed_from_u64(0));
}

/// Normal draws from a seeded generator, like `Tensor::randn` but reproducible: each test
/// runs on a thread of its own, so it draws the same numbers on every run and a tolerance
/// means the same thing in CI and here.
pub(crate) fn randn(mean: f32, std: f32, shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
    use rand::Rng;
    let shape = shape.into();
    let values: Vec<f32> = RNG.with(|rng| {
        let mut rng = rng.borrow_mut();
        (0..shape.elem_count())
            .map(|_| {
                // Box-Muller: two uniforms in (0, 1] and [0, 1) to one standard normal.
                let (u, v): (f32, f32) = (1.0 - rng.random::<f32>(), rng.random());
                mean + std * (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
            })
            .collect()
    });
    Tensor::from_vec(values, shape, device)
}

pub(crate) fn max_abs(t: &Tensor) -> Result<f32> {
    t.abs()?.flatten_all()?.max(0)?.to_scalar()
}

/// Largest difference relative to the largest entry of `want`.
pub(crate) fn rel_diff(got: &Tensor, want: &Tensor) -> Result<f32> {
    Ok(max_abs(&got.sub(want)?)? / max_abs(want)?.max(1e-30))
}

/// Value and gradients (with respect to each of `inputs`) of the fused op `fused` and the
/// composed reference `reference`, with a random upstream gradient.
pub(crate) fn compare(
    inputs: &[Tensor],
    fused: impl Fn(&[Tensor]) -> Result<Tensor>,
    reference: impl Fn(&[Tensor]) -> Result<Tensor>,
    value_tol: f32,
    grad_tol: f32,
) -> Result<()> {
    let vars: Vec<Var> = inputs.iter().map(Var::from_tensor).collect::<Result<_>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let (fused, reference) = (fused(&ts)?, reference(&ts)?);
    assert_eq!(fused.dims(), reference.dims());
    let d = rel_diff(&fused, &reference)?;
    assert!(d <= value_tol, "values differ by {d} relative");
    let w = randn(0f32, 1.0, fused.shape(), fused.device())?;
    let gf = fused.mul(&w)?.sum_all()?.backward()?;
    let gr = reference.mul(&w)?.sum_all()?.backward()?;
    for (i, v) in vars.iter().enumerate() {
        match (gf.get(v.as_tensor()), gr.get(v.as_tensor())) {
            (Some(a), Some(b)) => {
                assert_eq!(a.dims(), b.dims(), "gradient of input {i}");
                let d = rel_diff(a, b)?;
                assert!(d <= grad_tol, "gradient of input {i} differs by {d} relative");
            }
            (None, None) => {}
            (a, b) => panic!("input {i}: fused gradient {:?}, reference {:?}", a.is_some(), b.is_some()),
        }
    }
    Ok(())
}

/// Central finite differences (in f64, through the fused op on f32 inputs) of
/// `sum(f(x) * w)` at a few entries of `inputs[which]`, against the fused backward.
pub(crate) fn finite_differences(
    inputs: &[Tensor],
    which: usize,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
    tol: f32,
) -> Result<()> {
    let vars: Vec<Var> = inputs.iter().map(Var::from_tensor).collect::<Result<_>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts)?;
    let w = randn(0f32, 1.0, y.shape(), y.device())?;
    let grads = y.mul(&w)?.sum_all()?.backward()?;
    let analytic: Vec<f32> = grads.get(vars[which].as_tensor()).expect("no gradient").flatten_all()?.to_vec1()?;
    let base: Vec<f32> = inputs[which].flatten_all()?.to_vec1()?;
    let eps = 1e-2f32;
    let n = base.len();
    let mut worst = 0f32;
    let scale = analytic.iter().fold(0f32, |m, g| m.max(g.abs())).max(1e-3);
    for i in (0..n).step_by((n / 23).max(1)) {
        let eval = |delta: f32| -> Result<f64> {
            let mut v = base.clone();
            v[i] += delta;
            let mut args = inputs.to_vec();
            args[which] = Tensor::from_vec(v, inputs[which].shape(), inputs[which].device())?;
            let y = f(&args)?.to_dtype(DType::F64)?;
            y.mul(&w.to_dtype(DType::F64)?)?.sum_all()?.to_scalar::<f64>()
        };
        let numeric = ((eval(eps)? - eval(-eps)?) / (2.0 * eps as f64)) as f32;
        worst = worst.max((numeric - analytic[i]).abs() / scale);
    }
    assert!(worst < tol, "finite differences of input {which} differ by {worst} relative");
    Ok(())
}

pub(crate) fn dev() -> Device {
    Device::Cpu
}

/// A causal mask (rows, 1, T, T) with `pad[r]` left-padding keys masked in row r.
pub(crate) fn causal_bias(rows: usize, t: usize, pad: &[usize]) -> Result<Tensor> {
    let mut bias = vec![0f32; rows * t * t];
    for r in 0..rows {
        for i in 0..t {
            for j in 0..t {
                if j > i || j < pad[r] {
                    bias[(r * t + i) * t + j] = -1e9;
                }
            }
        }
    }
    Tensor::from_vec(bias, (rows, 1, t, t), &dev())
}

/// The first GPU, opened as the binaries open it (cudarc's event tracking off, the memory pool
/// kept: `device::new_cuda`), so that a test of work on two streams relies on the same ordering
/// as a run does. The tests that call it are `#[ignore]`d (a run without a GPU lists them as
/// ignored, not passed); one asked to run where there is no GPU fails, saying so.
#[cfg(feature = "cuda")]
pub(crate) fn gpu() -> Device {
    crate::device::new_cuda(0).unwrap_or_else(|e| panic!("this test needs a GPU and there is none: {e}"))
}

#[cfg(feature = "cuda")]
/// max |a - b| over all elements, both as f32 on the CPU.
pub(crate) fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    let a = a.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
    let b = b.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
    (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
}

#[cfg(feature = "cuda")]
/// The attention masks the tests use: per batch row (B, 1, T, T), causal with batch row 1
/// padded on the left by 5 (its first 5 queries see no key at all), and the broadcast causal
/// mask (1, 1, T, T).
pub(crate) fn causal_masks(b: usize, t: usize) -> Result<(Tensor, Tensor)> {
    let mut per_batch = vec![0f32; b * t * t];
    for (i, m) in per_batch.iter_mut().enumerate() {
        let (batch, row, col) = (i / (t * t), i / t % t, i % t);
        if col > row || (batch == 1 && col < 5) {
            *m = -1e9;
        }
    }
    let per_batch = Tensor::from_vec(per_batch, (b, 1, t, t), &Device::Cpu)?;
    let causal = per_batch.narrow(0, 0, 1)?.contiguous()?;
    Ok((per_batch, causal))
}

#[cfg(feature = "cuda")]
/// The largest |value| of a tensor, as f32.
pub(crate) fn largest(t: &Tensor) -> Result<f32> {
    t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
}

#[cfg(feature = "cuda")]
/// `f` of the inputs and its gradients with respect to each (the loss: the output times
/// fixed weights, summed), on `device`.
pub(crate) fn value_and_grads(
    inputs: &[&Tensor],
    device: &Device,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) -> Result<(Tensor, Vec<Tensor>)> {
    let vars = inputs.iter().map(|t| Var::from_tensor(&t.to_device(device)?)).collect::<Result<Vec<_>>>()?;
    let y = f(&vars.iter().map(|v| v.as_tensor().clone()).collect::<Vec<_>>())?;
    // The same weights in [-1, 1) on both devices, a function of the element's index.
    let fixed: Vec<f32> = (0..y.elem_count()).map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0).collect();
    let weights = Tensor::from_vec(fixed, y.shape(), &Device::Cpu)?.to_dtype(y.dtype())?.to_device(device)?;
    let grads = y.mul(&weights)?.sum_all()?.backward()?;
    let g = vars.iter().map(|v| grads.get(v.as_tensor()).expect("every input has a gradient").clone()).collect();
    Ok((y, g))
}
