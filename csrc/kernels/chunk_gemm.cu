// Chunked collective-GEMM, device side: the GEMM of one gathered piece written straight into its
// place in the rank-major output (megatron_het/comm/overlap.py, all_gather_linear).
//
// With sequence parallelism over `tp` ranks, each rank's shard of `rows` rows is cut into `k`
// pieces of `cs` rows. After piece c's all-gather, gathered = [tp, cs, h] (rank-major). Its GEMM
// rows belong at out[r * rows + c * cs + i] for rank r, row i: a strided scatter the PyTorch path
// does as a GEMM plus a copy; this kernel writes them in place, so the host pipeline is
//   comm stream:    all-gather(c+1)  -> record event e[c+1]
//   compute stream: wait e[c]        -> het_chunk_gemm(c)
// Plain CUDA runtime API only (cudaStream_t, <<<>>>, __shared__): hipify-perl maps every name
// used here, so `hipify-perl chunk_gemm.cu > chunk_gemm.hip` builds with hipcc unchanged.
// Tiled shared-memory GEMM (16x16); a production build would call cuBLAS/hipBLASLt with the
// output leading dimension set instead. fp32 accumulation; T = float or double.

#include <cuda_runtime.h>

#ifndef HET_TILE
#define HET_TILE 16
#endif

namespace het {

// out[(r * rows + c * cs + i) * n + j] = sum_h gathered[(r * cs + i) * h + p] * weight[j * h + p]
template <typename T>
__global__ void chunk_gemm_kernel(const T* __restrict__ gathered, const T* __restrict__ weight,
                                  T* __restrict__ out, int tp, int cs, int h, int n, int rows, int c) {
  __shared__ T a_tile[HET_TILE][HET_TILE];
  __shared__ T b_tile[HET_TILE][HET_TILE];
  const int gm = blockIdx.y * HET_TILE + threadIdx.y;  // row of the gathered piece: r * cs + i
  const int gn = blockIdx.x * HET_TILE + threadIdx.x;  // output column
  const int m_total = tp * cs;
  T acc = 0;
  for (int p0 = 0; p0 < h; p0 += HET_TILE) {
    const int pa = p0 + threadIdx.x;
    const int pb = p0 + threadIdx.y;
    a_tile[threadIdx.y][threadIdx.x] = (gm < m_total && pa < h) ? gathered[(long)gm * h + pa] : T(0);
    b_tile[threadIdx.y][threadIdx.x] = (gn < n && pb < h) ? weight[(long)gn * h + pb] : T(0);
    __syncthreads();
#pragma unroll
    for (int q = 0; q < HET_TILE; ++q) acc += a_tile[threadIdx.y][q] * b_tile[q][threadIdx.x];
    __syncthreads();
  }
  if (gm < m_total && gn < n) {
    const int r = gm / cs, i = gm % cs;
    out[((long)r * rows + (long)c * cs + i) * n + gn] = acc;
  }
}

}  // namespace het

extern "C" {

// Launch the GEMM of piece `c` on `stream`. Returns a cudaError_t as int (0 = success).
int het_chunk_gemm_f32(const float* gathered, const float* weight, float* out, int tp, int cs, int h,
                       int n, int rows, int c, cudaStream_t stream) {
  dim3 block(HET_TILE, HET_TILE);
  dim3 grid((n + HET_TILE - 1) / HET_TILE, (tp * cs + HET_TILE - 1) / HET_TILE);
  het::chunk_gemm_kernel<float><<<grid, block, 0, stream>>>(gathered, weight, out, tp, cs, h, n, rows, c);
  return static_cast<int>(cudaGetLastError());
}

int het_chunk_gemm_f64(const double* gathered, const double* weight, double* out, int tp, int cs, int h,
                       int n, int rows, int c, cudaStream_t stream) {
  dim3 block(HET_TILE, HET_TILE);
  dim3 grid((n + HET_TILE - 1) / HET_TILE, (tp * cs + HET_TILE - 1) / HET_TILE);
  het::chunk_gemm_kernel<double><<<grid, block, 0, stream>>>(gathered, weight, out, tp, cs, h, n, rows, c);
  return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
