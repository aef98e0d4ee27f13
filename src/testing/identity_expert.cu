#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "testing/identity_expert.hpp"
#include "epx/cuda_check.hpp"
#include "epx/error.hpp"

namespace epx::testing {
namespace {

struct IdentityParams {
  int hidden, topk, num_local, e0, capacity, groups, wire_fp8, scale_col_major, expert_major;
  const int32_t* count;  // token-major: recv_count (1); expert-major: expert_counts [E/W]
  const void* x;         // recv_x or expert_x
  const float* scales;
  const int32_t* topk_ids;
  const float* topk_w;
  __nv_bfloat16* out;
};

__device__ __forceinline__ float value(const IdentityParams& p, const void* x, const float* sc,
                                       int rows, int row, int h) {
  if (p.wire_fp8) {
    const __nv_fp8_e4m3 q =
        reinterpret_cast<const __nv_fp8_e4m3*>(x)[size_t(row) * p.hidden + h];
    const int g = h / 128;
    const float s = p.scale_col_major ? sc[size_t(g) * rows + row] : sc[size_t(row) * p.groups + g];
    return float(q) * s;
  }
  return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(x)[size_t(row) * p.hidden + h]);
}

__global__ void identity_kernel(const IdentityParams p) {
  const int e = p.expert_major ? blockIdx.y : 0;
  const int rows = p.count[e];
  const size_t plane = size_t(p.capacity) * p.hidden;
  const void* x = p.expert_major
                      ? static_cast<const void*>(static_cast<const uint8_t*>(p.x) +
                                                 size_t(e) * p.capacity * p.hidden * (p.wire_fp8 ? 1 : 2))
                      : p.x;
  const float* sc = p.scales == nullptr ? nullptr : p.scales + size_t(e) * p.capacity * p.groups * p.expert_major;
  __nv_bfloat16* out = p.out + plane * e;
  for (int row = blockIdx.x; row < rows; row += gridDim.x) {
    for (int h = threadIdx.x; h < p.hidden; h += blockDim.x) {
      const float v = value(p, x, sc, p.capacity, row, h);
      float acc = 0.f;
      if (p.expert_major) {
        acc = v;
      } else {
        for (int k = 0; k < p.topk; ++k) {
          const int id = p.topk_ids[size_t(row) * p.topk + k];
          if (id >= p.e0 && id < p.e0 + p.num_local) acc = fmaf(p.topk_w[size_t(row) * p.topk + k], v, acc);
        }
      }
      out[size_t(row) * p.hidden + h] = __float2bfloat16_rn(acc);
    }
  }
}

__global__ void set_identity_switch_kernel(cudaGraphConditionalHandle handle,
                                           const int32_t* recv_count) {
  cudaGraphSetConditional(handle, *recv_count > 0 ? 1u : 0u);
}

}  // namespace

void preload_identity_expert() {
  cudaFuncAttributes attr{};
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, identity_kernel));
  EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, set_identity_switch_kernel));
}

void launch_identity_expert(const EpConfig& cfg, const DispatchResult& d, void* out,
                            cudaStream_t stream) {
  const bool em = cfg.layout == OutputLayout::kExpertMajor;
  IdentityParams p{cfg.hidden,
                   cfg.topk,
                   cfg.num_local_experts(),
                   cfg.rank * cfg.num_local_experts(),
                   d.capacity,
                   cfg.num_scale_groups(),
                   cfg.wire_fp8(),
                   cfg.scale_layout == ScaleLayout::kColumnMajor,
                   em,
                   em ? d.expert_counts : d.recv_count,
                   em ? d.expert_x : d.recv_x,
                   em ? d.expert_scales : d.recv_scales,
                   d.recv_topk_ids,
                   d.recv_topk_weights,
                   static_cast<__nv_bfloat16*>(out)};
  const dim3 grid(64, em ? cfg.num_local_experts() : 1);
  identity_kernel<<<grid, 256, 0, stream>>>(p);
  EPX_CUDA_CHECK(cudaGetLastError());
}

void capture_identity_expert_switch(const EpConfig& cfg, const DispatchResult& d, void* out,
                                    cudaStream_t stream, cudaStream_t side) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaGraph_t graph = nullptr;
  EPX_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph));
  EPX_CHECK(status == cudaStreamCaptureStatusActive, StateError, "stream", "not capturing",
            "a stream under capture");
  cudaGraphConditionalHandle handle{};
  EPX_CUDA_CHECK(cudaGraphConditionalHandleCreate(&handle, graph, 0, cudaGraphCondAssignDefault));
  set_identity_switch_kernel<<<1, 1, 0, stream>>>(handle, d.recv_count);
  EPX_CUDA_CHECK(cudaGetLastError());
  const cudaGraphNode_t* deps = nullptr;
  const cudaGraphEdgeData* edges = nullptr;
  size_t num_deps = 0;
  EPX_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph, &deps, &edges, &num_deps));
  cudaGraphNodeParams params{};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = handle;
  params.conditional.type = cudaGraphCondTypeSwitch;
  params.conditional.size = 2;
  cudaGraphNode_t node = nullptr;
  EPX_CUDA_CHECK(cudaGraphAddNode(&node, graph, deps, edges, num_deps, &params));
  EPX_CUDA_CHECK(cudaStreamBeginCaptureToGraph(side, params.conditional.phGraph_out[1], nullptr,
                                               nullptr, 0, cudaStreamCaptureModeThreadLocal));
  launch_identity_expert(cfg, d, out, side);
  cudaGraph_t ended = nullptr;
  EPX_CUDA_CHECK(cudaStreamEndCapture(side, &ended));
  EPX_CUDA_CHECK(cudaStreamUpdateCaptureDependencies(stream, &node, nullptr, 1,
                                                     cudaStreamSetCaptureDependencies));
}

}  // namespace epx::testing
