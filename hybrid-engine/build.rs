//! With the `cuda` feature, compiles the engine's CUDA kernels (`cuda/*.cu`) to PTX, the way
//! candle compiles its own (cudaforge, nvcc from PATH or CUDA_HOME, the architecture from
//! CUDA_COMPUTE_CAP or the GPU present); `kernels::cuda` loads them at run time. Without the
//! feature there is nothing to build.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=cuda");
    #[cfg(feature = "cuda")]
    compile_cuda_kernels();
}

#[cfg(feature = "cuda")]
fn compile_cuda_kernels() {
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let ptx = cudaforge::KernelBuilder::new()
        .source_dir("cuda")
        .watch(["cuda/common.cuh", "cuda/multi_tensor.cuh"]) // included by the kernels
        .arg("-std=c++17")
        .arg("-O3")
        .build_ptx()
        .unwrap_or_else(|e| panic!("compiling hybrid-engine/cuda/*.cu to PTX (see scripts/cuda-build-env.sh): {e}"));
    ptx.write(out_dir.join("ptx.rs")).expect("writing the PTX constants");
}
