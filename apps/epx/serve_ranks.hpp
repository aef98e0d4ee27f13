#pragma once
// `epx serve-bench`'s in-process ranks (CUDA builds): one persistent host thread per rank, each
// rank's device state (stream, activations, MoE layers, decode graphs), and the building of the
// activations and layers.

#include <cuda_runtime_api.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "epx/moe.hpp"
#include "epx/world.hpp"
#include "serve_flags.hpp"
#include "testing/moe_weights.hpp"

namespace epx::cli::serve {

// fn(i) for i in [0, n) on up to `threads` host threads; rethrows the first exception (by index).
void parallel_for(int n, int threads, const std::function<void(int)>& fn);

// One persistent host thread per rank: run(fn) releases every thread on fn(rank) and returns when
// all have finished (MoeLayer::forward synchronises its stream after each dispatch, and a dispatch
// completes only once every rank has dispatched, so each rank needs its own thread). Threads are
// kept across steps so that a step's time holds no thread creation.
class RankThreads {
 public:
  explicit RankThreads(int n);
  ~RankThreads();
  RankThreads(const RankThreads&) = delete;
  RankThreads& operator=(const RankThreads&) = delete;

  // After every rank has finished, rethrows the cause of a failure: the first rank's error that
  // is not a consequence of another rank's (a peer's TimeoutError, PeerError or StateError names
  // the rank that stopped, not why it stopped), else the first error by rank. When several ranks
  // fail, prints every rank's error (stderr).
  void run(const std::function<void(int)>& fn);

 private:
  void loop(int r);

  std::mutex m_;
  std::condition_variable start_, done_;
  const std::function<void(int)>* fn_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::vector<std::exception_ptr> errors_;
  std::vector<std::thread> threads_;
};

// One rank's device state: stream, activations, MoE layers, decode graphs.
struct Rank {
  int index = 0;
  int device = 0;
  cudaStream_t stream = nullptr;
  void* x = nullptr;        // [2 * max_batched_tokens][H] bf16: input rows, a window per step
  void* y = nullptr;        // [max_batched_tokens][H] bf16: every layer's output
  void* x_graph = nullptr;  // [largest decode bucket][H] bf16: the decode graphs' input
  std::vector<testing::DeviceMoeWeights> moe_weights;  // [layer] the weights its layer reads
  std::vector<std::unique_ptr<MoeLayer>> layers;  // one per --layers, or one reused
  // decode bucket -> every layer's forward: one graph, or the pieces of --graph-split expert
  std::map<int, std::vector<cudaGraphExec_t>> graphs;
  std::vector<double> launch_s;  // host time of each replayed step's cudaGraphLaunch calls
  // Split graphs: events around the pieces of a replayed step, and each piece's GPU time (s)
  // per replay: the time from the end of the previous piece, waits for peers included.
  std::vector<cudaEvent_t> piece_events;
  std::vector<std::vector<double>> piece_s;

  Rank() = default;
  Rank(const Rank&) = delete;
  Rank& operator=(const Rank&) = delete;
  ~Rank();
  // Layer l (0-based) of a step: its own, or the one every layer shares.
  MoeLayer& layer(int l) { return *layers[layers.size() == 1 ? 0 : size_t(l)]; }
  void destroy_graphs() noexcept;
};

using Ranks = std::vector<std::unique_ptr<Rank>>;

// Every rank's stream and activations: 2 x budget input rows (a window of the budget moves
// through them), tiled from a generated block; with --cuda-graph the decode graphs' input.
Ranks make_ranks(const Plan& p, const InProcessWorld& world);

// Builds every rank's layers: one per --layers with distinct weights (seed + layer), or one
// shared by all layers. kAuto builds the first layer everywhere, measures what it took, and
// builds the rest only if they fit next to the backends' buffers.
struct LayerWeights {
  int distinct = 1;  // layers with weights of their own
  std::string note;  // what was built and why, with the device memory a layer takes
};
LayerWeights build_layers(const Plan& p, const InProcessWorld& world, Ranks& ranks);

// Waits for every rank's stream, ignoring errors (after a failure, before anything is freed).
void drain(Ranks& ranks) noexcept;

}  // namespace epx::cli::serve
