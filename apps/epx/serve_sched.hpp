#pragma once
// The CPU half of `epx serve-bench` (no CUDA): the simulated serving workload, its chunked-prefill
// scheduler and the latency statistics. The GPU half (serve_bench.cpp) asks the scheduler for a
// step, runs it on every rank, and tells the scheduler when the step ended.
//
// Workload: num_prompts requests of isl input and osl output tokens, all submitted at t = 0,
// request i to data-parallel rank i % world (round robin). At most `concurrency` requests are in
// flight over all ranks; a waiting request is admitted, in id order, at the start of the first
// step after a slot frees.
//
// One engine step, per rank, within max_batched_tokens tokens (a chunked-prefill scheduler):
//  1. one decode token per running request whose prefill is done, oldest admission first;
//  2. prefill tokens of the requests still in prefill, oldest admission first, each taking
//     min(its remaining prompt, the budget left) (so a long prompt goes in chunks over steps).
// When the step ends at time t: a request whose prefill the step finished emits its first output
// token at t; a request whose decode token was in the step emits its next output token at t. A
// request that has emitted osl tokens leaves and frees its slot.
//
// The MoE layer moves a rank's tokens through the All2All in chunks of chunk_size (the
// All2All's max_tokens_per_rank); every rank must run the same number of chunks, so a step's
// num_chunks is the maximum over ranks of ceil(tokens / chunk_size), at least 1.

#include <cstdint>
#include <string>
#include <vector>

namespace epx::cli::serve {

struct Workload {
  int world = 8;  // data-parallel ranks
  int num_prompts = 64;
  int isl = 512;                 // input (prompt) tokens per request
  int osl = 64;                  // output tokens per request
  int concurrency = 64;          // requests in flight over all ranks
  int max_batched_tokens = 512;  // per rank per step
  int chunk_size = 128;          // All2All max_tokens_per_rank
};

// Throws ConfigError naming the flag (--world, --num-prompts, ...), the value and the bound.
void validate(const Workload& w);

// One step's batch.
struct StepPlan {
  std::vector<int> tokens;         // [world] tokens of each rank (decode + prefill)
  std::vector<int> decode_tokens;  // [world] of which decode tokens
  int num_chunks = 1;              // max over ranks of ceil(tokens / chunk_size), >= 1
  int total_tokens() const;
  bool has_prefill() const;
};

struct RequestRecord {
  int id = 0;
  int rank = 0;
  double submitted = 0;             // s, always 0 here
  std::vector<double> token_times;  // s, end of the step that emitted each output token
};

class Scheduler {
 public:
  explicit Scheduler(const Workload& w);  // validates w

  bool done() const { return finished_ == int(requests_.size()); }
  // The next step's batch (admits waiting requests first). Call finish_step() before the next
  // plan_step(). Throws StateError when done() or when a step is already planned.
  const StepPlan& plan_step();
  // The planned step ended at `t` seconds: emits its output tokens at t.
  void finish_step(double t);

  int steps() const { return steps_; }
  int64_t output_tokens() const { return output_tokens_; }
  int64_t total_output_tokens() const { return int64_t(requests_.size()) * w_.osl; }
  const std::vector<RequestRecord>& requests() const { return records_; }

 private:
  struct State {
    int prefilled = 0;
    int generated = 0;
    int step_tokens = 0;  // tokens in the planned step
    bool step_decode = false;
  };
  Workload w_;
  std::vector<State> requests_;
  std::vector<RequestRecord> records_;
  std::vector<std::vector<int>> running_;  // [rank] ids in admission order
  int next_waiting_ = 0;                   // requests below it have been admitted
  int in_flight_ = 0;
  int finished_ = 0;
  int steps_ = 0;
  int64_t output_tokens_ = 0;
  bool planned_ = false;
  StepPlan plan_;
};

// ---- statistics --------------------------------------------------------------------------------

// Percentile q in [0, 100] of `sorted` (ascending, non-empty) by linear interpolation between
// closest ranks (numpy's default, "linear"): position p = q / 100 * (n - 1), value
// sorted[floor(p)] + (p - floor(p)) * (sorted[floor(p) + 1] - sorted[floor(p)]).
// Throws InputError for an empty input or q outside [0, 100].
double percentile(const std::vector<double>& sorted, double q);

struct Summary {
  int64_t count = 0;
  double mean = 0, p25 = 0, p50 = 0, p75 = 0, max = 0;  // 0 when count == 0
};
Summary summarize_values(std::vector<double> v);

// Per request: TTFT = first token time - submitted; ITL = gaps between consecutive output tokens
// of the request, pooled over all requests (osl - 1 gaps per request).
struct LatencyReport {
  Summary itl_s;
  Summary ttft_s;
  int64_t output_tokens = 0;
  double end_s = 0;  // last output token's time
  double output_tokens_per_s = 0;
};
LatencyReport latency_report(const std::vector<RequestRecord>& requests);

// ---- decode graph buckets (--cuda-graph) -------------------------------------------------------

// Largest decode batch per rank that --cuda-graph captures: the chunk, the step budget, and
// kMaxGraphBatch, beyond which a decode step runs eagerly (a captured layer holds one body per
// GEMM row bucket and local expert, so graphs of large batches grow to tens of thousands of nodes).
inline constexpr int kMaxGraphBatch = 128;
int largest_decode_bucket(const Workload& w);

// The default buckets: 1, 2, 4, ... below `largest`, then `largest` (one chunk at most).
std::vector<int> decode_buckets(int largest);

// The smallest of `buckets` (ascending) that holds `tokens` (at least 1), or 0 when none does.
int decode_bucket(const std::vector<int>& buckets, int tokens);

// The name of piece i of a decode graph step captured split at the expert stages (2 x layers + 1
// pieces): piece 0 is layer 1's router, shared expert and dispatch ("L1 dispatch"); odd pieces a
// layer's expert stage ("L2 experts"); even ones a layer's combine and the next layer's router,
// shared expert and dispatch ("L1 combine + L2 dispatch"), the last one the last combine.
// InputError unless num_pieces is odd and 0 <= i < num_pieces.
std::string graph_piece_name(int i, int num_pieces);

}  // namespace epx::cli::serve
