#pragma once
// Pieces of the correctness harness shared by run_check (in-process world, harness.cpp) and
// run_check_ipc (one process per rank, harness_ipc.cpp): input sets with their CPU reference,
// downloads, and the comparison of one rank's outputs. Internal to src/testing.

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <future>
#include <string>
#include <type_traits>
#include <vector>

#include "testing/harness.hpp"
#include "epx/cuda_check.hpp"
#include "epx/all2all.hpp"
#include "reference/reference.hpp"

namespace epx::testing::internal {

using ref::ExpertMajorRecv;
using ref::RankInput;
using ref::TokenMajorRecv;

// One complete set of inputs with its expected outputs.
struct InputSet {
  std::vector<RankInput> in;
  std::vector<std::vector<int64_t>> ids64;
  std::vector<TokenMajorRecv> tm;
  std::vector<ExpertMajorRecv> em;
  std::vector<std::vector<uint16_t>> y;
};

inline InputSet make_set(const CheckOptions& o, const EpConfig& cfg, const std::vector<int>& counts,
                  uint64_t seed) {
  InputSet s;
  const int W = cfg.world_size;
  s.in.resize(W);
  s.ids64.resize(W);
  ref::for_each_index(W, [&](int r) {
    const uint64_t rs = seed * 7919 + uint64_t(r) * 104729 + 17;
    const auto routing = ref::make_routing(o.routing, counts[r], cfg.num_experts, cfg.topk, rs,
                                           int(seed % uint64_t(cfg.num_experts)));
    s.in[r] = ref::make_rank_input(cfg, counts[r], routing, rs ^ 0x5bd1e995ull);
    s.ids64[r].assign(routing.ids.begin(), routing.ids.end());
  });
  s.tm = ref::dispatch_token_major(cfg, s.in, delivers_every_token(o.backend));
  if (cfg.layout == OutputLayout::kTokenMajor) {
    std::vector<std::vector<uint16_t>> partials(W);
    ref::for_each_index(W, [&](int r) { partials[r] = ref::identity_partials(cfg, r, s.tm[r]); });
    s.y = ref::combine_token_major(cfg, s.in, s.tm, partials, cfg.combine_format);
  } else {
    s.em = ref::dispatch_expert_major(cfg, s.in);
    std::vector<std::vector<std::vector<uint16_t>>> outs(W);
    ref::for_each_index(W, [&](int r) { outs[r] = ref::identity_expert_outputs(cfg, s.em[r]); });
    s.y = ref::combine_expert_major(cfg, s.in, s.em, outs, cfg.combine_format);
  }
  return s;
}

// The input sets of a check (options.pool of them, at most one per call), built in parallel;
// set i is drawn from options.seed + 1000003 * i.
inline std::vector<InputSet> make_sets(const CheckOptions& o, const EpConfig& cfg,
                                       const std::vector<int>& counts) {
  const int pool = std::max(1, std::min(o.pool, o.graph_replays + o.iters));
  std::vector<InputSet> sets;
  std::vector<std::future<InputSet>> jobs;
  for (int i = 0; i < pool; ++i)
    jobs.push_back(std::async(std::launch::async, make_set, std::cref(o), std::cref(cfg),
                              std::cref(counts), o.seed + 1000003ull * i));
  for (auto& j : jobs) sets.push_back(j.get());
  return sets;
}

template <typename T>
std::vector<T> download(const void* dev, size_t n) {
  std::vector<T> h(n);
  if (n > 0) EPX_CUDA_CHECK(cudaMemcpy(h.data(), dev, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

class Comparer {
 public:
  explicit Comparer(CheckReport& rep, int max_report) : rep_(rep), max_(max_report) {}

  template <typename T>
  void eq(const std::vector<T>& got, const T* want, size_t n, int width, const std::string& what) {
    if (n > 0 && std::memcmp(got.data(), want, n * sizeof(T)) == 0) return;
    for (size_t i = 0; i < n; ++i) {
      if (std::memcmp(&got[i], &want[i], sizeof(T)) == 0) continue;
      add(fmt::format("{} row {} col {}: got {} expected {}", what, i / width, i % width,
                      show(got[i]), show(want[i])));
      if (rep_.mismatches.size() >= size_t(max_)) return;
    }
  }
  void add(std::string m) {
    rep_.ok = false;
    if (rep_.mismatches.size() < size_t(max_)) rep_.mismatches.push_back(std::move(m));
  }

 private:
  template <typename T>
  static std::string show(T v) {
    if constexpr (std::is_same_v<T, uint16_t>) {
      return fmt::format("{:g} (0x{:04x})", ref::bf16_to_float(v), v);
    } else if constexpr (std::is_same_v<T, uint8_t>) {
      return fmt::format("{:g} (0x{:02x})", ref::fp8_to_float(v), v);
    } else {
      return fmt::format("{}", v);
    }
  }
  CheckReport& rep_;
  int max_;
};

// Expected scales of `rows` rows in the device layout (row-major or column-major over `cap`).
inline std::vector<float> device_scales(const EpConfig& cfg, const DispatchResult&, const float* dev,
                                 int rows, int cap) {
  const int G = cfg.num_scale_groups();
  if (cfg.scale_layout == ScaleLayout::kRowMajor) return download<float>(dev, size_t(rows) * G);
  const auto all = download<float>(dev, size_t(G) * cap);
  std::vector<float> out(size_t(rows) * G);
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < G; ++g) out[size_t(r) * G + g] = all[size_t(g) * cap + r];
  return out;
}

// Rows of a dispatch output in (source rank, source index) order: the reference's order.
// Without cfg.deterministic (or high_throughput, which always orders) the device places runs of
// rows in arrival order, so the comparison
// permutes the downloaded rows first (the contract is order-insensitive there); with it the rows
// are compared as they are (the order is part of the contract).
struct RowOrder {
  std::vector<int> rows;  // rows[i] = device row holding the i-th row in reference order
  RowOrder(const std::vector<int32_t>& src_rank, const std::vector<int32_t>& src_idx, bool sort) {
    rows.resize(src_rank.size());
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = int(i);
    if (!sort) return;
    std::stable_sort(rows.begin(), rows.end(), [&](int a, int b) {
      return std::pair(src_rank[a], src_idx[a]) < std::pair(src_rank[b], src_idx[b]);
    });
  }
  // v holds `width` elements per row.
  template <typename T>
  std::vector<T> apply(const std::vector<T>& v, size_t width) const {
    std::vector<T> out(v.size());
    for (size_t i = 0; i < rows.size(); ++i)
      std::copy_n(v.begin() + rows[i] * width, width, out.begin() + i * width);
    return out;
  }
};

// `backend`: high_throughput orders its rows on every call (compared as they are).
inline void compare_dispatch(const EpConfig& cfg, Backend backend, int rank, const DispatchResult& d,
                             const InputSet& set, Comparer& cmp) {
  const TokenMajorRecv& want = set.tm[rank];
  const std::string who = fmt::format("rank {} token-major", rank);
  const int M = download<int32_t>(d.recv_count, 1)[0];
  if (M != want.count) {
    cmp.add(fmt::format("{} recv_count: got {} expected {}", who, M, want.count));
    return;
  }
  const int K = cfg.topk, G = cfg.num_scale_groups();
  const size_t rb = cfg.wire_row_bytes();
  const bool sort = !cfg.deterministic && backend != Backend::kHighThroughput;
  const RowOrder order(download<int32_t>(d.recv_src_rank, M), download<int32_t>(d.recv_src_idx, M),
                       sort);
  cmp.eq(order.apply(download<uint8_t>(d.recv_x, M * rb), rb), want.x.data(), M * rb, int(rb),
         who + " x (bytes)");
  if (cfg.wire_fp8())
    cmp.eq(order.apply(device_scales(cfg, d, d.recv_scales, M, d.capacity), G),
           want.scales.data(), size_t(M) * G, G, who + " scales");
  cmp.eq(order.apply(download<int32_t>(d.recv_src_rank, M), 1), want.src_rank.data(), M, 1,
         who + " src_rank");
  cmp.eq(order.apply(download<int32_t>(d.recv_src_idx, M), 1), want.src_idx.data(), M, 1,
         who + " src_idx");
  cmp.eq(order.apply(download<int32_t>(d.recv_topk_ids, size_t(M) * K), K), want.topk_ids.data(),
         size_t(M) * K, K, who + " topk_ids");
  cmp.eq(order.apply(download<float>(d.recv_topk_weights, size_t(M) * K), K),
         want.topk_weights.data(), size_t(M) * K, K, who + " topk_weights");
  const int Le = cfg.num_local_experts();
  const auto counts = download<int32_t>(d.expert_counts, Le);
  if (cfg.layout == OutputLayout::kTokenMajor) {
    cmp.eq(counts, want.expert_counts.data(), Le, 1, who + " expert_counts");
    return;
  }
  const ExpertMajorRecv& em = set.em[rank];
  const std::string ewho = fmt::format("rank {} expert-major", rank);
  cmp.eq(counts, em.count.data(), Le, 1, ewho + " count");
  if (counts != em.count) return;
  const size_t cap = d.capacity;
  for (int e = 0; e < Le; ++e) {
    const int n = em.count[e];
    if (n == 0) continue;
    const std::string w = fmt::format("{} expert {}", ewho, e);
    const size_t row0 = size_t(e) * cap;
    const RowOrder eo(download<int32_t>(d.expert_src_rank + row0, n),
                      download<int32_t>(d.expert_src_idx + row0, n), sort);
    cmp.eq(eo.apply(download<uint8_t>(static_cast<const uint8_t*>(d.expert_x) + row0 * rb, n * rb),
                    rb),
           em.x[e].data(), n * rb, int(rb), w + " x (bytes)");
    if (cfg.wire_fp8())
      cmp.eq(eo.apply(device_scales(cfg, d, d.expert_scales + row0 * G, n, int(cap)), G),
             em.scales[e].data(), size_t(n) * G, G, w + " scales");
    cmp.eq(eo.apply(download<int32_t>(d.expert_src_rank + row0, n), 1), em.src_rank[e].data(), n, 1,
           w + " src_rank");
    cmp.eq(eo.apply(download<int32_t>(d.expert_src_idx + row0, n), 1), em.src_idx[e].data(), n, 1,
           w + " src_idx");
    cmp.eq(eo.apply(download<int32_t>(d.expert_topk_slot + row0, n), 1), em.topk_slot[e].data(), n,
           1, w + " topk_slot");
    cmp.eq(eo.apply(download<float>(d.expert_weight + row0, n), 1), em.weight[e].data(), n, 1,
           w + " weight");
  }
}

struct RankBuffers {
  void* x = nullptr;
  float* scales = nullptr;
  void* ids = nullptr;
  float* weights = nullptr;
  void* y = nullptr;
  cudaStream_t stream = nullptr;
  cudaStream_t side = nullptr;  // records conditional bodies (CheckOptions::conditional)
  cudaGraphExec_t exec = nullptr;
  void* pool_out = nullptr;  // CheckOptions::pool_expert_out: the expert stage's own output
};

// Checks the options shared by every world (validate_shared_check_options) and returns the
// token count of each rank (one count for all ranks, one per rank, or drawn from the seed).
inline std::vector<int> resolve_token_counts(const CheckOptions& o, const EpConfig& cfg) {
  validate_shared_check_options(o);
  const int W = cfg.world_size;
  if (o.tokens.empty()) return ref::make_token_counts(W, cfg.max_tokens_per_rank, -1, o.seed);
  if (o.tokens.size() == 1) return std::vector<int>(size_t(W), o.tokens[0]);
  return o.tokens;
}

}  // namespace epx::testing::internal
