#include "serve_ranks.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstdio>

#include "epx/all2all.hpp"
#include "epx/cuda_check.hpp"
#include "epx/error.hpp"
#include "reference/moe_ref.hpp"
#include "testing/moe_weights.hpp"

namespace epx::cli::serve {

void parallel_for(int n, int threads, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(size_t(std::max(n, 0)));
  std::atomic<int> next{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < std::min(n, std::max(threads, 1)); ++t) {
    pool.emplace_back([&] {
      for (int i = next++; i < n; i = next++) {
        try {
          fn(i);
        } catch (...) {
          errors[size_t(i)] = std::current_exception();
        }
      }
    });
  }
  for (auto& t : pool) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// ---- RankThreads -------------------------------------------------------------------------------

RankThreads::RankThreads(int n) : errors_(size_t(n)) {
  for (int r = 0; r < n; ++r) threads_.emplace_back([this, r] { loop(r); });
}

RankThreads::~RankThreads() {
  {
    std::lock_guard<std::mutex> lock(m_);
    stop_ = true;
  }
  start_.notify_all();
  for (auto& t : threads_) t.join();
}

void RankThreads::run(const std::function<void(int)>& fn) {
  {
    std::lock_guard<std::mutex> lock(m_);
    fn_ = &fn;
    pending_ = int(threads_.size());
    ++generation_;
  }
  start_.notify_all();
  std::unique_lock<std::mutex> lock(m_);
  done_.wait(lock, [&] { return pending_ == 0; });
  fn_ = nullptr;
  std::exception_ptr first, cause;
  int failed = 0;
  for (auto& e : errors_) failed += e != nullptr;
  for (size_t r = 0; r < errors_.size(); ++r) {
    const std::exception_ptr e = errors_[r];
    if (!e) continue;
    if (!first) first = e;
    std::string what;
    try {
      std::rethrow_exception(e);
    } catch (const TimeoutError& x) {
      what = x.what();
    } catch (const PeerError& x) {
      what = x.what();
    } catch (const StateError& x) {
      what = x.what();
    } catch (const std::exception& x) {
      what = x.what();
      if (!cause) cause = e;
    } catch (...) {
      what = "unknown exception";
      if (!cause) cause = e;
    }
    // Every rank's error when several fail: the wait graph they draw names the rank that
    // stopped and the call it stopped in.
    if (failed > 1) fmt::print(stderr, "  rank {}: {}\n", r, what);
  }
  for (auto& x : errors_) x = nullptr;
  if (cause) std::rethrow_exception(cause);
  if (first) std::rethrow_exception(first);
}

void RankThreads::loop(int r) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* fn = nullptr;
    {
      std::unique_lock<std::mutex> lock(m_);
      start_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      fn = fn_;
    }
    std::exception_ptr err;
    try {
      (*fn)(r);
    } catch (...) {
      err = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(m_);
    errors_[size_t(r)] = err;
    if (--pending_ == 0) done_.notify_one();
  }
}

// ---- Rank --------------------------------------------------------------------------------------

void Rank::destroy_graphs() noexcept {
  for (auto& [bucket, pieces] : graphs)
    for (cudaGraphExec_t exec : pieces) (void)cudaGraphExecDestroy(exec);
  graphs.clear();
}

Rank::~Rank() {
  if (stream) (void)cudaStreamSynchronize(stream);
  destroy_graphs();
  for (cudaEvent_t e : piece_events) (void)cudaEventDestroy(e);
  layers.clear();
  if (x) (void)cudaFree(x);
  if (y) (void)cudaFree(y);
  if (x_graph) (void)cudaFree(x_graph);
  if (stream) (void)cudaStreamDestroy(stream);
}

Ranks make_ranks(const Plan& p, const InProcessWorld& world) {
  const Workload& w = p.workload;
  const int W = w.world;
  Ranks ranks;
  for (int r = 0; r < W; ++r) ranks.push_back(std::make_unique<Rank>());
  const size_t row_bytes = size_t(p.shape.hidden) * 2;
  const int pool_rows = 2 * w.max_batched_tokens;
  parallel_for(W, W, [&](int r) {
    Rank& rk = *ranks[size_t(r)];
    rk.index = r;
    rk.device = world.device_of(r);
    EPX_CUDA_CHECK(cudaSetDevice(rk.device));
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&rk.stream, cudaStreamNonBlocking));
    EPX_CUDA_CHECK(cudaMalloc(&rk.x, size_t(pool_rows) * row_bytes));
    EPX_CUDA_CHECK(cudaMalloc(&rk.y, size_t(w.max_batched_tokens) * row_bytes));
    if (p.cuda_graph) {
      const size_t rows = size_t(std::min(w.chunk_size, w.max_batched_tokens));
      EPX_CUDA_CHECK(cudaMalloc(&rk.x_graph, rows * row_bytes));
      EPX_CUDA_CHECK(cudaMemset(rk.x_graph, 0, rows * row_bytes));
    }
    const int block = std::min(pool_rows, 1024);
    const std::vector<uint16_t> host =
        ref::moe::make_moe_input(p.shape, block, p.seed * 1000003ULL + uint64_t(r) + 1);
    for (int row = 0; row < pool_rows; row += block) {
      const size_t n = size_t(std::min(block, pool_rows - row));
      EPX_CUDA_CHECK(cudaMemcpy(static_cast<uint8_t*>(rk.x) + size_t(row) * row_bytes, host.data(),
                                n * row_bytes, cudaMemcpyHostToDevice));
    }
  });
  return ranks;
}

void drain(Ranks& ranks) noexcept {
  for (auto& r : ranks) {
    (void)cudaSetDevice(r->device);
    (void)cudaStreamSynchronize(r->stream);
  }
  (void)cudaGetLastError();
}

// ---- layers ------------------------------------------------------------------------------------

namespace {

// Layer `layer` of rank `rank` over `weights`, which it fills with the weights generated from
// seed + layer: the one place a layer is made.
std::unique_ptr<MoeLayer> make_layer(const Plan& p, const InProcessWorld& world, int rank,
                                     int layer, testing::DeviceMoeWeights& weights) {
  EpConfig ep = p.cfg;
  ep.rank = rank;
  ep.max_tokens_per_rank = p.layer_max_tokens;  // serves a mix's prefill All2All too
  EPX_CUDA_CHECK(cudaSetDevice(world.device_of(rank)));
  weights = testing::make_device_moe_weights(p.shape, p.seed + uint64_t(layer), rank,
                                             p.workload.world);
  auto out = std::make_unique<MoeLayer>(p.shape, weights.view(), ep, world.sm_budget(rank));
  // Eager forwards ignore it.
  out->set_capture_experts(p.graph_experts == GraphExperts::kSwitch ? CaptureExperts::kSwitch
                                                                    : CaptureExperts::kAllRows);
  return out;
}

size_t free_device_bytes(int device) {
  EPX_CUDA_CHECK(cudaSetDevice(device));
  size_t free = 0, total = 0;
  EPX_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return free;
}

}  // namespace

LayerWeights build_layers(const Plan& p, const InProcessWorld& world, Ranks& ranks) {
  const int W = p.workload.world;
  const int threads = int(std::max(1u, std::thread::hardware_concurrency()));
  auto build = [&](int first_layer, int num_layers) {
    // Host generation of the weights is the slow, single-threaded part: one task per
    // (rank, layer), all built before any forward (moe.hpp).
    for (auto& r : ranks) r->layers.resize(size_t(first_layer + num_layers));
    for (auto& r : ranks) r->moe_weights.resize(size_t(first_layer + num_layers));
    parallel_for(W * num_layers, threads, [&](int i) {
      const int r = i % W, l = first_layer + i / W;
      ranks[size_t(r)]->layers[size_t(l)] =
          make_layer(p, world, r, l, ranks[size_t(r)]->moe_weights[size_t(l)]);
    });
  };
  const int dev = world.device_of(0);
  const size_t before = free_device_bytes(dev);
  build(0, 1);
  const size_t after = free_device_bytes(dev);
  const size_t per_layer = before > after ? before - after : 0;
  LayerWeights out;
  out.distinct = p.weights == WeightsMode::kShared ? 1 : p.layers;
  if (p.weights == WeightsMode::kAuto && p.layers > 1) {
    size_t reserve = size_t(2) << 30;  // CUDA / cuBLASLt workspaces and slack
    for (int r = 0; r < W; ++r) {
      EpConfig ep = p.cfg;
      ep.rank = r;
      size_t most = 0;
      for (const BackendMix& b : p.backends) {
        size_t bytes = buffer_bytes(b.decode, ep);
        if (b.prefill) {
          EpConfig pc = ep;
          pc.max_tokens_per_rank = p.prefill_chunk;
          bytes += buffer_bytes(*b.prefill, pc);
        }
        most = std::max(most, bytes);
      }
      reserve += most;
    }
    const size_t room = after > reserve ? after - reserve : 0;
    if (size_t(p.layers - 1) * per_layer > room) out.distinct = 1;
  }
  if (out.distinct > 1) build(1, out.distinct - 1);
  const double gib = double(per_layer) / double(1 << 30);
  out.note = out.distinct > 1
                 ? fmt::format(
                       "{} layers with distinct weights ({:.1f} GiB of device memory per "
                       "layer over all ranks)",
                       out.distinct, gib)
                 : fmt::format(
                       "{} layer(s) sharing one MoeLayer per rank (weights reused by "
                       "every layer{}; {:.1f} GiB per layer over all ranks)",
                       p.layers,
                       p.weights == WeightsMode::kShared ? ", --weights shared"
                                                         : ": distinct layers do not fit",
                       gib);
  return out;
}

}  // namespace epx::cli::serve
