// PyTorch binding for csrc/kernels/chunk_gemm.cu, built by megatron_het/comm/overlap_kernels.py
// (torch.utils.cpp_extension.load) only where a GPU torch and nvcc/hipcc are present.
#include <torch/extension.h>
#include <cuda_runtime.h>

extern "C" int het_chunk_gemm_f32(const float*, const float*, float*, int, int, int, int, int, int, cudaStream_t);
extern "C" int het_chunk_gemm_f64(const double*, const double*, double*, int, int, int, int, int, int,
                                  cudaStream_t);

// gathered: [tp, cs, h]; weight: [n, h]; out: [tp * rows, n] (contiguous), filled at piece c.
void chunk_gemm(torch::Tensor gathered, torch::Tensor weight, torch::Tensor out, int64_t rows, int64_t c,
                int64_t stream_ptr) {
  TORCH_CHECK(gathered.is_cuda() && weight.is_cuda() && out.is_cuda(), "chunk_gemm: tensors must be on the GPU");
  TORCH_CHECK(gathered.dim() == 3 && weight.dim() == 2, "chunk_gemm: gathered [tp, cs, h], weight [n, h]");
  TORCH_CHECK(gathered.is_contiguous() && weight.is_contiguous() && out.is_contiguous(),
              "chunk_gemm: tensors must be contiguous");
  const int tp = gathered.size(0), cs = gathered.size(1), h = gathered.size(2), n = weight.size(0);
  auto stream = reinterpret_cast<cudaStream_t>(stream_ptr);
  int err;
  if (gathered.scalar_type() == torch::kFloat32) {
    err = het_chunk_gemm_f32(gathered.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), tp, cs,
                             h, n, rows, c, stream);
  } else {
    TORCH_CHECK(gathered.scalar_type() == torch::kFloat64, "chunk_gemm: float32 or float64 only");
    err = het_chunk_gemm_f64(gathered.data_ptr<double>(), weight.data_ptr<double>(), out.data_ptr<double>(), tp,
                             cs, h, n, rows, c, stream);
  }
  TORCH_CHECK(err == 0, "chunk_gemm: kernel launch failed with CUDA error ", err);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("chunk_gemm", &chunk_gemm, "GEMM of one gathered piece, in place"); }
