// MoeLayer: router -> dispatch -> fp8 SwiGLU experts (cuBLASLt) -> combine -> +
// shared expert.

#include <fmt/format.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "epx/cuda_check.hpp"
#include "epx/error.hpp"
#include "epx/moe.hpp"
#include "moe/fp8_gemm.hpp"
#include "moe/kernels.hpp"
#include "moe/row_buckets.hpp"

namespace epx {
namespace {

using moe::GemmOut;

// One fp8 weight matrix of the caller's: codes [rows][cols] and scales [rows/128][cols/128],
// row-major, the order the GEMMs read.
struct DeviceMatrix {
  const uint8_t* q = nullptr;
  const float* scales = nullptr;
};

struct DeviceExpert {
  int intermediate = 0;
  DeviceMatrix w1, w3, w2;
};

// The GEMMs read the checkpoint's weight scales as they are, so the caller's weights need no
// device copy in another layout (moe.hpp).
static_assert(moe::Fp8ScaleLayouts{}.weight == moe::WeightScaleOrder::kRowMajor,
              "MoeLayer reads [rows/128][cols/128] row-major weight scales in place");

DeviceMatrix device_matrix(const Fp8BlockWeight& w) {
  return DeviceMatrix{static_cast<const uint8_t*>(w.weight), w.scale_inv};
}

DeviceExpert device_expert(const MoeExpertWeights& w, int intermediate) {
  return DeviceExpert{intermediate, device_matrix(w.gate), device_matrix(w.up),
                      device_matrix(w.down)};
}

// Throws InputError naming `field` unless p is memory of `device` (or managed memory) on an
// `align`-byte boundary.
void check_pointer(const void* p, size_t align, const std::string& field, int device) {
  EPX_CHECK(p != nullptr, InputError, field, "null", "a device pointer");
  EPX_CHECK(reinterpret_cast<uintptr_t>(p) % align == 0, InputError, field, p,
            std::to_string(align) + "-byte aligned");
  cudaPointerAttributes attr{};
  EPX_CUDA_CHECK(cudaPointerGetAttributes(&attr, p));
  const bool here = (attr.type == cudaMemoryTypeDevice && attr.device == device) ||
                    attr.type == cudaMemoryTypeManaged;
  const char* kind = attr.type == cudaMemoryTypeDevice ? " (memory of another device)"
                     : attr.type == cudaMemoryTypeHost ? " (pinned host memory)"
                                                       : " (host memory)";
  EPX_CHECK(here, InputError, field, detail::str(p) + kind,
            "memory of the current device " + std::to_string(device) + " (or managed memory)");
}

void check_null(const void* p, const std::string& field, const std::string& why) {
  EPX_CHECK(p == nullptr, InputError, field, p, "null (" + why + ")");
}

// The view's pointers, before any kernel reads them (moe.hpp: MoeWeights).
void check_weights(const MoeShape& shape, const MoeWeights& w, const EpConfig& ep) {
  int device = 0;
  EPX_CUDA_CHECK(cudaGetDevice(&device));
  // cuBLASLt's fp8 operands and block scales; the router's rows are then 16-byte aligned too.
  constexpr size_t kAlign = 16;
  const auto parts = [](const MoeExpertWeights& e) {
    return std::array{std::pair{&e.gate, ".gate"}, std::pair{&e.up, ".up"},
                      std::pair{&e.down, ".down"}};
  };
  const auto check_expert = [&](const MoeExpertWeights& e, const std::string& name) {
    for (const auto& [m, part] : parts(e)) {
      check_pointer(m->weight, kAlign, name + part + ".weight", device);
      check_pointer(m->scale_inv, kAlign, name + part + ".scale_inv", device);
    }
  };
  check_pointer(w.router, kAlign, "weights.router", device);
  if (shape.scoring == MoeScoring::kSigmoidGrouped) {
    check_pointer(w.correction_bias, alignof(float), "weights.correction_bias", device);
  } else {
    check_null(w.correction_bias, "weights.correction_bias", "softmax scoring has no bias");
  }
  const int local = ep.num_local_experts();
  EPX_CHECK(w.experts.size() == size_t(local), InputError, "weights.experts.size()",
            w.experts.size(), "E / world_size = " + std::to_string(local) + " local experts");
  for (size_t i = 0; i < w.experts.size(); ++i)
    check_expert(w.experts[i], "weights.experts[" + std::to_string(i) + "]");
  if (shape.has_shared_expert()) {
    check_expert(w.shared, "weights.shared");
  } else {
    for (const auto& [m, part] : parts(w.shared)) {
      const std::string name = std::string("weights.shared") + part;
      check_null(m->weight, name + ".weight", "the shape has no shared expert");
      check_null(m->scale_inv, name + ".scale_inv", "the shape has no shared expert");
    }
  }
}

}  // namespace

struct MoeLayer::Impl {
  MoeShape shape;
  EpConfig ep;
  moe::Fp8Gemm gemm;
  GemmOut out_type = GemmOut::kF32;
  std::vector<void*> allocations;

  const uint16_t* gate = nullptr;     // [E][H] bf16 (the caller's)
  const float* bias = nullptr;        // [E] (the caller's; null for softmax)
  std::vector<DeviceExpert> experts;  // local experts, then (if any) the shared one last
  bool has_shared = false;

  int rows_pad = 0;  // rows of the per-expert scratch (padded)
  int max_inter = 0;
  int max_total_rows = 0;        // token-major: rows of all local experts' outputs together
  int32_t* route_ids = nullptr;  // [T][K] (when the caller passes no routing)
  float* route_w = nullptr;      // [T][K]
  uint8_t* in_q = nullptr;       // [T][H] (kFP8 dispatch input)
  float* in_s = nullptr;         // [T][H/128]
  uint8_t* xq = nullptr;         // [rows_pad][H]
  float* xs = nullptr;           // [rows_pad * H/128]
  void* h1 = nullptr;            // [rows_pad][max_inter] f32 (or bf16)
  void* h3 = nullptr;
  uint8_t* act_q = nullptr;  // [rows_pad][max_inter]
  float* act_s = nullptr;
  void* out_all = nullptr;       // token-major: [max_total_rows][H]; expert-major: [rows_pad][H]
  void* shared_out = nullptr;    // [padded T][H]
  int32_t* dev_rows = nullptr;   // [max_total_rows] source rows of each expert's GEMM rows
  int32_t* dev_slots = nullptr;  // [capacity][K] output row of (row, k) or -1
  std::vector<int32_t> host_ids, host_rows, host_slots;

  // Captured expert stage (forward() on a capturing stream).
  cudaStream_t side = nullptr;         // captures the SWITCH bodies; runs nothing
  int capture_tokens = 0;              // set_capture_token_bound (0 = max_tokens_per_rank)
  int a2a_tokens = 0;                  // max_tokens_per_rank of the All2All of the call under way
  std::function<void(cudaStream_t)> capture_split;  // set_capture_split
  CaptureExperts capture_experts = CaptureExperts::kSwitch;
  void* graph_out = nullptr;           // token-major: one expert's w2 output [rows_pad][H]
  int32_t* graph_counts = nullptr;     // token-major: [local] rows per local expert
  int32_t* graph_out_start = nullptr;  // token-major: [local] first row in out_all
  int32_t* graph_rows = nullptr;       // token-major: [local][capacity] source rows

  Impl(const MoeShape& s, const EpConfig& e, int gemm_sms)
      : shape(s), ep(e), gemm(moe::Fp8ScaleLayouts{}, size_t(32) << 20, gemm_sms) {}
  ~Impl() {
    if (side) cudaStreamDestroy(side);
    for (void* p : allocations) cudaFree(p);
  }

  size_t out_bytes() const { return out_type == GemmOut::kF32 ? 4 : 2; }

  template <typename T>
  T* alloc(size_t count) {
    void* p = nullptr;
    EPX_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)));
    allocations.push_back(p);
    return static_cast<T*>(p);
  }
  void* alloc_bytes(size_t bytes) { return alloc<uint8_t>(bytes); }

  // SwiGLU of one expert on m rows taken from `src` (rows [0, m) of the
  // quantise source). out: [padded_rows(m)][H] in out_type.
  void run_expert(const DeviceExpert& e, moe::QuantizeRowsParams src, int m, void* out,
                  cudaStream_t stream) {
    const int m_pad = moe::padded_rows(m);
    const int h = shape.hidden;
    src.m = m;
    src.m_pad = m_pad;
    src.k = h;
    src.dst_q = xq;
    src.dst_scales = xs;
    src.order = gemm.layouts().act;
    moe::launch_quantize_rows(src, stream);
    const bool bf16 = out_type == GemmOut::kBF16;
    gemm.run({.m = m_pad,
              .n = e.intermediate,
              .k = h,
              .a = xq,
              .a_scales = xs,
              .b = e.w1.q,
              .b_scales = e.w1.scales,
              .d = h1,
              .out = out_type},
             stream);
    gemm.run({.m = m_pad,
              .n = e.intermediate,
              .k = h,
              .a = xq,
              .a_scales = xs,
              .b = e.w3.q,
              .b_scales = e.w3.scales,
              .d = h3,
              .out = out_type},
             stream);
    moe::launch_silu_quantize({.h1 = h1,
                               .h3 = h3,
                               .h_bf16 = bf16,
                               .m_pad = m_pad,
                               .i = e.intermediate,
                               .act_q = act_q,
                               .act_scales = act_s,
                               .order = gemm.layouts().act},
                              stream);
    gemm.run({.m = m_pad,
              .n = h,
              .k = e.intermediate,
              .a = act_q,
              .a_scales = act_s,
              .b = e.w2.q,
              .b_scales = e.w2.scales,
              .d = out,
              .out = out_type},
             stream);
  }

  moe::QuantizeRowsParams wire_source(const void* x, const float* scales, int src_rows) const {
    moe::QuantizeRowsParams p;
    p.src = x;
    p.src_fp8 = ep.wire_fp8();
    p.src_scales = scales;
    p.src_scales_col_major = ep.scale_layout == ScaleLayout::kColumnMajor;
    p.src_rows = src_rows;
    return p;
  }

  void warm_up_gemms();
  // The router of n tokens at x (ids and weights into `ids`, `w`) and, for an fp8 input, the cast
  // of the rows: the dispatch input of the chunk.
  DispatchInput route(const void* x, int n, int32_t* ids, float* w, cudaStream_t stream);
  // The expert stage of a received round into d.combine_buffer: eagerly at the exact row counts
  // (one host sync), or under capture with the counts on the device.
  void expert_stage(const DispatchResult& d, All2All& a2a, cudaStream_t stream, bool captured);
  // The shared expert of n tokens at x into shared_out, and its addition to y.
  void shared_expert(const void* x, int n, cudaStream_t stream);
  void add_shared(void* y, int n, cudaStream_t stream);
  // InputError unless `a2a` was created with this layer's EpConfig (rank, shape, dtypes).
  // Throws unless `a2a` fits this layer; its max_tokens_per_rank becomes the chunk size.
  void check_a2a(const All2All& a2a);
  void experts_token_major(const DispatchResult& d, cudaStream_t stream);
  void experts_expert_major(const DispatchResult& d, cudaStream_t stream);

  // Under capture: the same expert stage with the row counts read on the device.
  using ExpertBody = std::function<void(int expert, int m_pad, cudaStream_t body_stream)>;
  void add_expert_switches(const int32_t* counts, cudaStream_t stream, const ExpertBody& body);
  // Calls capture_split (if set); StateError unless `stream` is capturing again afterwards.
  void call_capture_split(cudaStream_t stream);
  void captured_token_major(const DispatchResult& d, cudaStream_t stream);
  void captured_expert_major(const DispatchResult& d, cudaStream_t stream);
};

MoeLayer::MoeLayer(const MoeShape& shape, const MoeWeights& weights, const EpConfig& ep,
                   int gemm_sms)
    : impl_(std::make_unique<Impl>(shape, ep, gemm_sms)) {
  Impl& m = *impl_;
  shape.validate();
  ep.validate();
  EPX_CHECK(ep.hidden == shape.hidden, ConfigError, "EpConfig.hidden", ep.hidden,
            "MoeShape.hidden = " + std::to_string(shape.hidden));
  EPX_CHECK(ep.num_experts == shape.num_experts, ConfigError, "EpConfig.num_experts",
            ep.num_experts, "MoeShape.num_experts = " + std::to_string(shape.num_experts));
  EPX_CHECK(ep.topk == shape.topk, ConfigError, "EpConfig.topk", ep.topk,
            "MoeShape.topk = " + std::to_string(shape.topk));
  // The router keeps 4 f32 and 2 int32 per expert in shared memory.
  EPX_CHECK(moe::router_smem_bytes(shape.num_experts) <= 200 * 1024, ConfigError, "num_experts",
            shape.num_experts, "<= 8533 (router shared memory)");
  // Every GEMM has K = hidden or an intermediate size; see Fp8Gemm::run.
  EPX_CHECK(shape.hidden % 512 == 0, ConfigError, "hidden", shape.hidden,
            "a multiple of 512 (fp8 GEMM: K / 128 a multiple of 4)");
  EPX_CHECK(shape.intermediate % 512 == 0, ConfigError, "intermediate", shape.intermediate,
            "a multiple of 512 (fp8 GEMM: K / 128 a multiple of 4)");
  EPX_CHECK(shape.shared_intermediate % 512 == 0, ConfigError, "shared_intermediate",
            shape.shared_intermediate,
            "0 or a multiple of 512 (fp8 GEMM: K / 128 a multiple of 4)");
  check_weights(shape, weights, ep);
  moe::preload_moe_kernels();

  const int h = shape.hidden;
  const int k = shape.topk;
  const int local = ep.num_local_experts();
  const int t = ep.max_tokens_per_rank;
  const int cap = ep.capacity();
  m.has_shared = shape.shared_intermediate > 0;
  m.max_inter = std::max(shape.intermediate, shape.shared_intermediate);
  m.rows_pad = moe::padded_rows(std::max(cap, t));
  m.max_total_rows = cap * std::min(k, local) + local * moe::kMaxRowPad;

  // Keep f32 GEMM outputs (the reference's precision) unless cuBLASLt offers no
  // algorithm.
  m.out_type = GemmOut::kF32;
  if (!m.gemm.supports(m.rows_pad, shape.intermediate, h, GemmOut::kF32))
    m.out_type = GemmOut::kBF16;

  // Weights: the caller's, read in place.
  m.gate = static_cast<const uint16_t*>(weights.router);
  m.bias = weights.correction_bias;
  for (const MoeExpertWeights& w : weights.experts)
    m.experts.push_back(device_expert(w, shape.intermediate));
  if (m.has_shared) m.experts.push_back(device_expert(weights.shared, shape.shared_intermediate));

  const size_t groups = size_t(h) / 128;
  m.route_ids = m.alloc<int32_t>(size_t(t) * k);
  m.route_w = m.alloc<float>(size_t(t) * k);
  if (ep.input_fp8()) {
    m.in_q = m.alloc<uint8_t>(size_t(t) * h);
    m.in_s = m.alloc<float>(size_t(t) * groups);
  }
  m.xq = m.alloc<uint8_t>(size_t(m.rows_pad) * h);
  m.xs = m.alloc<float>(size_t(m.rows_pad) * groups);
  m.h1 = m.alloc_bytes(size_t(m.rows_pad) * m.max_inter * m.out_bytes());
  m.h3 = m.alloc_bytes(size_t(m.rows_pad) * m.max_inter * m.out_bytes());
  m.act_q = m.alloc<uint8_t>(size_t(m.rows_pad) * m.max_inter);
  m.act_s = m.alloc<float>(size_t(m.rows_pad) * m.max_inter / 128);
  const bool token_major = ep.layout == OutputLayout::kTokenMajor;
  const size_t out_rows = token_major ? size_t(m.max_total_rows) : size_t(m.rows_pad);
  m.out_all = m.alloc_bytes(out_rows * h * m.out_bytes());
  if (m.has_shared) m.shared_out = m.alloc_bytes(size_t(moe::padded_rows(t)) * h * m.out_bytes());
  if (token_major) {
    m.dev_rows = m.alloc<int32_t>(size_t(m.max_total_rows));
    m.dev_slots = m.alloc<int32_t>(size_t(cap) * k);
    m.graph_counts = m.alloc<int32_t>(size_t(local));
    m.graph_out_start = m.alloc<int32_t>(size_t(local));
    m.graph_rows = m.alloc<int32_t>(size_t(local) * cap);
  }
  EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&m.side, cudaStreamNonBlocking));
  // Also reserves Fp8Gemm's acts-first scratch for the largest M: a captured GEMM must not
  // allocate.
  m.warm_up_gemms();
  // No device-wide synchronisation here: in an in-process world other ranks'
  // kernels may be spinning on this device.
}

void MoeLayer::Impl::warm_up_gemms() {
  // Every GEMM shape forward() can run, launched once on this layer's own scratch (its contents do
  // not matter): see row_buckets.hpp for why kernels must not load during forward().
  cudaStream_t s = nullptr;
  EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  try {
    const int h = shape.hidden;
    std::vector<const DeviceExpert*> kinds = {&experts.front()};
    if (has_shared && experts.back().intermediate != experts.front().intermediate)
      kinds.push_back(&experts.back());
    const bool token_major = ep.layout == OutputLayout::kTokenMajor;
    const int out_rows = token_major ? max_total_rows : rows_pad;
    for (const int rows : moe::padded_row_buckets(rows_pad)) {
      for (const DeviceExpert* e : kinds) {
        gemm.run({.m = rows, .n = e->intermediate, .k = h, .a = xq, .a_scales = xs, .b = e->w1.q,
                  .b_scales = e->w1.scales, .d = h1, .out = out_type},
                 s);
        if (rows <= out_rows) {
          gemm.run({.m = rows, .n = h, .k = e->intermediate, .a = act_q, .a_scales = act_s,
                    .b = e->w2.q, .b_scales = e->w2.scales, .d = out_all, .out = out_type},
                   s);
        }
      }
    }
    EPX_CUDA_CHECK(cudaStreamSynchronize(s));
  } catch (...) {
    (void)cudaStreamDestroy(s);
    throw;
  }
  EPX_CUDA_CHECK(cudaStreamDestroy(s));
}

MoeLayer::~MoeLayer() = default;

const MoeShape& MoeLayer::shape() const { return impl_->shape; }

void MoeLayer::Impl::experts_token_major(const DispatchResult& d, cudaStream_t stream) {
  const int k = shape.topk;
  const int local = ep.num_local_experts();
  const int e0 = ep.rank * local;
  int32_t rows = 0;
  // Copies on `stream` (never the legacy default stream, which would wait for
  // every blocking stream of the device, other ranks' spinning ones included).
  EPX_CUDA_CHECK(
      cudaMemcpyAsync(&rows, d.recv_count, sizeof(rows), cudaMemcpyDeviceToHost, stream));
  EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
  EPX_CHECK(rows >= 0 && rows <= d.capacity, CudaError, "recv_count", rows,
            "in [0, capacity = " + std::to_string(d.capacity) + "]");
  if (rows == 0) return;
  host_ids.resize(size_t(rows) * k);
  EPX_CUDA_CHECK(cudaMemcpyAsync(host_ids.data(), d.recv_topk_ids,
                                 host_ids.size() * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                 stream));
  EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
  // Per local expert, its rows in ascending order; output rows are laid out
  // expert after expert, each expert's block padded to padded_rows rows.
  std::vector<int> list_start(size_t(local) + 1, 0), out_start(size_t(local), 0);
  std::vector<std::vector<int32_t>> lists(static_cast<size_t>(local));
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < k; ++j) {
      const int id = host_ids[size_t(r) * k + j];
      if (id >= e0 && id < e0 + local) lists[size_t(id - e0)].push_back(r);
    }
  }
  host_rows.clear();
  int out_rows = 0;
  for (int e = 0; e < local; ++e) {
    list_start[size_t(e)] = static_cast<int>(host_rows.size());
    out_start[size_t(e)] = out_rows;
    host_rows.insert(host_rows.end(), lists[size_t(e)].begin(), lists[size_t(e)].end());
    out_rows += moe::padded_rows(static_cast<int>(lists[size_t(e)].size()));
  }
  // now slot of (row r, k) = out_start[e] + position of r in lists[e], or -1
  host_slots.assign(size_t(rows) * k, -1);
  std::vector<int> seen(static_cast<size_t>(local), 0);
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < k; ++j) {
      const int id = host_ids[size_t(r) * k + j];
      if (id < e0 || id >= e0 + local) continue;
      const size_t e = size_t(id - e0);
      host_slots[size_t(r) * k + j] = out_start[e] + seen[e]++;
    }
  }
  EPX_CHECK(out_rows <= max_total_rows, CudaError, "expert rows", out_rows,
            "<= " + std::to_string(max_total_rows) + " (a token's ids repeat an expert?)");
  if (!host_rows.empty()) {
    EPX_CUDA_CHECK(cudaMemcpyAsync(dev_rows, host_rows.data(), host_rows.size() * sizeof(int32_t),
                                   cudaMemcpyHostToDevice, stream));
  }
  EPX_CUDA_CHECK(cudaMemcpyAsync(dev_slots, host_slots.data(), host_slots.size() * sizeof(int32_t),
                                 cudaMemcpyHostToDevice, stream));
  for (int e = 0; e < local; ++e) {
    const int m = static_cast<int>(lists[size_t(e)].size());
    if (m == 0) continue;
    moe::QuantizeRowsParams src = wire_source(d.recv_x, d.recv_scales, d.capacity);
    src.rows = dev_rows + list_start[size_t(e)];
    void* out =
        static_cast<uint8_t*>(out_all) + size_t(out_start[size_t(e)]) * shape.hidden * out_bytes();
    run_expert(experts[size_t(e)], src, m, out, stream);
  }
  moe::launch_weighted_partials({.out = out_all,
                                 .out_bf16 = out_type == GemmOut::kBF16,
                                 .slots = dev_slots,
                                 .weights = d.recv_topk_weights,
                                 .num_rows = d.recv_count,
                                 .max_rows = rows,
                                 .topk = k,
                                 .hidden = shape.hidden,
                                 .partials = static_cast<uint16_t*>(d.combine_buffer)},
                                stream);
  // host_rows / host_slots may be reused by the next chunk at once: a copy from
  // pageable memory returns only after the source has been staged.
}

void MoeLayer::Impl::experts_expert_major(const DispatchResult& d, cudaStream_t stream) {
  const int local = ep.num_local_experts();
  const int h = shape.hidden;
  std::vector<int32_t> counts(static_cast<size_t>(local));
  EPX_CUDA_CHECK(cudaMemcpyAsync(counts.data(), d.expert_counts, counts.size() * sizeof(int32_t),
                                 cudaMemcpyDeviceToHost, stream));
  EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
  const size_t plane = size_t(d.capacity) * h;
  const size_t groups = size_t(h) / 128;
  for (int e = 0; e < local; ++e) {
    const int m = counts[size_t(e)];
    EPX_CHECK(m >= 0 && m <= d.capacity, CudaError, "expert_counts[e]", m,
              "in [0, capacity = " + std::to_string(d.capacity) + "]");
    if (m == 0) continue;
    const void* x =
        static_cast<const uint8_t*>(d.expert_x) + plane * size_t(e) * (ep.wire_fp8() ? 1 : 2);
    const float* s = d.expert_scales ? d.expert_scales + size_t(e) * d.capacity * groups : nullptr;
    run_expert(experts[size_t(e)], wire_source(x, s, d.capacity), m, out_all, stream);
    moe::launch_store_bf16(out_all, out_type == GemmOut::kBF16, m, h,
                           static_cast<uint16_t*>(d.combine_buffer) + plane * size_t(e),
                           stream);
  }
}

void MoeLayer::Impl::add_expert_switches(const int32_t* counts, cudaStream_t stream,
                                         const ExpertBody& body) {
  const int local = ep.num_local_experts();
  const int bound = capture_tokens > 0 ? std::min(capture_tokens, a2a_tokens) : a2a_tokens;
  // Body i (i >= 1) runs at buckets[i - 1] rows; body 0 (no rows) is empty.
  const std::vector<int> buckets =
      moe::padded_row_buckets(moe::max_expert_rows(ep.world_size, bound, ep.capacity()));
  if (capture_experts == CaptureExperts::kAllRows) {
    // No conditional nodes: every expert's body at the largest bucket, in turn on the stream.
    for (int e = 0; e < local; ++e) body(e, buckets.back(), stream);
    return;
  }
  for (int e0 = 0; e0 < local; e0 += moe::kSwitchHandlesPerLaunch) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    cudaGraph_t graph = nullptr;
    EPX_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph));
    moe::ExpertSwitchParams sw{.counts = counts + e0,
                               .num_experts = std::min(local - e0, moe::kSwitchHandlesPerLaunch)};
    for (int i = 0; i < sw.num_experts; ++i) {
      EPX_CUDA_CHECK(
          cudaGraphConditionalHandleCreate(&sw.handles[i], graph, 0, cudaGraphCondAssignDefault));
    }
    moe::launch_set_expert_switches(sw, stream);
    // One SWITCH node per expert, each after the previous one (they share the scratch).
    for (int i = 0; i < sw.num_experts; ++i) {
      const cudaGraphNode_t* deps = nullptr;
      const cudaGraphEdgeData* edges = nullptr;
      size_t num_deps = 0;
      EPX_CUDA_CHECK(
          cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph, &deps, &edges, &num_deps));
      cudaGraphNodeParams node_params{};
      node_params.type = cudaGraphNodeTypeConditional;
      node_params.conditional.handle = sw.handles[i];
      node_params.conditional.type = cudaGraphCondTypeSwitch;
      node_params.conditional.size = static_cast<unsigned>(buckets.size() + 1);
      cudaGraphNode_t node = nullptr;
      EPX_CUDA_CHECK(cudaGraphAddNode(&node, graph, deps, edges, num_deps, &node_params));
      for (size_t b = 0; b < buckets.size(); ++b) {
        cudaGraph_t body_graph = node_params.conditional.phGraph_out[b + 1];
        EPX_CUDA_CHECK(cudaStreamBeginCaptureToGraph(side, body_graph, nullptr, nullptr, 0,
                                                     cudaStreamCaptureModeThreadLocal));
        try {
          body(e0 + i, buckets[b], side);
        } catch (...) {
          cudaGraph_t ended = nullptr;
          (void)cudaStreamEndCapture(side, &ended);
          throw;
        }
        cudaGraph_t ended = nullptr;
        EPX_CUDA_CHECK(cudaStreamEndCapture(side, &ended));
      }
      EPX_CUDA_CHECK(cudaStreamUpdateCaptureDependencies(stream, &node, nullptr, 1,
                                                         cudaStreamSetCaptureDependencies));
    }
  }
}

void MoeLayer::Impl::captured_token_major(const DispatchResult& d, cudaStream_t stream) {
  const int k = shape.topk;
  const int h = shape.hidden;
  const int local = ep.num_local_experts();
  const int cap = d.capacity;
  EPX_CHECK(cap <= ep.capacity(), StateError, "DispatchResult.capacity", cap,
            "<= " + std::to_string(ep.capacity()));
  EPX_CHECK(graph_out != nullptr, StateError, "captured token-major forward", "no staging buffer",
            "MoeLayer::set_capture_token_bound() called before the capture");
  const bool bf16 = out_type == GemmOut::kBF16;
  // now graph_counts / graph_out_start / graph_rows / dev_slots as the eager path's host lists
  moe::launch_group_rows({.topk_ids = d.recv_topk_ids,
                          .num_rows = d.recv_count,
                          .capacity = cap,
                          .topk = k,
                          .first_expert = ep.rank * local,
                          .num_local = local,
                          .counts = graph_counts,
                          .out_start = graph_out_start,
                          .rows = graph_rows,
                          .slots = dev_slots},
                         stream);
  add_expert_switches(graph_counts, stream, [&](int e, int m_pad, cudaStream_t s) {
    moe::QuantizeRowsParams src = wire_source(d.recv_x, d.recv_scales, cap);
    src.rows = graph_rows + size_t(e) * cap;
    src.m_dev = graph_counts + e;
    run_expert(experts[size_t(e)], src, m_pad, graph_out, s);
    // Expert e's block of out_all, where the eager path's GEMM writes directly.
    moe::launch_store_rows({.src = graph_out,
                            .src_bf16 = bf16,
                            .dst = out_all,
                            .dst_bf16 = bf16,
                            .cols = h,
                            .max_rows = m_pad,
                            .rows_dev = graph_counts + e,
                            .dst_row_dev = graph_out_start + e},
                           s);
  });
  moe::launch_weighted_partials({.out = out_all,
                                 .out_bf16 = bf16,
                                 .slots = dev_slots,
                                 .weights = d.recv_topk_weights,
                                 .num_rows = d.recv_count,
                                 .max_rows = cap,
                                 .topk = k,
                                 .hidden = h,
                                 .partials = static_cast<uint16_t*>(d.combine_buffer)},
                                stream);
}

void MoeLayer::Impl::captured_expert_major(const DispatchResult& d, cudaStream_t stream) {
  const int h = shape.hidden;
  const size_t plane = size_t(d.capacity) * h;
  const size_t groups = size_t(h) / 128;
  add_expert_switches(d.expert_counts, stream, [&](int e, int m_pad, cudaStream_t s) {
    const void* x =
        static_cast<const uint8_t*>(d.expert_x) + plane * size_t(e) * (ep.wire_fp8() ? 1 : 2);
    const float* sc = d.expert_scales ? d.expert_scales + size_t(e) * d.capacity * groups : nullptr;
    moe::QuantizeRowsParams src = wire_source(x, sc, d.capacity);
    src.m_dev = d.expert_counts + e;
    run_expert(experts[size_t(e)], src, m_pad, out_all, s);
    moe::launch_store_rows({.src = out_all,
                            .src_bf16 = out_type == GemmOut::kBF16,
                            .dst = static_cast<uint16_t*>(d.combine_buffer) + plane * size_t(e),
                            .dst_bf16 = true,
                            .cols = h,
                            .max_rows = std::min(m_pad, d.capacity),
                            .rows_dev = d.expert_counts + e},
                           s);
  });
}

void MoeLayer::set_capture_token_bound(int max_tokens_per_rank) {
  Impl& m = *impl_;
  EPX_CHECK(max_tokens_per_rank >= 0 && max_tokens_per_rank <= m.ep.max_tokens_per_rank,
            InputError, "max_tokens_per_rank", max_tokens_per_rank,
            "in [0, max_tokens_per_rank = " + std::to_string(m.ep.max_tokens_per_rank) + "]");
  m.capture_tokens = max_tokens_per_rank;
  // The token-major captured path stages one expert's output: allocated here, outside any capture
  // (cudaMalloc may not be captured), once and at its largest, so eager-only layers never pay it.
  if (m.ep.layout == OutputLayout::kTokenMajor && m.graph_out == nullptr)
    m.graph_out = m.alloc_bytes(size_t(m.rows_pad) * m.shape.hidden * m.out_bytes());
}

void MoeLayer::set_capture_experts(CaptureExperts mode) { impl_->capture_experts = mode; }

void MoeLayer::Impl::call_capture_split(cudaStream_t stream) {
  if (!capture_split) return;
  capture_split(stream);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  EPX_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  EPX_CHECK(status == cudaStreamCaptureStatusActive, StateError, "stream capture after the split",
            "not active", "a capture begun again on the same stream (set_capture_split)");
}

void MoeLayer::set_capture_split(std::function<void(cudaStream_t)> split) {
  impl_->capture_split = std::move(split);
}

void MoeLayer::Impl::check_a2a(const All2All& a2a) {
  const EpConfig& c = a2a.config();
  EPX_CHECK(c.rank == ep.rank && c.world_size == ep.world_size && c.hidden == ep.hidden &&
                c.num_experts == ep.num_experts && c.topk == ep.topk &&
                c.max_tokens_per_rank <= ep.max_tokens_per_rank && c.dtype == ep.dtype &&
                c.layout == ep.layout && c.scale_layout == ep.scale_layout,
            InputError, "a2a.config()", "rank " + std::to_string(c.rank),
            "the EpConfig this MoeLayer was created with (max_tokens_per_rank at most its)");
  a2a_tokens = c.max_tokens_per_rank;
}

namespace {

// Whether `stream` is capturing; StateError when an earlier call invalidated its capture.
bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  EPX_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  EPX_CHECK(capture != cudaStreamCaptureStatusInvalidated, StateError, "stream capture",
            "invalidated", "an active capture (an earlier call broke it)");
  return capture == cudaStreamCaptureStatusActive;
}

}  // namespace

void MoeLayer::forward(const void* x, int num_tokens, void* y, All2All& a2a, cudaStream_t stream,
                       int num_chunks, const MoeRoutingOut* routing) {
  Impl& m = *impl_;
  m.check_a2a(a2a);
  EPX_CHECK(num_tokens >= 0, InputError, "num_tokens", num_tokens, ">= 0");
  EPX_CHECK(num_tokens == 0 || (x != nullptr && y != nullptr), InputError, "x, y", "null",
            "device pointers");
  const int t = m.a2a_tokens;  // chunks of the All2All's max_tokens_per_rank
  const int need = std::max(1, (num_tokens + t - 1) / t);
  const int chunks = num_chunks == 0 ? need : num_chunks;
  EPX_CHECK(chunks >= need, InputError, "num_chunks", num_chunks,
            ">= ceil(num_tokens / max_tokens_per_rank) = " + std::to_string(need));
  const int h = m.shape.hidden;
  const int k = m.shape.topk;
  const size_t row_bytes = size_t(h) * 2;
  const bool captured = capturing(stream);

  for (int ci = 0; ci < chunks; ++ci) {
    const int start = std::min(num_tokens, ci * t);
    const int n = std::min(t, num_tokens - start);
    EPX_CHECK(!captured || m.capture_tokens == 0 || n <= m.capture_tokens, InputError,
              "tokens of a captured chunk", n,
              "<= set_capture_token_bound() = " + std::to_string(m.capture_tokens));
    const void* xc = static_cast<const uint8_t*>(x) + size_t(start) * row_bytes;
    void* yc = n > 0 ? static_cast<uint8_t*>(y) + size_t(start) * row_bytes : nullptr;
    int32_t* ids = routing ? routing->topk_ids + size_t(start) * k : m.route_ids;
    float* w = routing ? routing->topk_weights + size_t(start) * k : m.route_w;
    const DispatchInput in = m.route(xc, n, ids, w, stream);
    m.shared_expert(xc, n, stream);
    const DispatchResult d = a2a.dispatch(in, stream);
    if (captured) m.call_capture_split(stream);
    m.expert_stage(d, a2a, stream, captured);
    if (captured) m.call_capture_split(stream);
    a2a.combine(d.combine_buffer, yc, stream);
    m.add_shared(yc, n, stream);
  }
}

void MoeLayer::forward(const void* x, int num_tokens, void* y, const All2AllChoice& choice,
                       int step_max_tokens, cudaStream_t stream, const MoeRoutingOut* routing) {
  EPX_CHECK(choice.decode != nullptr && choice.prefill != nullptr, InputError,
            "choice.decode, choice.prefill", "null", "this rank's two All2All objects");
  EPX_CHECK(choice.threshold >= 0, InputError, "choice.threshold", choice.threshold, ">= 0");
  EPX_CHECK(step_max_tokens >= num_tokens, InputError, "step_max_tokens", step_max_tokens,
            ">= num_tokens = " + std::to_string(num_tokens) + " (the largest over the ranks)");
  All2All& a2a = choice.pick(step_max_tokens);
  const int t = a2a.config().max_tokens_per_rank;
  forward(x, num_tokens, y, a2a, stream, std::max(1, (step_max_tokens + t - 1) / t), routing);
}

void MoeLayer::forward_pair(const MicroBatch& a, const MicroBatch& b, All2All& a2a,
                            cudaStream_t stream) {
  Impl& m = *impl_;
  m.check_a2a(a2a);
  EPX_CHECK(a2a.config().rounds_in_flight >= 2, InputError, "a2a.config().rounds_in_flight",
            a2a.config().rounds_in_flight,
            "2 (the second micro-batch is dispatched before the first is combined)");
  const bool captured = capturing(stream);
  const int t = captured && m.capture_tokens > 0 ? std::min(m.capture_tokens, m.a2a_tokens)
                                                  : m.a2a_tokens;
  for (const MicroBatch* mb : {&a, &b}) {
    const char* name = mb == &a ? "a.num_tokens" : "b.num_tokens";
    EPX_CHECK(mb->num_tokens >= 0 && mb->num_tokens <= t, InputError, name, mb->num_tokens,
              fmt::format("0..{} ({})", t,
                          t == m.a2a_tokens ? "max_tokens_per_rank: one chunk"
                                            : "set_capture_token_bound()"));
    EPX_CHECK(mb->num_tokens == 0 || (mb->x != nullptr && mb->y != nullptr), InputError,
              mb == &a ? "a.x, a.y" : "b.x, b.y", "null", "device pointers");
  }
  // Each window between a send half and its receive half holds the other micro-batch's work.
  // Scratch shared by the two (router output, fp8 input, expert stage, shared expert output) is
  // reused only after the stream has finished with it.
  a2a.dispatch_send(m.route(a.x, a.num_tokens, m.route_ids, m.route_w, stream), stream);
  const DispatchInput in_b = m.route(b.x, b.num_tokens, m.route_ids, m.route_w, stream);
  m.shared_expert(a.x, a.num_tokens, stream);
  const DispatchResult da = a2a.dispatch_recv(stream);
  a2a.dispatch_send(in_b, stream);
  m.expert_stage(da, a2a, stream, captured);
  const DispatchResult db = a2a.dispatch_recv(stream);
  a2a.combine_send(da.combine_buffer, stream);
  m.expert_stage(db, a2a, stream, captured);
  a2a.combine_recv(a.num_tokens > 0 ? a.y : nullptr, stream);
  a2a.combine_send(db.combine_buffer, stream);
  m.add_shared(a.y, a.num_tokens, stream);
  m.shared_expert(b.x, b.num_tokens, stream);
  a2a.combine_recv(b.num_tokens > 0 ? b.y : nullptr, stream);
  m.add_shared(b.y, b.num_tokens, stream);
}

DispatchInput MoeLayer::Impl::route(const void* x, int n, int32_t* ids, float* w,
                                    cudaStream_t stream) {
  const int h = shape.hidden;
  moe::launch_router({.x = static_cast<const uint16_t*>(x),
                      .gate = gate,
                      .bias = bias,
                      .n = n,
                      .hidden = h,
                      .num_experts = shape.num_experts,
                      .topk = shape.topk,
                      .num_groups = shape.num_groups,
                      .topk_groups = shape.topk_groups,
                      .routed_scaling = shape.routed_scaling,
                      .grouped = shape.scoring == MoeScoring::kSigmoidGrouped,
                      .ids = ids,
                      .weights = w},
                     stream);
  DispatchInput in{.num_tokens = n, .x = x, .topk_ids = ids, .topk_weights = w};
  if (ep.input_fp8() && n > 0) {
    moe::launch_quantize_rows({.src = x,
                               .m = n,
                               .m_pad = n,
                               .k = h,
                               .dst_q = in_q,
                               .dst_scales = in_s,
                               .order = moe::ActScaleOrder::kRowMajor},
                              stream);
    in.x = in_q;
    in.x_scales = in_s;
  }
  return in;
}

void MoeLayer::Impl::expert_stage(const DispatchResult& d, All2All& a2a, cudaStream_t stream,
                                  bool captured) {
  const bool token_major = ep.layout == OutputLayout::kTokenMajor;
  if (captured) {
    // Counts stay on the device: one SWITCH node per expert picks its GEMMs' row bucket.
    if (token_major) {
      captured_token_major(d, stream);
    } else {
      captured_expert_major(d, stream);
    }
    return;
  }
  // Host sync: the expert GEMMs are launched at the exact received row counts.
  a2a.synchronize(stream);
  if (token_major) {
    experts_token_major(d, stream);
  } else {
    experts_expert_major(d, stream);
  }
}

void MoeLayer::Impl::shared_expert(const void* x, int n, cudaStream_t stream) {
  if (!has_shared || n == 0) return;
  moe::QuantizeRowsParams src;
  src.src = x;
  src.src_rows = n;
  run_expert(experts.back(), src, n, shared_out, stream);
}

void MoeLayer::Impl::add_shared(void* y, int n, cudaStream_t stream) {
  if (!has_shared || n == 0) return;
  moe::launch_add_shared(static_cast<uint16_t*>(y), shared_out, out_type == GemmOut::kBF16, n,
                         shape.hidden, stream);
}

}  // namespace epx
