#include "serve_steps.hpp"

#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <cstdio>

#include "testing/graph_capture.hpp"
#include "epx/cuda_check.hpp"
#include "epx/error.hpp"
#include "epx/moe.hpp"

namespace epx::cli::serve {
namespace {

// A host call that takes longer than this while enqueueing a step is reported (stderr).
constexpr double kSlowEnqueueMs = 100.0;

// Ends the capture of `s`, instantiates its graph and uploads it on `s`.
cudaGraphExec_t end_capture(cudaStream_t s) {
  cudaGraphExec_t exec = testing::end_capture_and_instantiate(s);
  const cudaError_t up = cudaGraphUpload(exec, s);
  if (up != cudaSuccess) (void)cudaGraphExecDestroy(exec);
  EPX_CUDA_CHECK(up);
  return exec;
}

// Resets the capture settings of a rank's layers when it goes (a split hook refers to the
// rank's graphs, which outlive no backend).
struct CaptureSettingsReset {
  std::vector<std::unique_ptr<MoeLayer>>& layers;
  ~CaptureSettingsReset() {
    for (auto& layer : layers) {
      layer->set_capture_split({});
      try {
        layer->set_capture_token_bound(0);  // may allocate (once): never throw from here
      } catch (...) {
      }
    }
  }
};

double ms_between(std::chrono::steady_clock::time_point a,
                  std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// `tokens` rows of x (one chunk) through `layer` as two micro-batches: the first half of the
// rows (rounded up), then the rest.
void forward_pair(MoeLayer& layer, const void* x, int tokens, void* y, All2All& a2a,
                  cudaStream_t stream, size_t row_bytes) {
  const int first = (tokens + 1) / 2;
  const MoeLayer::MicroBatch a{x, first, y};
  const MoeLayer::MicroBatch b{static_cast<const uint8_t*>(x) + size_t(first) * row_bytes,
                               tokens - first, static_cast<uint8_t*>(y) + size_t(first) * row_bytes};
  layer.forward_pair(a, b, a2a, stream);
}

// The graph half of run_step.
void replay_decode_graph(Rank& rank, All2All& a2a, const RankStep& step, const void* x,
                         size_t row_bytes) {
  const auto t0 = std::chrono::steady_clock::now();
  if (step.tokens > 0) {
    EPX_CUDA_CHECK(cudaMemcpyAsync(rank.x_graph, x, size_t(step.tokens) * row_bytes,
                                   cudaMemcpyDeviceToDevice, rank.stream));
  }
  const auto t1 = std::chrono::steady_clock::now();
  const std::vector<cudaGraphExec_t>& pieces = rank.graphs.at(step.graph_bucket);
  const bool timed = pieces.size() > 1 && rank.piece_events.size() == pieces.size() + 1;
  if (timed) EPX_CUDA_CHECK(cudaEventRecord(rank.piece_events[0], rank.stream));
  // Enqueueing must not wait for the device: peers spin until this rank's kernels run.
  double launch_ms = 0;  // the cudaGraphLaunch calls alone
  for (size_t i = 0; i < pieces.size(); ++i) {
    const auto l0 = std::chrono::steady_clock::now();
    EPX_CUDA_CHECK(cudaGraphLaunch(pieces[i], rank.stream));
    launch_ms += ms_between(l0, std::chrono::steady_clock::now());
    if (timed) EPX_CUDA_CHECK(cudaEventRecord(rank.piece_events[i + 1], rank.stream));
  }
  const double copy_ms = ms_between(t0, t1);
  rank.launch_s.push_back(launch_ms / 1e3);
  if (copy_ms + launch_ms > kSlowEnqueueMs) {
    fmt::print(stderr,
               "  rank {}: enqueueing the bucket-{} graph blocked the host {:.0f} ms "
               "(input copy {:.0f} ms, cudaGraphLaunch {:.0f} ms)\n",
               rank.index, step.graph_bucket, copy_ms + launch_ms, copy_ms, launch_ms);
  }
  a2a.synchronize(rank.stream);
  if (!timed) return;
  rank.piece_s.resize(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) {
    float ms = 0;
    EPX_CUDA_CHECK(cudaEventElapsedTime(&ms, rank.piece_events[i], rank.piece_events[i + 1]));
    rank.piece_s[i].push_back(ms / 1e3);
  }
}

}  // namespace

void run_step(Rank& rank, All2All& decode, All2All* prefill, int num_layers, const RankStep& step,
              size_t row_bytes) {
  EPX_CUDA_CHECK(cudaSetDevice(rank.device));
  EPX_CHECK(!step.prefill || prefill != nullptr, InputError, "prefill step", "no prefill All2All",
            "a DECODE+PREFILL backend");
  All2All& a2a = step.prefill ? *prefill : decode;
  const void* x = static_cast<const uint8_t*>(rank.x) + step.first_row * row_bytes;
  if (step.graph_bucket > 0) {
    replay_decode_graph(rank, a2a, step, x, row_bytes);
    return;
  }
  for (int l = 0; l < num_layers; ++l) {
    if (step.pair) {
      forward_pair(rank.layer(l), x, step.tokens, rank.y, a2a, rank.stream, row_bytes);
    } else {
      rank.layer(l).forward(x, step.tokens, rank.y, a2a, rank.stream, step.num_chunks);
    }
  }
  a2a.synchronize(rank.stream);
}

void capture_decode_graphs(Rank& rank, All2All& a2a, int num_layers,
                           const std::vector<int>& buckets, bool split, bool pair) {
  EPX_CHECK(!(split && pair), InputError, "split with pair", "both set",
            "one of them (forward_pair records no split)");
  EPX_CUDA_CHECK(cudaSetDevice(rank.device));
  const CaptureSettingsReset reset{rank.layers};
  for (int b : buckets) {
    std::vector<cudaGraphExec_t>& pieces = rank.graphs[b];  // destroy_graphs() frees them
    for (auto& layer : rank.layers) {
      layer->set_capture_token_bound(b);
      if (!split) continue;
      layer->set_capture_split([&pieces](cudaStream_t s) {
        pieces.push_back(end_capture(s));
        EPX_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      });
    }
    EPX_CUDA_CHECK(cudaStreamBeginCapture(rank.stream, cudaStreamCaptureModeThreadLocal));
    try {
      for (int l = 0; l < num_layers; ++l) {
        if (pair) {
          forward_pair(rank.layer(l), rank.x_graph, b, rank.y, a2a, rank.stream,
                       size_t(rank.layer(l).shape().hidden) * 2);
        } else {
          rank.layer(l).forward(rank.x_graph, b, rank.y, a2a, rank.stream, 1);
        }
      }
    } catch (...) {
      testing::abandon_capture(rank.stream);
      throw;
    }
    pieces.push_back(end_capture(rank.stream));
  }
  // Timing events around the pieces (the same count for every bucket), made once.
  const size_t events = split ? size_t(2 * num_layers + 2) : 0;
  while (rank.piece_events.size() < events) {
    cudaEvent_t e = nullptr;
    EPX_CUDA_CHECK(cudaEventCreate(&e));
    rank.piece_events.push_back(e);
  }
}

// ---- --graph-scope world -----------------------------------------------------------------------

WorldGraphs::~WorldGraphs() {
  if (main) (void)cudaStreamSynchronize(main);
  for (auto& [b, exec] : graphs) (void)cudaGraphExecDestroy(exec);
  for (cudaEvent_t e : joins)
    if (e) (void)cudaEventDestroy(e);
  if (fork) (void)cudaEventDestroy(fork);
  if (main) (void)cudaStreamDestroy(main);
}

void capture_world_graphs(WorldGraphs& wg, Ranks& ranks, All2AllGroup& group, int num_layers,
                          const std::vector<int>& buckets) {
  const int W = int(ranks.size());
  EPX_CUDA_CHECK(cudaSetDevice(ranks[0]->device));
  EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&wg.main, cudaStreamNonBlocking));
  EPX_CUDA_CHECK(cudaEventCreateWithFlags(&wg.fork, cudaEventDisableTiming));
  wg.joins.assign(size_t(W), nullptr);
  for (int r = 0; r < W; ++r) {
    EPX_CUDA_CHECK(cudaSetDevice(ranks[size_t(r)]->device));
    EPX_CUDA_CHECK(cudaEventCreateWithFlags(&wg.joins[size_t(r)], cudaEventDisableTiming));
  }
  for (int b : buckets) {
    for (auto& r : ranks) {  // before the capture: the bound may allocate a staging buffer
      EPX_CUDA_CHECK(cudaSetDevice(r->device));
      for (auto& layer : r->layers) layer->set_capture_token_bound(b);
    }
    EPX_CUDA_CHECK(cudaSetDevice(ranks[0]->device));
    EPX_CUDA_CHECK(cudaStreamBeginCapture(wg.main, cudaStreamCaptureModeThreadLocal));
    try {
      EPX_CUDA_CHECK(cudaEventRecord(wg.fork, wg.main));
      for (int r = 0; r < W; ++r) {
        Rank& rank = *ranks[size_t(r)];
        EPX_CUDA_CHECK(cudaSetDevice(rank.device));
        EPX_CUDA_CHECK(cudaStreamWaitEvent(rank.stream, wg.fork, 0));
        for (int l = 0; l < num_layers; ++l)
          rank.layer(l).forward(rank.x_graph, b, rank.y, *group[size_t(r)], rank.stream, 1);
        EPX_CUDA_CHECK(cudaEventRecord(wg.joins[size_t(r)], rank.stream));
        EPX_CUDA_CHECK(cudaStreamWaitEvent(wg.main, wg.joins[size_t(r)], 0));
      }
    } catch (...) {
      testing::abandon_capture(wg.main);
      throw;
    }
    EPX_CUDA_CHECK(cudaSetDevice(ranks[0]->device));
    wg.graphs[b] = end_capture(wg.main);
  }
  for (auto& r : ranks)
    for (auto& layer : r->layers) layer->set_capture_token_bound(0);
}

void run_world_step(WorldGraphs& wg, Ranks& ranks, const std::vector<RankStep>& steps,
                    size_t row_bytes, RankThreads& threads, All2AllGroup& group) {
  EPX_CUDA_CHECK(cudaSetDevice(ranks[0]->device));
  for (size_t r = 0; r < ranks.size(); ++r) {
    const RankStep& st = steps[r];
    if (st.tokens == 0) continue;
    const void* x = static_cast<const uint8_t*>(ranks[r]->x) + st.first_row * row_bytes;
    EPX_CUDA_CHECK(cudaMemcpyAsync(ranks[r]->x_graph, x, size_t(st.tokens) * row_bytes,
                                   cudaMemcpyDeviceToDevice, wg.main));
  }
  const auto t0 = std::chrono::steady_clock::now();
  EPX_CUDA_CHECK(cudaGraphLaunch(wg.graphs.at(steps[0].graph_bucket), wg.main));
  wg.launch_s.push_back(seconds_since(t0));
  EPX_CUDA_CHECK(cudaStreamSynchronize(wg.main));
  threads.run([&](int r) { group[size_t(r)]->poll(); });
}

}  // namespace epx::cli::serve
