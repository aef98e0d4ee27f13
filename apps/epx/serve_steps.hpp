#pragma once
// One engine step of `epx serve-bench` (CUDA builds): a rank's part run eagerly or as a replay of
// its decode graph, the capture of those graphs, and --graph-scope world (one graph of every
// rank per bucket, replayed with one launch).

#include <cuda_runtime_api.h>

#include <cstddef>
#include <map>
#include <memory>
#include <vector>

#include "epx/all2all.hpp"
#include "serve_ranks.hpp"

namespace epx::cli::serve {

using All2AllGroup = std::vector<std::unique_ptr<All2All>>;  // one per rank

// What one rank runs in one engine step.
struct RankStep {
  int tokens = 0;
  int num_chunks = 1;    // the same on every rank
  size_t first_row = 0;  // rows [first_row, first_row + tokens) of Rank::x
  int graph_bucket = 0;  // > 0: replay the decode graph of this bucket (tokens <= bucket)
  bool pair = false;     // one chunk as two micro-batches (MoeLayer::forward_pair)
  bool prefill = false;  // through the prefill All2All (a DECODE+PREFILL backend)
};

// One rank's part of one engine step: every MoE layer on the rank's tokens, then the stream
// drained (and the All2All's device status polled). A decode graph step copies the rank's tokens
// into the graph's input (rows beyond them are dummy tokens: whatever the buffer holds, routed
// and computed like the others, outputs ignored) and replays the graph of its bucket, recording
// the host time of its launches (and with split graphs each piece's GPU time) in `rank`.
// `prefill`: the rank's prefill All2All (a DECODE+PREFILL backend), for steps marked prefill.
void run_step(Rank& rank, All2All& a2a, All2All* prefill, int num_layers, const RankStep& step,
              size_t row_bytes);

// Captures this rank's decode graphs per bucket into rank.graphs: every layer's forward of
// `bucket` tokens of x_graph in one chunk (capture only records: no rank waits for another), or
// with `pair` as two micro-batches (forward_pair). One graph, or with `split` (not with `pair`)
// 2 x layers + 1 pieces: each layer's expert stage in a graph of its own, apart from dispatch
// and combine (MoeLayer::set_capture_split). The layers' capture settings are reset on every
// path out.
void capture_decode_graphs(Rank& rank, All2All& a2a, int num_layers,
                           const std::vector<int>& buckets, bool split, bool pair);

// --graph-scope world: per bucket one graph holding every rank's decode forward, each on its
// rank's stream as a branch forked from and joined into `main`, replayed with one launch.
struct WorldGraphs {
  cudaStream_t main = nullptr;
  cudaEvent_t fork = nullptr;
  std::vector<cudaEvent_t> joins;
  std::map<int, cudaGraphExec_t> graphs;  // decode bucket -> every rank's forward
  std::vector<double> launch_s;           // host time of each timed replay's cudaGraphLaunch
  WorldGraphs() = default;
  WorldGraphs(const WorldGraphs&) = delete;
  WorldGraphs& operator=(const WorldGraphs&) = delete;
  ~WorldGraphs();
};

void capture_world_graphs(WorldGraphs& wg, Ranks& ranks, All2AllGroup& group, int num_layers,
                          const std::vector<int>& buckets);

// One decode step of every rank as one replay (--graph-scope world): each rank's input rows into
// its x_graph on `main`, one launch, then the device drained and every rank's status polled.
void run_world_step(WorldGraphs& wg, Ranks& ranks, const std::vector<RankStep>& steps,
                    size_t row_bytes, RankThreads& threads, All2AllGroup& group);

}  // namespace epx::cli::serve
