// `epx check --moe`: MoE layer on W in-process ranks vs the same layer on one rank with every
// expert local (and no communication between ranks), and vs the CPU reference on small shapes.
//
// Procedure (CUDA builds):
//  1. CUDA_MODULE_LOADING=EAGER unless the environment sets it (before any CUDA call; moe.hpp:
//     cuBLASLt loads its kernels lazily and a lazy load waits for other ranks' spinning kernels).
//  2. An in-process world of W ranks and its All2All group; a one-rank world and its group.
//     Every rank's MoeLayer and the one-rank layer are built (in parallel host threads: the host
//     generation of the weights is the slow part) before any forward.
//  3. Inputs: x_r = make_moe_input(shape, tokens_r, seed_r) per rank, bf16.
//  4. forward() on every rank, each from its own host thread on its own non-blocking stream:
//     the layer synchronises its stream after each dispatch, and a dispatch completes only
//     once every rank has dispatched, so one host thread driving the ranks in turn would wait
//     on rank 0 forever. Every rank runs the same number of chunks (the largest need).
//  5. The one-rank layer on all ranks' tokens concatenated (rank 0's first), in chunks of the
//     same max_tokens. Compare per token: ||y_W - y_1|| / ||y_1|| over all tokens < tolerance;
//     the worst token is reported.
//  6. When H <= 1024 and E <= 64: ref::moe::moe_forward_routed with each run's own GPU routing,
//     compared the same way (both runs).
#include "moe_check.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "flags.hpp"
#include "report.hpp"
#include "epx/config.hpp"
#include "epx/error.hpp"
#include "reference/moe_ref.hpp"
#include "reference/reference.hpp"
#if EPX_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "testing/harness.hpp"
#include "epx/cuda_check.hpp"
#include "epx/all2all.hpp"
#include "epx/moe.hpp"
#include "epx/world.hpp"
#endif

namespace epx::cli {
namespace {

// ||a - b|| / ||b|| over all tokens, and the worst token's own ratio.
struct NormReport {
  double rel = 0;  // ||d|| / ||ref|| over all tokens
  double d_norm = 0;
  double ref_norm = 0;
  double worst = 0;         // max over tokens of ||d_n|| / ||ref_n||
  std::string worst_where;  // "rank r token n"
  int64_t tokens = 0;
};

class NormAccumulator {
 public:
  // got, want: one token of H values.
  void add(const float* got, const float* want, int hidden, const std::string& where) {
    double dd = 0, rr = 0;
    for (int h = 0; h < hidden; ++h) {
      const double d = double(got[h]) - double(want[h]);
      dd += d * d;
      rr += double(want[h]) * double(want[h]);
    }
    d2_ += dd;
    r2_ += rr;
    ++tokens_;
    // A token whose reference is exactly 0 (no shared expert, all weights 0) counts its
    // absolute error.
    const double ratio = rr > 0 ? std::sqrt(dd / rr) : std::sqrt(dd);
    // The first NaN stays the worst.
    if (!worst_nan_ && (worst_where_.empty() || std::isnan(ratio) || ratio > worst_)) {
      worst_ = ratio;
      worst_where_ = where;
      worst_nan_ = std::isnan(ratio);
    }
  }
  NormReport report() const {
    NormReport r;
    r.d_norm = std::sqrt(d2_);
    r.ref_norm = std::sqrt(r2_);
    r.rel = r2_ > 0 ? r.d_norm / r.ref_norm : r.d_norm;
    r.worst = worst_;
    r.worst_where = worst_where_;
    r.tokens = tokens_;
    return r;
  }

 private:
  double d2_ = 0, r2_ = 0, worst_ = 0;
  bool worst_nan_ = false;
  std::string worst_where_;
  int64_t tokens_ = 0;
};

[[maybe_unused]] bool report_line(const char* what, const NormReport& r, double tolerance) {
  // NaN fails.
  const bool ok = r.rel < tolerance;
  fmt::print(
      "  {}: ||d||/||ref|| = {:.3e} (||d|| {:.4e}, ||ref|| {:.4e}, {} tokens), worst "
      "token {} at {:.3e}: {}\n",
      what, r.rel, r.d_norm, r.ref_norm, r.tokens, r.worst_where, r.worst,
      ok ? "ok" : "OVER TOLERANCE");
  return ok;
}

[[maybe_unused]] ref::moe::Scoring parse_scoring(const std::string& s) {
  if (s == "sigmoid") return ref::moe::Scoring::kSigmoidGrouped;
  if (s == "softmax") return ref::moe::Scoring::kSoftmax;
  EPX_THROW(ConfigError, "--scoring = '" + s + "', expected sigmoid or softmax");
}

#if EPX_HAVE_CUDA

// Device memory freed on scope exit (cudaFree works from any current device with UVA).
struct DevMem {
  void* p = nullptr;
  DevMem() = default;
  DevMem(int device, size_t bytes) {
    EPX_CUDA_CHECK(cudaSetDevice(device));
    EPX_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 1)));
  }
  DevMem(const DevMem&) = delete;
  DevMem& operator=(const DevMem&) = delete;
  DevMem(DevMem&& o) noexcept : p(o.p) { o.p = nullptr; }
  DevMem& operator=(DevMem&& o) noexcept {
    std::swap(p, o.p);
    return *this;
  }
  ~DevMem() {
    if (p) (void)cudaFree(p);
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

struct Stream {
  cudaStream_t s = nullptr;
  explicit Stream(int device) {
    EPX_CUDA_CHECK(cudaSetDevice(device));
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() {
    if (s) (void)cudaStreamDestroy(s);
  }
};

// One rank's buffers of one run.
struct RankRun {
  int device = 0;
  int tokens = 0;
  std::vector<uint16_t> x;  // [N][H] bf16
  DevMem dx, dy, dids, dw;
  std::vector<uint16_t> y;   // downloaded
  std::vector<int32_t> ids;  // downloaded routing
  std::vector<float> weights;
};

void upload_inputs(RankRun& r, int hidden, int topk) {
  const size_t n = size_t(r.tokens);
  r.dx = DevMem(r.device, n * hidden * 2);
  r.dy = DevMem(r.device, n * hidden * 2);
  r.dids = DevMem(r.device, n * topk * sizeof(int32_t));
  r.dw = DevMem(r.device, n * topk * sizeof(float));
  if (n > 0) EPX_CUDA_CHECK(cudaMemcpy(r.dx.p, r.x.data(), r.x.size() * 2, cudaMemcpyHostToDevice));
}

void download_outputs(RankRun& r, int hidden, int topk) {
  const size_t n = size_t(r.tokens);
  r.y.resize(n * hidden);
  r.ids.resize(n * topk);
  r.weights.resize(n * topk);
  if (n == 0) return;
  EPX_CUDA_CHECK(cudaSetDevice(r.device));
  EPX_CUDA_CHECK(cudaMemcpy(r.y.data(), r.dy.p, r.y.size() * 2, cudaMemcpyDeviceToHost));
  EPX_CUDA_CHECK(
      cudaMemcpy(r.ids.data(), r.dids.p, r.ids.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
  EPX_CUDA_CHECK(cudaMemcpy(r.weights.data(), r.dw.p, r.weights.size() * sizeof(float),
                            cudaMemcpyDeviceToHost));
}

// Runs fn(i) for i in [0, n) on n host threads; rethrows the first exception (by index) after
// all have finished.
template <typename Fn>
void parallel_for(int n, Fn fn) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      try {
        fn(i);
      } catch (...) {
        errors[size_t(i)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  // The root cause first: a rank's own failure, not a peer's timeout waiting for that rank.
  for (auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const TimeoutError&) {
    } catch (const PeerError&) {
    } catch (...) {
      throw;
    }
  }
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

std::vector<float> to_float(const uint16_t* bf16, size_t count) {
  std::vector<float> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = ref::bf16_to_float(bf16[i]);
  return v;
}

int run_moe_check_gpu(const MoeCheckFlags& f) {
  // 1. Module loading, before any CUDA call of this process.
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  std::string loading_note;
  if (loading == nullptr) {
    ::setenv("CUDA_MODULE_LOADING", "EAGER", 0);
    loading_note =
        "CUDA_MODULE_LOADING=EAGER (set by epx check --moe: ranks spin on each other "
        "and a lazy kernel load would wait for them)";
  } else {
    loading_note = fmt::format("CUDA_MODULE_LOADING={} (from the environment)", loading);
    if (std::string(loading) != "EAGER")
      loading_note += "; WARNING: not EAGER, a lazy cuBLASLt kernel load may deadlock the ranks";
  }

  // Flags -> shapes (no CUDA yet).
  const MoeLayerFlags& l = f.layer;
  EPX_CHECK(l.tolerance > 0 && std::isfinite(l.tolerance), ConfigError, "--tolerance", l.tolerance,
            "> 0");
  const std::vector<int> list = parse_token_counts(f.tokens, "--tokens");
  const EpConfig cfg = f.shape.config(std::max(1, *std::max_element(list.begin(), list.end())));
  const int num_ranks = cfg.world_size;
  const std::vector<int> tokens = tokens_per_rank(list, num_ranks, "--tokens", f.tokens);
  const Backend backend = backend_or_env(f.backend, "--backend");
  const LaunchConfigs launch = launch_from_env().launch;

  ref::moe::MoeShape rs;
  rs.hidden = cfg.hidden;
  rs.intermediate = l.intermediate;
  rs.num_experts = cfg.num_experts;
  rs.topk = cfg.topk;
  rs.num_groups = l.groups;
  rs.topk_groups = l.topk_groups;
  rs.routed_scaling = 2.5f;
  rs.shared_intermediate = l.shared_intermediate;
  rs.scoring = parse_scoring(l.scoring);
  rs.validate();
  MoeShape shape;
  shape.hidden = rs.hidden;
  shape.intermediate = rs.intermediate;
  shape.num_experts = rs.num_experts;
  shape.topk = rs.topk;
  shape.num_groups = rs.num_groups;
  shape.topk_groups = rs.topk_groups;
  shape.routed_scaling = rs.routed_scaling;
  shape.shared_intermediate = rs.shared_intermediate;
  shape.scoring = rs.scoring == ref::moe::Scoring::kSoftmax ? MoeScoring::kSoftmax
                                                            : MoeScoring::kSigmoidGrouped;

  const int t = cfg.max_tokens_per_rank;
  int chunks = 1;
  int64_t total = 0;
  for (int n : tokens) {
    chunks = std::max(chunks, (n + t - 1) / t);
    total += n;
  }
  EPX_CHECK(total <= int64_t(1) << 30, ConfigError, "--tokens", f.tokens,
            "at most 2^30 tokens over all ranks");
  const bool with_cpu_ref = cfg.hidden <= 1024 && cfg.num_experts <= 64;

  require_gpu("epx check --moe");

  fmt::print(
      "epx check --moe: backend {}, world {}, H {}, I {}, E {}, K {}, groups {}/{}, "
      "shared I {}, scoring {}, tokens {}, max {} ({} chunk(s) per rank), dtype {}, "
      "layout {}, scales {}, seed {}, tolerance {:.1e}\n",
      to_string(backend), cfg.world_size, shape.hidden, shape.intermediate, shape.num_experts,
      shape.topk, shape.num_groups, shape.topk_groups, shape.shared_intermediate,
      ref::moe::to_string(rs.scoring), f.tokens, t, chunks, to_string(cfg.dtype),
      to_string(cfg.layout), to_string(cfg.scale_layout), f.seed, l.tolerance);
  fmt::print("  {}\n", loading_note);
  std::fflush(stdout);

  // 2. Worlds, groups and every layer before any forward.
  auto t0 = std::chrono::steady_clock::now();
  InProcessWorld world(num_ranks);
  InProcessWorld world1(1);
  auto group = make_all2all_group(backend, cfg, world, launch);
  EpConfig cfg1 = cfg;
  cfg1.rank = 0;
  cfg1.world_size = 1;
  auto group1 = make_all2all_group(backend, cfg1, world1, launch);
  std::vector<std::unique_ptr<MoeLayer>> layers(static_cast<size_t>(num_ranks));
  std::unique_ptr<MoeLayer> layer1;
  // Threads 0..W-1 build the ranks' layers, thread W the one-rank layer.
  parallel_for(num_ranks + 1, [&](int i) {
    if (i < num_ranks) {
      EPX_CUDA_CHECK(cudaSetDevice(world.device_of(i)));
      layers[size_t(i)] = std::make_unique<MoeLayer>(shape, f.seed, group[size_t(i)]->config(),
                                                     world.sm_budget(i));
    } else {
      EPX_CUDA_CHECK(cudaSetDevice(world1.device_of(0)));
      layer1 = std::make_unique<MoeLayer>(shape, f.seed, group1[0]->config());
    }
  });
  fmt::print("  built {} rank layer(s) and the one-rank layer in {:.1f} s\n", num_ranks,
             seconds_since(t0));
  std::fflush(stdout);

  // 3. Inputs.
  std::vector<RankRun> runs(static_cast<size_t>(num_ranks));
  for (int r = 0; r < num_ranks; ++r) {
    RankRun& run = runs[size_t(r)];
    run.device = world.device_of(r);
    run.tokens = tokens[size_t(r)];
    run.x = ref::moe::make_moe_input(rs, run.tokens, f.seed * 1000003ULL + uint64_t(r) + 1);
    upload_inputs(run, shape.hidden, shape.topk);
  }
  RankRun one;
  one.device = world1.device_of(0);
  one.tokens = static_cast<int>(total);
  one.x.reserve(size_t(total) * shape.hidden);
  for (const RankRun& run : runs) one.x.insert(one.x.end(), run.x.begin(), run.x.end());
  upload_inputs(one, shape.hidden, shape.topk);
  std::vector<std::unique_ptr<Stream>> streams;
  for (int r = 0; r < num_ranks; ++r) streams.push_back(std::make_unique<Stream>(world.device_of(r)));
  Stream stream1(one.device);

  // 4. W ranks, one host thread each.
  t0 = std::chrono::steady_clock::now();
  parallel_for(num_ranks, [&](int r) {
    RankRun& run = runs[size_t(r)];
    EPX_CUDA_CHECK(cudaSetDevice(run.device));
    const MoeRoutingOut routing{run.dids.as<int32_t>(), run.dw.as<float>()};
    All2All& a2a = *group[size_t(r)];
    cudaStream_t s = streams[size_t(r)]->s;
    layers[size_t(r)]->forward(run.dx.p, run.tokens, run.dy.p, a2a, s, chunks, &routing);
    a2a.synchronize(s);
  });
  const double secs_w = seconds_since(t0);
  for (RankRun& run : runs) download_outputs(run, shape.hidden, shape.topk);

  // 5. One rank, every expert local, all tokens.
  t0 = std::chrono::steady_clock::now();
  {
    EPX_CUDA_CHECK(cudaSetDevice(one.device));
    const MoeRoutingOut routing{one.dids.as<int32_t>(), one.dw.as<float>()};
    layer1->forward(one.dx.p, one.tokens, one.dy.p, *group1[0], stream1.s, 0, &routing);
    group1[0]->synchronize(stream1.s);
  }
  const double secs_1 = seconds_since(t0);
  download_outputs(one, shape.hidden, shape.topk);
  fmt::print("  forward: world {} in {:.3f} s (host threads, first call), one rank in {:.3f} s\n",
             num_ranks, secs_w, secs_1);

  const int h = shape.hidden;
  const int k = shape.topk;
  bool ok = true;
  std::string summary;  // the norms, repeated on the PASS / FAIL line
  {
    NormAccumulator acc;
    int64_t routing_diff = 0;
    int64_t off = 0;
    for (int r = 0; r < num_ranks; ++r) {
      const RankRun& run = runs[size_t(r)];
      for (int n = 0; n < run.tokens; ++n) {
        const auto got = to_float(run.y.data() + size_t(n) * h, size_t(h));
        const auto want = to_float(one.y.data() + size_t(off + n) * h, size_t(h));
        acc.add(got.data(), want.data(), h, fmt::format("rank {} token {}", r, n));
        if (!std::equal(run.ids.begin() + int64_t(n) * k, run.ids.begin() + int64_t(n + 1) * k,
                        one.ids.begin() + (off + n) * k))
          ++routing_diff;
      }
      off += run.tokens;
    }
    fmt::print("  routing: {} of {} token(s) routed differently by the two runs\n", routing_diff,
               total);
    const NormReport rep = acc.report();
    ok &= report_line(fmt::format("world {} vs one rank", num_ranks).c_str(), rep, l.tolerance);
    summary += fmt::format("vs one rank {:.3e} (worst token {:.3e})", rep.rel, rep.worst);
  }

  // 6. CPU reference on small shapes, with each run's own GPU routing.
  if (with_cpu_ref) {
    t0 = std::chrono::steady_clock::now();
    const ref::moe::MoeWeights weights = ref::moe::make_moe_weights(rs, f.seed);
    std::vector<std::vector<float>> ref_w(static_cast<size_t>(num_ranks)),
        ref_1(static_cast<size_t>(num_ranks));
    parallel_for(num_ranks, [&](int r) {
      const RankRun& run = runs[size_t(r)];
      int64_t start = 0;
      for (int q = 0; q < r; ++q) start += runs[size_t(q)].tokens;
      ref::moe::RouterOutput gw{run.tokens, k, run.ids, run.weights};
      ref_w[size_t(r)] = ref::moe::moe_forward_routed(rs, weights, run.x, run.tokens, gw);
      ref::moe::RouterOutput g1{run.tokens, k,
                                std::vector<int32_t>(one.ids.begin() + start * k,
                                                     one.ids.begin() + (start + run.tokens) * k),
                                std::vector<float>(one.weights.begin() + start * k,
                                                   one.weights.begin() + (start + run.tokens) * k)};
      ref_1[size_t(r)] = ref::moe::moe_forward_routed(rs, weights, run.x, run.tokens, g1);
    });
    NormAccumulator acc_w, acc_1;
    int64_t off = 0;
    for (int r = 0; r < num_ranks; ++r) {
      const RankRun& run = runs[size_t(r)];
      for (int n = 0; n < run.tokens; ++n) {
        const auto got_w = to_float(run.y.data() + size_t(n) * h, size_t(h));
        const auto got_1 = to_float(one.y.data() + size_t(off + n) * h, size_t(h));
        const std::string where = fmt::format("rank {} token {}", r, n);
        acc_w.add(got_w.data(), ref_w[size_t(r)].data() + size_t(n) * h, h, where);
        acc_1.add(got_1.data(), ref_1[size_t(r)].data() + size_t(n) * h, h, where);
      }
      off += run.tokens;
    }
    fmt::print("  CPU reference (moe_forward_routed with the GPU routing) in {:.1f} s\n",
               seconds_since(t0));
    const NormReport rep_w = acc_w.report();
    const NormReport rep_1 = acc_1.report();
    ok &=
        report_line(fmt::format("world {} vs CPU reference", num_ranks).c_str(), rep_w, l.tolerance);
    ok &= report_line("one rank vs CPU reference", rep_1, l.tolerance);
    summary += fmt::format(
        ", vs CPU reference {:.3e} (worst token {:.3e}), one rank vs CPU "
        "reference {:.3e}",
        rep_w.rel, rep_w.worst, rep_1.rel);
  } else {
    fmt::print("  CPU reference: skipped (runs only when H <= 1024 and E <= 64)\n");
  }

  fmt::print(
      "{}: MoE layer, backend {}, world {}, layout {}, dtype {}: ||d||/||ref|| {}; "
      "tolerance {:.1e}\n",
      ok ? "PASS" : "FAIL", to_string(backend), num_ranks, to_string(cfg.layout),
      to_string(cfg.dtype), summary, l.tolerance);
  std::fflush(stdout);
  return ok ? 0 : 1;
}

#endif  // EPX_HAVE_CUDA

}  // namespace

int run_moe_check(const MoeCheckFlags& flags) {
#if EPX_HAVE_CUDA
  return run_moe_check_gpu(flags);
#else
  (void)flags;
  EPX_THROW(UnsupportedError, "epx check --moe needs an NVIDIA GPU and a CUDA build of epx");
#endif
}

}  // namespace epx::cli
