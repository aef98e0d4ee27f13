#pragma once
// What `epx serve-bench` prints and writes (CUDA builds): the run's header, the table of every
// backend's latencies, and the JSON document (schema epx-serve-bench/1).

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "bench_common.hpp"
#include "epx/config.hpp"
#include "serve_flags.hpp"
#include "serve_sched.hpp"

namespace epx::cli::serve {

// One backend's run, eager or with decode graphs.
struct BackendResult {
  BackendMix backend{};       // the backend, or decode+prefill backends
  bool cuda_graph = false;    // decode steps replayed as CUDA graphs
  bool overlap = false;       // decode steps as two overlapped micro-batches (--overlap)
  int graph_steps = 0;        // steps run as graph replays
  double capture_s = 0;       // capture + instantiation of every rank's decode graphs
  std::string status = "ok";  // ok | unavailable | error
  std::string message;
  LatencyReport latency;
  int steps = 0;
  int prefill_steps = 0;  // steps with prefill tokens
  int prefill_backend_steps = 0;  // steps that went through backend.prefill
  Summary step_s;
  Summary launch_s;              // cuda_graph: host time of cudaGraphLaunch, every rank's replays
  std::vector<Summary> piece_s;  // split graphs: GPU time of each piece, every rank's replays
  double warmup_s = 0;
};

// `s` on one line: newlines become spaces, and beyond `max` characters it ends in "...".
std::string one_line(std::string s, size_t max = 160);

// The lines that open a run: the world and GPU, the MoE shape, the workload, --cuda-graph's
// setting, the launch shapes and `env_note` (the CUDA environment). Flushes stdout.
void print_header(const Plan& p, const GpuInfo& gpu, int sm_budget_per_rank,
                  const std::string& env_note);

// The table of every backend's ITL, TTFT and throughput, what they mean, and with --cuda-graph
// each graph run's replays, capture time, launch time and GPU time per piece.
void print_table(const std::vector<BackendResult>& results);

// Fails now, not after the run: InputError when `path` cannot be written.
void check_json_path(const std::string& path);
// The JSON document of a run (times in ms).
nlohmann::json make_json(const Plan& p, int sm_budget_per_rank, const GpuInfo& gpu,
                         const std::string& weights_note, int distinct_layers,
                         const std::vector<BackendResult>& results);

}  // namespace epx::cli::serve
