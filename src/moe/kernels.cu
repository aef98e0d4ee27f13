// MoE layer kernels: fp8 1x128 quantisation, SwiGLU activation, router,
// weighted partials.

#include <cuda_bf16.h>

#include "epx/cuda_check.hpp"
#include "core/fp8.cuh"
#include "epx/error.hpp"
#include "moe/kernels.hpp"
#include "moe/row_buckets.hpp"

namespace epx::moe {
namespace {

constexpr int kBlock = kFp8BlockSize;  // 1x128 activation blocks: one warp, 4 values per lane

__device__ __forceinline__ float bf16_bits_to_float(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

__device__ __forceinline__ uint16_t float_to_bf16_bits(float f) {
  const __nv_bfloat16 b = __float2bfloat16_rn(f);
  return *reinterpret_cast<const uint16_t*>(&b);
}

__device__ __forceinline__ float load(const void* p, size_t i, bool bf16) {
  return bf16 ? bf16_bits_to_float(static_cast<const uint16_t*>(p)[i])
              : static_cast<const float*>(p)[i];
}

// Quantises the 4 values v of this lane (block of 128 spread over the warp,
// lane holds elements 4*lane .. 4*lane+3) as ref::quantize_fp8 (core/fp8.cuh).
__device__ __forceinline__ void quantize_block(const float (&v)[4], uint8_t* q, float* scale) {
  float block_scale;
  const uint32_t packed = dev::quantize_fp8_block<4>(v, block_scale, /*round_scale=*/false);
  const int lane = threadIdx.x & 31;
  *reinterpret_cast<uint32_t*>(q + 4 * lane) = packed;
  if (lane == 0) *scale = block_scale;
}

// One warp per (output row, 128-block).
__global__ void __launch_bounds__(256) quantize_rows_kernel(const QuantizeRowsParams p) {
  const int blocks = p.k / kBlock;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  const int total = p.m_pad * blocks;
  const int m = p.m_dev != nullptr ? min(*p.m_dev, p.m) : p.m;
  for (int w = warp; w < total; w += (gridDim.x * blockDim.x) >> 5) {
    const int r = w / blocks;
    const int b = w % blocks;
    uint8_t* q = p.dst_q + size_t(r) * p.k + size_t(b) * kBlock;
    float* scale = p.dst_scales + act_scale_index(p.order, r, b, p.m_pad, blocks);
    if (r >= m) {
      *reinterpret_cast<uint32_t*>(q + 4 * lane) = 0u;
      if (lane == 0) *scale = 1.0f;
      continue;
    }
    const int src_row = p.rows != nullptr ? p.rows[r] : r;
    const size_t off = size_t(src_row) * p.k + size_t(b) * kBlock + 4 * lane;
    if (p.src_fp8) {
      *reinterpret_cast<uint32_t*>(q + 4 * lane) =
          *reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(p.src) + off);
      if (lane == 0) {
        *scale = p.src_scales_col_major ? p.src_scales[size_t(b) * p.src_rows + src_row]
                                        : p.src_scales[size_t(src_row) * blocks + b];
      }
      continue;
    }
    const uint16_t* x = static_cast<const uint16_t*>(p.src) + off;
    float v[4];
    for (int j = 0; j < 4; ++j) v[j] = bf16_bits_to_float(x[j]);
    quantize_block(v, q, scale);
  }
}

__global__ void __launch_bounds__(256) silu_quantize_kernel(const SiluQuantizeParams p) {
  const int blocks = p.i / kBlock;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  const int total = p.m_pad * blocks;
  for (int w = warp; w < total; w += (gridDim.x * blockDim.x) >> 5) {
    const int r = w / blocks;
    const int b = w % blocks;
    const size_t off = size_t(r) * p.i + size_t(b) * kBlock + 4 * lane;
    float v[4];
    for (int j = 0; j < 4; ++j) {
      const float h1 = load(p.h1, off + j, p.h_bf16);
      const float h3 = load(p.h3, off + j, p.h_bf16);
      const float act = h1 / (1.0f + expf(-h1)) * h3;
      v[j] = bf16_bits_to_float(float_to_bf16_bits(act));  // the one bf16 rounding
    }
    quantize_block(v, p.act_q + size_t(r) * p.i + size_t(b) * kBlock,
                   p.act_scales + act_scale_index(p.order, r, b, p.m_pad, blocks));
  }
}

// Index of the largest v[i] among allowed i, ascending scan, strict comparison
// (ref's argmax_first): ties keep the lower index, a NaN never wins.
template <typename Allowed>
__device__ int argmax_first(const float* v, int count, Allowed allowed) {
  int best = -1;
  for (int i = 0; i < count; ++i) {
    if (!allowed(i)) continue;
    if (best < 0 || v[i] > v[best]) best = i;
  }
  return best;
}

// One block per token: logits in parallel (one thread per expert, h ascending),
// then thread 0 routes serially, exactly as ref::route_from_logits.
__global__ void __launch_bounds__(128) router_kernel(const RouterParams p) {
  extern __shared__ float smem[];
  const int E = p.num_experts;
  float* logit = smem;                                   // [E]
  float* score = logit + E;                              // [E]
  float* choice = score + E;                             // [E]
  float* group_score = choice + E;                       // [E] (num_groups <= E)
  int* flags = reinterpret_cast<int*>(group_score + E);  // [E] taken, then [G] kept
  const int n = blockIdx.x;
  const uint16_t* x = p.x + size_t(n) * p.hidden;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const uint16_t* g = p.gate + size_t(e) * p.hidden;
    float acc = 0.0f;
    // bf16 x bf16 products are exact in f32, so the fma rounds exactly like acc
    // + x * g.
    for (int h = 0; h < p.hidden; ++h)
      acc = fmaf(bf16_bits_to_float(x[h]), bf16_bits_to_float(g[h]), acc);
    logit[e] = acc;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  const int per_group = E / p.num_groups;
  int* taken = flags;
  int* kept = flags + E;  // [num_groups]
  if (p.grouped) {
    for (int e = 0; e < E; ++e) {
      score[e] = 1.0f / (1.0f + expf(-logit[e]));
      choice[e] = score[e] + p.bias[e];
    }
    for (int g = 0; g < p.num_groups; ++g) {
      const float* members = choice + g * per_group;
      const int first = argmax_first(members, per_group, [](int) { return true; });
      float sum = members[first];
      if (per_group >= 2) {
        const int second = argmax_first(members, per_group, [&](int i) { return i != first; });
        sum += members[second];
      }
      group_score[g] = sum;
    }
    for (int g = 0; g < p.num_groups; ++g) kept[g] = 0;
    for (int t = 0; t < p.topk_groups; ++t) {
      const int g = argmax_first(group_score, p.num_groups, [&](int i) { return kept[i] == 0; });
      kept[g] = 1;
    }
  } else {
    float m = logit[0];
    for (int e = 1; e < E; ++e) m = m < logit[e] ? logit[e] : m;  // std::max(m, l)
    float z = 0.0f;
    for (int e = 0; e < E; ++e) {
      score[e] = expf(logit[e] - m);
      z += score[e];
    }
    for (int e = 0; e < E; ++e) {
      score[e] = score[e] / z;
      choice[e] = score[e];
    }
    for (int g = 0; g < p.num_groups; ++g) kept[g] = 1;
  }
  for (int e = 0; e < E; ++e) taken[e] = 0;
  int32_t* ids = p.ids + size_t(n) * p.topk;
  float* weights = p.weights + size_t(n) * p.topk;
  for (int k = 0; k < p.topk; ++k) {
    const int e =
        argmax_first(choice, E, [&](int i) { return taken[i] == 0 && kept[i / per_group] != 0; });
    taken[e] = 1;
    ids[k] = e;
  }
  float total = 0.0f;
  for (int k = 0; k < p.topk; ++k) total += score[ids[k]];
  for (int k = 0; k < p.topk; ++k) {
    if (p.grouped) {
      weights[k] = total > 0.0f ? score[ids[k]] / total * p.routed_scaling : 0.0f;
    } else {
      weights[k] = score[ids[k]] / total;
    }
  }
}

// One block per row.
__global__ void __launch_bounds__(256) weighted_partials_kernel(const WeightedPartialsParams p) {
  const int rows = *p.num_rows;
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    const int32_t* slot = p.slots + size_t(r) * p.topk;
    const float* w = p.weights + size_t(r) * p.topk;
    for (int h = threadIdx.x; h < p.hidden; h += blockDim.x) {
      float acc = 0.0f;
      for (int k = 0; k < p.topk; ++k) {
        if (slot[k] < 0) continue;
        acc = fmaf(w[k], load(p.out, size_t(slot[k]) * p.hidden + h, p.out_bf16), acc);
      }
      p.partials[size_t(r) * p.hidden + h] = float_to_bf16_bits(acc);
    }
  }
}

struct ElementwiseParams {
  const void* src;
  bool src_bf16;
  size_t count;
  uint16_t* dst;
  bool add;  // dst = bf16(float(dst) + src) instead of dst = bf16(src)
};

__global__ void __launch_bounds__(256) elementwise_kernel(const ElementwiseParams p) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.count;
       i += size_t(gridDim.x) * blockDim.x) {
    float v = load(p.src, i, p.src_bf16);
    if (p.add) v = bf16_bits_to_float(p.dst[i]) + v;
    p.dst[i] = float_to_bf16_bits(v);
  }
}

__global__ void __launch_bounds__(256) store_rows_kernel(const StoreRowsParams p) {
  const int rows = min(*p.rows_dev, p.max_rows);
  const size_t count = size_t(rows > 0 ? rows : 0) * size_t(p.cols);
  const size_t r0 = p.dst_row_dev != nullptr ? size_t(*p.dst_row_dev) : 0;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    const float v = load(p.src, i, p.src_bf16);
    const size_t j = r0 * size_t(p.cols) + i;
    if (p.dst_bf16) {
      static_cast<uint16_t*>(p.dst)[j] = float_to_bf16_bits(v);
    } else {
      static_cast<float*>(p.dst)[j] = v;
    }
  }
}

// One block; warp w owns local experts w, w + 32, ... and scans the rows in order 32 at a time
// (ballot + popc keep the row order), once to count, once to place.
constexpr int kGroupWarps = 32;
__global__ void __launch_bounds__(kGroupWarps * 32) group_rows_kernel(const GroupRowsParams p) {
  const int rows = min(*p.num_rows, p.capacity);
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  for (int i = threadIdx.x; i < rows * p.topk; i += blockDim.x) p.slots[i] = -1;
  // k of local expert e in row r (first occurrence), or -1.
  const auto k_of = [&](int r, int e) {
    if (r >= rows) return -1;
    const int32_t* ids = p.topk_ids + size_t(r) * p.topk;
    for (int k = 0; k < p.topk; ++k)
      if (ids[k] == p.first_expert + e) return k;
    return -1;
  };
  for (int e = warp; e < p.num_local; e += kGroupWarps) {
    int count = 0;
    for (int r0 = 0; r0 < rows; r0 += 32)
      count += __popc(__ballot_sync(0xffffffffu, k_of(r0 + lane, e) >= 0));
    if (lane == 0) p.counts[e] = count;
  }
  __syncthreads();  // now counts[] and every slot = -1 are visible to the block
  if (threadIdx.x == 0) {
    int start = 0;
    for (int e = 0; e < p.num_local; ++e) {
      p.out_start[e] = start;
      start += padded_rows(p.counts[e]);
    }
  }
  __syncthreads();
  for (int e = warp; e < p.num_local; e += kGroupWarps) {
    const int start = p.out_start[e];
    int placed = 0;
    for (int r0 = 0; r0 < rows; r0 += 32) {
      const int r = r0 + lane;
      const int k = k_of(r, e);
      const unsigned mask = __ballot_sync(0xffffffffu, k >= 0);
      if (k >= 0) {
        const int pos = placed + __popc(mask & ((1u << lane) - 1u));
        p.rows[size_t(e) * p.capacity + pos] = r;
        p.slots[size_t(r) * p.topk + k] = start + pos;
      }
      placed += __popc(mask);
    }
  }
}

__global__ void set_expert_switches_kernel(const ExpertSwitchParams p) {
  const int e = threadIdx.x;
  if (e < p.num_experts) cudaGraphSetConditional(p.handles[e], row_bucket_index(p.counts[e]));
}

int warp_grid(int warps) {
  const int blocks = (warps + 7) / 8;  // 8 warps per 256-thread block
  return blocks < 4096 ? (blocks > 0 ? blocks : 1) : 4096;
}

int elem_grid(size_t count) {
  const size_t blocks = (count + 255) / 256;
  return blocks < 4096 ? (blocks > 0 ? int(blocks) : 1) : 4096;
}

}  // namespace

void launch_quantize_rows(const QuantizeRowsParams& p, cudaStream_t stream) {
  if (p.m_pad == 0) return;
  quantize_rows_kernel<<<warp_grid(p.m_pad * (p.k / kBlock)), 256, 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
}

void launch_silu_quantize(const SiluQuantizeParams& p, cudaStream_t stream) {
  if (p.m_pad == 0) return;
  silu_quantize_kernel<<<warp_grid(p.m_pad * (p.i / kBlock)), 256, 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
}

// logit, score, choice, group_score: 4 x [E] f32; taken [E] and kept [G <= E]
// int.
size_t router_smem_bytes(int num_experts) {
  return size_t(num_experts) * (4 * sizeof(float) + 2 * sizeof(int));
}

void launch_router(const RouterParams& p, cudaStream_t stream) {
  if (p.n == 0) return;
  const size_t smem = router_smem_bytes(p.num_experts);
  if (smem > 48 * 1024) {
    EPX_CUDA_CHECK(cudaFuncSetAttribute(router_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  }
  router_kernel<<<p.n, 128, smem, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
}

void launch_weighted_partials(const WeightedPartialsParams& p, cudaStream_t stream) {
  if (p.max_rows == 0) return;
  const int grid = p.max_rows < 1024 ? p.max_rows : 1024;
  weighted_partials_kernel<<<grid, 256, 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
}

void launch_store_bf16(const void* src, bool src_bf16, int rows, int cols, uint16_t* dst,
                       cudaStream_t stream) {
  const size_t count = size_t(rows) * size_t(cols);
  if (count == 0) return;
  elementwise_kernel<<<elem_grid(count), 256, 0, stream>>>(
      ElementwiseParams{src, src_bf16, count, dst, false});
  EPX_CUDA_CHECK(cudaGetLastError());
}

void launch_add_shared(uint16_t* y, const void* shared, bool shared_bf16, int rows, int cols,
                       cudaStream_t stream) {
  const size_t count = size_t(rows) * size_t(cols);
  if (count == 0) return;
  elementwise_kernel<<<elem_grid(count), 256, 0, stream>>>(
      ElementwiseParams{shared, shared_bf16, count, y, true});
  EPX_CUDA_CHECK(cudaGetLastError());
}

void launch_store_rows(const StoreRowsParams& p, cudaStream_t stream) {
  const size_t count = size_t(p.max_rows) * size_t(p.cols);
  if (count == 0) return;
  store_rows_kernel<<<elem_grid(count), 256, 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
}

void launch_group_rows(const GroupRowsParams& p, cudaStream_t stream) {
  if (p.num_local == 0) return;
  group_rows_kernel<<<1, kGroupWarps * 32, 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
}

void launch_set_expert_switches(const ExpertSwitchParams& p, cudaStream_t stream) {
  EPX_CHECK(p.num_experts >= 0 && p.num_experts <= kSwitchHandlesPerLaunch, InputError,
            "num_experts", p.num_experts,
            "in [0, " + std::to_string(kSwitchHandlesPerLaunch) + "]");
  if (p.num_experts == 0) return;
  set_expert_switches_kernel<<<1, kSwitchHandlesPerLaunch, 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
}

namespace {

// 32 x 32 tiles through shared memory: coalesced reads of src columns and writes of dst rows.
template <typename T>
__global__ void __launch_bounds__(256) transpose_kernel(const T* src, int ld_src, int rows,
                                                        int cols, T* dst) {
  __shared__ T tile[32][33];
  const int r0 = blockIdx.x * 32, c0 = blockIdx.y * 32;
  for (int j = threadIdx.y; j < 32; j += 8) {
    const int r = r0 + threadIdx.x, c = c0 + j;
    if (r < rows && c < cols) tile[j][threadIdx.x] = src[size_t(c) * ld_src + r];
  }
  __syncthreads();
  for (int j = threadIdx.y; j < 32; j += 8) {
    const int r = r0 + j, c = c0 + threadIdx.x;
    if (r < rows && c < cols) dst[size_t(r) * cols + c] = tile[threadIdx.x][j];
  }
}

}  // namespace

void launch_transpose(const void* src, int ld_src, int rows, int cols, int elem_bytes, void* dst,
                      cudaStream_t stream) {
  EPX_CHECK(elem_bytes == 2 || elem_bytes == 4, InputError, "elem_bytes", elem_bytes, "2 or 4");
  if (rows == 0 || cols == 0) return;
  const dim3 grid((rows + 31) / 32, (cols + 31) / 32), block(32, 8);
  if (elem_bytes == 2) {
    transpose_kernel<<<grid, block, 0, stream>>>(static_cast<const uint16_t*>(src), ld_src, rows,
                                                 cols, static_cast<uint16_t*>(dst));
  } else {
    transpose_kernel<<<grid, block, 0, stream>>>(static_cast<const float*>(src), ld_src, rows, cols,
                                                 static_cast<float*>(dst));
  }
  EPX_CUDA_CHECK(cudaGetLastError());
}

void preload_moe_kernels() {
  cudaFuncAttributes attr{};
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, quantize_rows_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, silu_quantize_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, router_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, weighted_partials_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, elementwise_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, store_rows_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, group_rows_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, set_expert_switches_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, transpose_kernel<uint16_t>));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, transpose_kernel<float>));
}

}  // namespace epx::moe
