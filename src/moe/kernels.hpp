#pragma once
// Device kernels of the MoE layer (router, fp8 quantisation, SwiGLU activation,
// weighted partials). Host launchers; each takes one params struct and enqueues
// on `stream`. Numerics follow src/reference/moe_ref.hpp; where a kernel is
// bit-exact with the reference it says so.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "moe/fp8_gemm.hpp"

namespace epx::moe {

// Rows -> fp8 e4m3 [m_pad][k] + 1x128 scales in `order` (fp8_gemm.hpp) for m_pad rows.
// Output row j is source row rows[j] (rows == nullptr: row j). Rows [m, m_pad) are written as
// zeros with scale 1 (finite padding for the GEMM).
//   bf16 source: quantised exactly as ref::quantize_fp8 (bit-identical codes and scales).
//   fp8 source (already quantised on the wire): codes copied, scales read from row-major
//   [src_rows][k/128] or, with src_scales_col_major, [k/128][src_rows].
struct QuantizeRowsParams {
  const void* src = nullptr;  // [src_rows][k] bf16 or fp8
  bool src_fp8 = false;
  const float* src_scales = nullptr;
  bool src_scales_col_major = false;
  int src_rows = 0;               // rows of the source (leading dim of col-major scales)
  const int32_t* rows = nullptr;  // [m] source row of each output row, or nullptr
  int m = 0;
  const int32_t* m_dev = nullptr;  // device row count: min(*m_dev, m) replaces m (graph capture)
  int m_pad = 0;
  int k = 0;                    // multiple of 128
  uint8_t* dst_q = nullptr;     // [m_pad][k]
  float* dst_scales = nullptr;  // m_pad rows in `order`
  ActScaleOrder order = ActScaleOrder::kBlockMajor;
};
void launch_quantize_rows(const QuantizeRowsParams& p, cudaStream_t stream);

// act = silu(h1) * h3 (f32, silu(h) = h / (1 + expf(-h))), act_bf16 =
// bf16(act), then quantised as ref::quantize_fp8 over 1x128 blocks of act_bf16.
// h1, h3: [m_pad][i] f32 or bf16 (GEMM out). Equal to the reference up to
// expf's last-place differences from std::exp.
struct SiluQuantizeParams {
  const void* h1 = nullptr;
  const void* h3 = nullptr;
  bool h_bf16 = false;
  int m_pad = 0;
  int i = 0;                    // multiple of 128
  uint8_t* act_q = nullptr;     // [m_pad][i]
  float* act_scales = nullptr;  // m_pad rows in `order`
  ActScaleOrder order = ActScaleOrder::kBlockMajor;
};
void launch_silu_quantize(const SiluQuantizeParams& p, cudaStream_t stream);

// Router: logits in f32 (h ascending from +0, bit-exact with
// ref::router_logits), then the scoring of ref::route_from_logits done serially
// per token (same comparisons, ties to the lower id). sigmoid / softmax use
// expf, so scores may differ from std::exp in the last place and a near-tie may
// resolve differently from the reference.
struct RouterParams {
  const uint16_t* x = nullptr;     // [n][h] bf16
  const uint16_t* gate = nullptr;  // [e][h] bf16
  const float* bias = nullptr;     // [e] (sigmoid_grouped)
  int n = 0;
  int hidden = 0;
  int num_experts = 0;
  int topk = 0;
  int num_groups = 1;
  int topk_groups = 1;
  float routed_scaling = 1.0f;
  bool grouped = true;       // sigmoid_grouped; false = softmax
  int32_t* ids = nullptr;    // [n][topk]
  float* weights = nullptr;  // [n][topk]
};
void launch_router(const RouterParams& p, cudaStream_t stream);
// Dynamic shared memory the router kernel needs for num_experts (bounded by the
// device's limit).
size_t router_smem_bytes(int num_experts);

// partials[r][h] = bf16(sum over k ascending with slot[r][k] >= 0 of w[r][k] *
// out[slot][h]), fmaf from +0 (the reference's order for the local experts).
// rows = *num_rows (device).
struct WeightedPartialsParams {
  const void* out = nullptr;  // [*][h] expert outputs (f32 or bf16), rows addressed by slot
  bool out_bf16 = false;
  const int32_t* slots = nullptr;     // [rows][topk], -1 = expert not local
  const float* weights = nullptr;     // [rows][topk]
  const int32_t* num_rows = nullptr;  // device scalar
  int max_rows = 0;                   // grid bound
  int topk = 0;
  int hidden = 0;
  uint16_t* partials = nullptr;  // [rows][h] bf16
};
void launch_weighted_partials(const WeightedPartialsParams& p, cudaStream_t stream);

// dst[r][c] = bf16(src[r][c]) for r < rows (expert-major outputs).
void launch_store_bf16(const void* src, bool src_bf16, int rows, int cols, uint16_t* dst,
                       cudaStream_t stream);

// y[r][c] = bf16(float(y[r][c]) + shared[r][c]) (shared expert added after
// combine).
void launch_add_shared(uint16_t* y, const void* shared, bool shared_bf16, int rows, int cols,
                       cudaStream_t stream);

// dst[r][c] = src[c * ld_src + r] for r < rows, c < cols: a column-major GEMM result
// (fp8_gemm.cpp, activations-first operand order) to row-major [rows][cols]. Elements of 2 bytes
// (bf16) or 4 bytes (f32).
void launch_transpose(const void* src, int ld_src, int rows, int cols, int elem_bytes, void* dst,
                      cudaStream_t stream);

// ---- the expert stage under CUDA graph capture (row counts only on the device) ----------------

// dst rows [r0, r0 + rows) = src rows [0, rows), converted to dst's type, where rows =
// min(*rows_dev, max_rows) and r0 = dst_row_dev ? *dst_row_dev : 0. src, dst: f32 or bf16, `cols`
// per row.
struct StoreRowsParams {
  const void* src = nullptr;
  bool src_bf16 = false;
  void* dst = nullptr;
  bool dst_bf16 = true;
  int cols = 0;
  int max_rows = 0;  // grid bound
  const int32_t* rows_dev = nullptr;
  const int32_t* dst_row_dev = nullptr;
};
void launch_store_rows(const StoreRowsParams& p, cudaStream_t stream);

// Token-major rows grouped by local expert on the device (one block), the lists the eager path
// builds on the host: for local expert e, counts[e] rows that use it, their source rows ascending
// in rows[e][0, counts[e]), and out_start[e] = sum over e' < e of padded_rows(counts[e']);
// slots[r][k] = out_start[e] + position of r in e's list where topk_ids[r][k] is local expert e
// (its first occurrence in the row), else -1, for r < *num_rows.
struct GroupRowsParams {
  const int32_t* topk_ids = nullptr;  // [capacity][topk]
  const int32_t* num_rows = nullptr;  // device scalar, <= capacity
  int capacity = 0;
  int topk = 0;
  int first_expert = 0;  // global id of local expert 0
  int num_local = 0;
  int32_t* counts = nullptr;     // [num_local]
  int32_t* out_start = nullptr;  // [num_local]
  int32_t* rows = nullptr;       // [num_local][capacity]
  int32_t* slots = nullptr;      // [capacity][topk]
};
void launch_group_rows(const GroupRowsParams& p, cudaStream_t stream);

// For each local expert e < num_experts: cudaGraphSetConditional(handles[e],
// row_bucket_index(counts[e])) (0 when counts[e] <= 0; an index beyond the SWITCH node's bodies,
// i.e. counts[e] above the bound the bodies were captured for, runs no body). Device side of
// MoeLayer's captured expert stage; must be launched inside the graph that owns the handles.
inline constexpr int kSwitchHandlesPerLaunch = 128;
struct ExpertSwitchParams {
  const int32_t* counts = nullptr;
  int num_experts = 0;  // <= kSwitchHandlesPerLaunch
  cudaGraphConditionalHandle handles[kSwitchHandlesPerLaunch] = {};
};
void launch_set_expert_switches(const ExpertSwitchParams& p, cudaStream_t stream);

// Loads every kernel of this file (CUDA lazy loading would otherwise wait for
// running kernels, which deadlocks with ranks spinning on each other; see
// all2all.hpp).
void preload_moe_kernels();

}  // namespace epx::moe
