#include "check/harness.hpp"

#include <fmt/format.h>

#include <cstring>
#include <future>
#include <memory>
#include <sstream>

#include "check/identity_expert.hpp"
#include "core/cuda_check.hpp"
#include "epx/all2all.hpp"
#include "epx/error.hpp"
#include "epx/world.hpp"

namespace epx::check {

std::vector<int> parse_token_list(const std::string& text, const char* what) {
  std::vector<int> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t pos = 0;
    int v = -1;
    try {
      v = std::stoi(item, &pos);
    } catch (const std::exception&) {
      pos = 0;
    }
    EPX_CHECK(pos == item.size() && !item.empty() && v >= 0, InputError, what, "'" + item + "'",
              "a non-negative integer, or a comma list with one per rank");
    out.push_back(v);
  }
  EPX_CHECK(!out.empty(), InputError, what, "''", "a count or a comma list");
  return out;
}

namespace {

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

// Runs f(r) for every rank on its own thread (the reference is the slow part of a check).
template <typename F>
void for_each_rank(int W, F f) {
  std::vector<std::future<void>> jobs;
  for (int r = 0; r < W; ++r) jobs.push_back(std::async(std::launch::async, f, r));
  for (auto& j : jobs) j.get();
}

InputSet make_set(const CheckOptions& o, const EpConfig& cfg, const std::vector<int>& counts,
                  uint64_t seed) {
  InputSet s;
  const int W = cfg.world_size;
  s.in.resize(W);
  s.ids64.resize(W);
  for_each_rank(W, [&](int r) {
    const uint64_t rs = seed * 7919 + uint64_t(r) * 104729 + 17;
    const auto routing = ref::make_routing(o.routing, counts[r], cfg.num_experts, cfg.topk, rs,
                                           int(seed % uint64_t(cfg.num_experts)));
    s.in[r] = ref::make_rank_input(cfg, counts[r], routing, rs ^ 0x5bd1e995ull);
    s.ids64[r].assign(routing.ids.begin(), routing.ids.end());
  });
  s.tm = ref::dispatch_token_major(cfg, s.in, o.backend != Backend::kLowLatency);
  if (cfg.layout == OutputLayout::kTokenMajor) {
    std::vector<std::vector<uint16_t>> partials(W);
    for_each_rank(W, [&](int r) { partials[r] = ref::identity_partials(cfg, r, s.tm[r]); });
    s.y = ref::combine_token_major(cfg, s.in, s.tm, partials);
  } else {
    s.em = ref::dispatch_expert_major(cfg, s.in);
    std::vector<std::vector<std::vector<uint16_t>>> outs(W);
    for_each_rank(W, [&](int r) { outs[r] = ref::identity_expert_outputs(cfg, s.em[r]); });
    s.y = ref::combine_expert_major(cfg, s.in, s.em, outs);
  }
  return s;
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
std::vector<float> device_scales(const EpConfig& cfg, const DispatchResult&, const float* dev,
                                 int rows, int cap) {
  const int G = cfg.num_scale_groups();
  if (cfg.scale_layout == ScaleLayout::kRowMajor) return download<float>(dev, size_t(rows) * G);
  const auto all = download<float>(dev, size_t(G) * cap);
  std::vector<float> out(size_t(rows) * G);
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < G; ++g) out[size_t(r) * G + g] = all[size_t(g) * cap + r];
  return out;
}

void compare_dispatch(const EpConfig& cfg, int rank, const DispatchResult& d, const InputSet& set,
                      Comparer& cmp) {
  const TokenMajorRecv& want = set.tm[rank];
  const std::string who = fmt::format("rank {} token-major", rank);
  const int M = download<int32_t>(d.recv_count, 1)[0];
  if (M != want.count) {
    cmp.add(fmt::format("{} recv_count: got {} expected {}", who, M, want.count));
    return;
  }
  const int K = cfg.topk, G = cfg.num_scale_groups();
  const size_t rb = cfg.wire_row_bytes();
  cmp.eq(download<uint8_t>(d.recv_x, M * rb), want.x.data(), M * rb, int(rb), who + " x (bytes)");
  if (cfg.wire_fp8())
    cmp.eq(device_scales(cfg, d, d.recv_scales, M, d.capacity), want.scales.data(), size_t(M) * G,
           G, who + " scales");
  cmp.eq(download<int32_t>(d.recv_src_rank, M), want.src_rank.data(), M, 1, who + " src_rank");
  cmp.eq(download<int32_t>(d.recv_src_idx, M), want.src_idx.data(), M, 1, who + " src_idx");
  cmp.eq(download<int32_t>(d.recv_topk_ids, size_t(M) * K), want.topk_ids.data(), size_t(M) * K, K,
         who + " topk_ids");
  cmp.eq(download<float>(d.recv_topk_weights, size_t(M) * K), want.topk_weights.data(),
         size_t(M) * K, K, who + " topk_weights");
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
    cmp.eq(download<uint8_t>(static_cast<const uint8_t*>(d.expert_x) + row0 * rb, n * rb),
           em.x[e].data(), n * rb, int(rb), w + " x (bytes)");
    if (cfg.wire_fp8())
      cmp.eq(device_scales(cfg, d, d.expert_scales + row0 * G, n, int(cap)), em.scales[e].data(),
             size_t(n) * G, G, w + " scales");
    cmp.eq(download<int32_t>(d.expert_src_rank + row0, n), em.src_rank[e].data(), n, 1, w + " src_rank");
    cmp.eq(download<int32_t>(d.expert_src_idx + row0, n), em.src_idx[e].data(), n, 1, w + " src_idx");
    cmp.eq(download<int32_t>(d.expert_topk_slot + row0, n), em.topk_slot[e].data(), n, 1, w + " topk_slot");
    cmp.eq(download<float>(d.expert_weight + row0, n), em.weight[e].data(), n, 1, w + " weight");
  }
}

struct RankBuffers {
  void* x = nullptr;
  float* scales = nullptr;
  void* ids = nullptr;
  float* weights = nullptr;
  void* y = nullptr;
  cudaStream_t stream = nullptr;
  cudaGraphExec_t exec = nullptr;
};

}  // namespace

CheckReport run_check(const CheckOptions& o) {
  require_gpu("epx check");
  CheckReport rep;
  EpConfig cfg = o.cfg;
  cfg.rank = 0;
  cfg.validate();
  const int W = cfg.world_size;
  EPX_CHECK(o.pool >= 1, InputError, "pool", o.pool, "at least 1");
  EPX_CHECK(o.graph_replays >= 0, InputError, "graph replays", o.graph_replays, ">= 0");
  EPX_CHECK(!o.mixed || o.graph_replays > 0, InputError, "mixed", "true",
            "only together with graph replays (--graph N)");

  std::vector<int> counts;
  if (o.tokens.empty()) {
    counts = ref::make_token_counts(W, cfg.max_tokens_per_rank, -1, o.seed);
  } else if (o.tokens.size() == 1) {
    counts.assign(W, o.tokens[0]);
  } else {
    EPX_CHECK(int(o.tokens.size()) == W, InputError, "tokens (list length)", o.tokens.size(),
              "1 or world size = " + std::to_string(W));
    counts = o.tokens;
  }
  for (int c : counts)
    EPX_CHECK(c <= cfg.max_tokens_per_rank, InputError, "tokens", c,
              "at most max_tokens_per_rank = " + std::to_string(cfg.max_tokens_per_rank));
  rep.tokens = counts;

  auto say = [&](const std::string& s) {
    if (o.log) o.log(s);
  };
  const int pool = std::max(1, std::min(o.pool, o.graph_replays + o.iters));
  std::vector<InputSet> sets;
  {
    std::vector<std::future<InputSet>> jobs;
    for (int i = 0; i < pool; ++i)
      jobs.push_back(std::async(std::launch::async, make_set, std::cref(o), std::cref(cfg),
                                std::cref(counts), o.seed + 1000003ull * i));
    for (auto& j : jobs) sets.push_back(j.get());
  }
  say(fmt::format("reference ready: {} input set(s), tokens per rank {}", pool,
                  fmt::join(counts, ",")));

  InProcessWorld world(W);
  auto group = make_all2all_group(o.backend, cfg, world, o.launch);
  rep.buffer_bytes = group[0]->symmetric_bytes();

  for (int r = 0; r < W; ++r) {
    EPX_CUDA_CHECK(cudaSetDevice(world.device_of(r)));
    preload_identity_expert();
  }
  const size_t H = cfg.hidden, K = cfg.topk, G = cfg.num_scale_groups();
  const size_t maxT = cfg.max_tokens_per_rank;
  std::vector<RankBuffers> rb(W);
  for (int r = 0; r < W; ++r) {
    EPX_CUDA_CHECK(cudaSetDevice(world.device_of(r)));
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&rb[r].stream, cudaStreamNonBlocking));
    EPX_CUDA_CHECK(cudaMalloc(&rb[r].x, maxT * H * 2));
    EPX_CUDA_CHECK(cudaMalloc(&rb[r].scales, std::max<size_t>(1, maxT * G) * sizeof(float)));
    EPX_CUDA_CHECK(cudaMalloc(&rb[r].ids, maxT * K * sizeof(int64_t)));
    EPX_CUDA_CHECK(cudaMalloc(&rb[r].weights, maxT * K * sizeof(float)));
    EPX_CUDA_CHECK(cudaMalloc(&rb[r].y, maxT * H * 2));
  }
  struct Cleanup {
    std::vector<RankBuffers>& rb;
    ~Cleanup() {
      for (auto& b : rb) {
        (void)cudaStreamSynchronize(b.stream);
        if (b.exec) (void)cudaGraphExecDestroy(b.exec);
        (void)cudaFree(b.x);
        (void)cudaFree(b.scales);
        (void)cudaFree(b.ids);
        (void)cudaFree(b.weights);
        (void)cudaFree(b.y);
        (void)cudaStreamDestroy(b.stream);
      }
    }
  } cleanup{rb};

  auto upload = [&](int r, const InputSet& s) {
    const RankInput& in = s.in[r];
    const size_t n = in.num_tokens;
    cudaStream_t st = rb[r].stream;
    if (n == 0) return;
    if (cfg.input_fp8()) {
      EPX_CUDA_CHECK(cudaMemcpyAsync(rb[r].x, in.x_fp8.data(), n * H, cudaMemcpyHostToDevice, st));
      EPX_CUDA_CHECK(cudaMemcpyAsync(rb[r].scales, in.scales.data(), n * G * sizeof(float),
                                     cudaMemcpyHostToDevice, st));
    } else {
      EPX_CUDA_CHECK(cudaMemcpyAsync(rb[r].x, in.x_bf16.data(), n * H * 2, cudaMemcpyHostToDevice, st));
    }
    if (o.ids_int64) {
      EPX_CUDA_CHECK(cudaMemcpyAsync(rb[r].ids, s.ids64[r].data(), n * K * sizeof(int64_t),
                                     cudaMemcpyHostToDevice, st));
    } else {
      EPX_CUDA_CHECK(cudaMemcpyAsync(rb[r].ids, in.routing.ids.data(), n * K * sizeof(int32_t),
                                     cudaMemcpyHostToDevice, st));
    }
    EPX_CUDA_CHECK(cudaMemcpyAsync(rb[r].weights, in.routing.weights.data(), n * K * sizeof(float),
                                   cudaMemcpyHostToDevice, st));
    EPX_CUDA_CHECK(cudaMemsetAsync(rb[r].y, 0xff, n * H * 2, st));  // poison: every row must be written
  };
  std::vector<DispatchResult> results(W);
  auto enqueue = [&](int r) {
    DispatchInput in;
    in.num_tokens = counts[r];
    in.x = rb[r].x;
    in.x_scales = cfg.input_fp8() ? rb[r].scales : nullptr;
    in.topk_ids = rb[r].ids;
    in.ids_type = o.ids_int64 ? IdType::kInt64 : IdType::kInt32;
    in.topk_weights = rb[r].weights;
    All2All& a = *group[r];
    results[r] = a.dispatch(in, rb[r].stream);
    launch_identity_expert(a.config(), results[r], a.combine_buffer(), rb[r].stream);
    a.combine(a.combine_buffer(), rb[r].y, rb[r].stream);
  };
  Comparer cmp(rep, o.max_report);
  auto finish_and_compare = [&](const InputSet& s) -> bool {
    try {
      for (int r = 0; r < W; ++r) group[r]->synchronize(rb[r].stream);
    } catch (const Error& e) {
      cmp.add(std::string("device error: ") + e.what());
      for (int r = 0; r < W; ++r) (void)cudaStreamSynchronize(rb[r].stream);
      return false;
    }
    if (o.corrupt_rank >= 0 && o.corrupt_rank < W && counts[o.corrupt_rank] > 0) {
      // flip the low bit of the first element of y[0] on that rank
      uint16_t v = 0;
      EPX_CUDA_CHECK(cudaMemcpy(&v, rb[o.corrupt_rank].y, 2, cudaMemcpyDeviceToHost));
      v ^= 1;
      EPX_CUDA_CHECK(cudaMemcpy(rb[o.corrupt_rank].y, &v, 2, cudaMemcpyHostToDevice));
    }
    for (int r = 0; r < W; ++r) {
      compare_dispatch(group[r]->config(), r, results[r], s, cmp);
      const size_t n = size_t(counts[r]) * H;
      cmp.eq(download<uint16_t>(rb[r].y, n), s.y[r].data(), n, int(H),
             fmt::format("rank {} combine y", r));
    }
    ++rep.calls;
    return rep.ok;
  };

  // Eager calls.
  for (int it = 0; it < o.iters && rep.ok; ++it) {
    const InputSet& s = sets[it % pool];
    for (int r = 0; r < W; ++r) upload(r, s);
    for (int r = 0; r < W; ++r) enqueue(r);
    finish_and_compare(s);
  }
  if (o.iters > 0) say(fmt::format("eager: {} call(s) checked", rep.calls));

  // Graph replays.
  if (o.graph_replays > 0 && rep.ok) {
    for (int r = (o.mixed ? 1 : 0); r < W; ++r) {
      cudaGraph_t graph = nullptr;
      EPX_CUDA_CHECK(cudaStreamBeginCapture(rb[r].stream, cudaStreamCaptureModeThreadLocal));
      enqueue(r);
      EPX_CUDA_CHECK(cudaStreamEndCapture(rb[r].stream, &graph));
      EPX_CUDA_CHECK(cudaGraphInstantiate(&rb[r].exec, graph, 0));
      EPX_CUDA_CHECK(cudaGraphDestroy(graph));
    }
    const int64_t before = rep.calls;
    for (int i = 0; i < o.graph_replays && rep.ok; ++i) {
      const InputSet& s = sets[(o.iters + i) % pool];
      for (int r = 0; r < W; ++r) upload(r, s);
      for (int r = 0; r < W; ++r) {
        if (rb[r].exec) {
          EPX_CUDA_CHECK(cudaGraphLaunch(rb[r].exec, rb[r].stream));
        } else {
          enqueue(r);
        }
      }
      finish_and_compare(s);
      if ((i + 1) % 100 == 0) say(fmt::format("graph: {} replay(s) checked", i + 1));
    }
    say(fmt::format("graph{}: {} replay(s) checked", o.mixed ? " (rank 0 eager)" : "",
                    rep.calls - before));
  }
  return rep;
}

}  // namespace epx::check
