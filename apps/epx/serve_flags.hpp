#pragma once
// `epx serve-bench`'s flags (no CUDA): the options, --preset (the original test's workload scaled
// to one GPU), and their validation into the Plan that a run follows.

#include <CLI/CLI.hpp>

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "epx/config.hpp"
#include "epx/moe_shape.hpp"
#include "serve_sched.hpp"

namespace epx::cli::serve {

// The flags as given; the defaults are DeepSeek-R1's MoE layer (the workload's: serve_sched.hpp).
struct Flags {
  Workload workload;
  std::string backends = "naive,allgather_reducescatter,low_latency";
  int hidden = 7168;
  int intermediate = 2048;
  int experts = 256;
  int topk = 8;
  int shared_intermediate = 2048;
  int layers = 2;
  std::string weights = "auto";
  std::string dtype = "bf16-to-fp8";
  std::string layout = "token";
  uint64_t seed = 1;
  std::string json_path;
  std::string preset;
  bool cuda_graph = false;
  std::string graph_buckets;         // comma list; empty = 1, 2, 4, ... up to the largest
  std::string graph_scope = "rank";  // rank | world
  std::string graph_split;           // expert | none; empty = expert (rank scope)
  std::string graph_experts;         // auto | switch | all-rows; empty = auto
  bool overlap = false;
  int prefill_threshold = -1;  // -1: --chunk-size
  int prefill_chunk = 0;       // 0: --max-batched-tokens
};

// One entry of --backends: "decode" alone, or "decode+prefill" (steps whose largest rank holds
// more than --prefill-threshold tokens go through the prefill backend, as engines switch to a
// high-throughput path for prefill).
struct BackendMix {
  Backend decode{};
  std::optional<Backend> prefill;
  std::string name() const;  // "low_latency" or "low_latency+high_throughput"
};

// --weights: one MoeLayer per layer, or one per rank that every layer reuses.
enum class WeightsMode { kAuto, kDistinct, kShared };

// --graph-experts, auto resolved: how a decode graph holds a layer's expert stage (MoeLayer's
// CaptureExperts of the same names).
enum class GraphExperts { kSwitch, kAllRows };
const char* graph_experts_name(GraphExperts g);  // "switch" | "all-rows"

// What a run does, validated.
struct Plan {
  Workload workload;
  std::vector<BackendMix> backends;
  int prefill_threshold = 0;  // tokens per rank above which a step uses a mix's prefill backend
  int prefill_chunk = 0;      // the prefill backend's max_tokens_per_rank
  // Tokens per rank the MoE layers are built for: the chunk, or with a mix the larger prefill
  // chunk (a layer serves both All2All objects).
  int layer_max_tokens = 0;
  MoeShape shape;
  EpConfig cfg;  // one rank's; max_tokens_per_rank = --chunk-size
  int layers = 2;
  WeightsMode weights = WeightsMode::kAuto;
  LaunchSource launch;  // EPX_CONFIG_PATH, else backend defaults (blocks halved on a shared GPU)
  uint64_t seed = 1;
  std::string json_path;
  std::string preset_note;         // empty unless --preset
  bool cuda_graph = false;         // also run every backend with decode steps as CUDA graph replays
  std::vector<int> graph_buckets;  // with cuda_graph: the decode batch sizes captured
  bool world_graphs = false;       // --graph-scope world: one graph of every rank per bucket
  bool split_graphs = true;        // --graph-split expert: expert stages in graphs of their own
  GraphExperts graph_experts = GraphExperts::kSwitch;
  // --overlap: every backend (and mode) run again with decode steps as two micro-batches
  // (MoeLayer::forward_pair, rounds_in_flight 2): the ITL with and without, side by side.
  bool overlap = false;
};

// Registers serve-bench's options on `c`, bound to `f`. Returns the workload options (--world,
// --num-prompts, ...): those that --preset fills unless given.
std::vector<CLI::Option*> add_flags(CLI::App* c, Flags& f);

// Applies --preset to the workload flags not in `given` (option names, e.g. "--isl"), then
// validates every flag, EPX_TIMEOUT_MS and EPX_CONFIG_PATH. Throws ConfigError naming the flag
// (or variable), the value and the bound.
Plan make_plan(Flags f, const std::set<std::string>& given);

}  // namespace epx::cli::serve
