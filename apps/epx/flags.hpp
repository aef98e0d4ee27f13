#pragma once
// The flags of the epx commands, parsed in one place (no CUDA). The shape flags bind to
// ShapeFlags and become an EpConfig that EpConfig::validate() alone decides on; its message comes
// back in flag names. Every parser throws ConfigError "<flag> = <value>, expected <bound>".

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "epx/config.hpp"
#include "reference/reference.hpp"

namespace epx::cli {

// ---- values ------------------------------------------------------------------------------------

// Throws ConfigError "<flag> = <value>, expected <bound>" unless lo <= value <= hi; `why` is
// appended to the bound in parentheses.
void check_range(const char* flag, int64_t value, int64_t lo, int64_t hi,
                 const std::string& why = "");

// "a,b,c" -> items; an empty item or an empty list is an error naming `flag`.
std::vector<std::string> split_list(const std::string& text, const char* flag);

enum class Repeats { kRefused, kAllowed };
// Comma list of integers, each in [lo, hi] (`why` as for check_range); with Repeats::kRefused no
// value may appear twice.
std::vector<int> parse_int_list(const std::string& text, const char* flag, int lo, int hi,
                                const std::string& why = "", Repeats repeats = Repeats::kRefused);

// Tokens per rank of a check: one count for every rank, or one count per rank ("0,7,128,1024");
// each in [0, kMaxTokensPerRank] (a rank may have no tokens).
std::vector<int> parse_token_counts(const std::string& text, const char* flag);
// The per-rank counts of `world` ranks from parse_token_counts' list: one count repeated, or
// the list itself when it has `world` entries; otherwise an error naming `flag` and `text`.
std::vector<int> tokens_per_rank(const std::vector<int>& counts, int world, const char* flag,
                                 const std::string& text);

// --routing: uniform | skew | one-expert | masked.
inline constexpr const char* kRoutingNames = "uniform | skew | one-expert | masked";
ref::RoutingKind parse_routing_flag(const std::string& name);

// A backend by name (naive | allgather_reducescatter | low_latency | high_throughput), named as `flag`.
Backend parse_backend_flag(const std::string& name, const char* flag);
// A comma list of backends ("naive,low_latency"), each once, in the order given; errors name
// `flag`.
std::vector<Backend> parse_backend_list(const std::string& text, const char* flag);
// --backend when given (non-empty), else EPX_BACKEND, else low_latency.
Backend backend_or_env(const std::string& name, const char* flag);

DispatchDtype parse_dtype_flag(const std::string& name);       // --dtype
OutputLayout parse_layout_flag(const std::string& name);       // --layout
ScaleLayout parse_scale_layout_flag(const std::string& name);  // --scale-layout
// A comma list of combine formats ("bf16,logfmt"), each once, in the order given; errors name
// `flag`.
std::vector<CombineFormat> parse_combine_format_list(const std::string& text, const char* flag);

// --world-kind: how the ranks reach each other.
enum class WorldKind {
  kInProcess,  // every rank a stream of this process (InProcessWorld)
  kIpc,        // this process is one rank of `epx launch -n W` (IpcWorld)
  kNccl,       // as ipc, memory through NCCL windows (NcclWorld)
};
WorldKind parse_world_kind(const std::string& name);
const char* to_string(WorldKind kind);  // "in-process", "ipc", "nccl"
// One process per rank (ipc or nccl).
inline bool one_process_per_rank(WorldKind kind) {
  return kind != WorldKind::kInProcess;
}

// ---- shape ------------------------------------------------------------------------------------

// The shape flags of every command; defaults are the DeepSeek-R1 shape on 8 ranks.
struct ShapeFlags {
  int world = 8;
  int gpus = 1;  // in-process: ranks round-robin over GPUs 0 .. gpus-1
  int hidden = 7168;
  int experts = 256;
  int topk = 8;
  int max_tokens = 0;  // --max-tokens; 0 = chosen by the command (its largest token count)
  std::string dtype = "bf16-to-fp8";
  std::string layout = "token";
  std::string scale_layout = "row";
  bool round_scale = false;    // --round-scale: power-of-two fp8 scales (bf16-to-fp8)
  bool deterministic = false;  // --deterministic: rows in (source rank, source index) order
  int rounds_in_flight = 1;    // --rounds-in-flight
  bool worst_case_output = false;  // --worst-case-output (high_throughput)
  std::string combine = "auto";    // --combine: auto | pull | push
  // --combine-format: bf16 | logfmt (bench: a comma list, split by bench before config())
  std::string combine_format = "bf16";
  std::string combine_order = "rank";
  int timeout_ms = 0;  // --timeout-ms; 0 = EPX_TIMEOUT_MS or the library's default

  // The EpConfig of these flags with max_tokens_per_rank = --max-tokens when given, else
  // `tokens` (named `tokens_flag` in messages: the flag it came from). Decided by
  // EpConfig::validate() alone; its ConfigError comes back with flag names for field names
  // ("--experts = 100, expected a multiple of --world = 8").
  EpConfig config(int tokens, const char* tokens_flag = "--tokens") const;
  // GPUs 0 .. --gpus - 1, where an in-process world places its ranks; --gpus in [1, --world].
  std::vector<int> devices() const;
};

enum class MaxTokensFlag { kOffered, kNotOffered };
// Binds the shape flags to `f`; --max-tokens only where a command has one group for all its
// token counts (check), not where each count is its own group (bench, tune).
void add_shape_flags(CLI::App* c, ShapeFlags& f, MaxTokensFlag max_tokens);

// The message of an EpConfig::validate() error with each field name replaced by the flag that
// sets it (world_size -> --world, num_experts -> --experts, max_tokens_per_rank ->
// `max_tokens_flag`, ...).
std::string in_flag_names(const std::string& message, const char* max_tokens_flag);

// One process per rank (--world-kind ipc or nccl): the world is EPX_WORLD_SIZE, so --world, when
// given, must equal it; `command` ("epx check") goes into the message that says how to run it.
void take_world_from_env(ShapeFlags& f, bool world_given, const char* command);

// ---- token sweeps (bench, tune) ---------------------------------------------------------------

// The workload flags of the commands that measure each token count with its own group.
struct SweepFlags {
  ShapeFlags shape;
  std::string tokens = "128,4096";
  std::string routing = "uniform";
  uint64_t seed = 1;
};
// The shape flags (no --max-tokens), --tokens, --routing and --seed.
void add_sweep_flags(CLI::App* c, SweepFlags& f);

// The validated sweep: every token count's EpConfig has passed EpConfig::validate().
struct Sweep {
  EpConfig cfg;             // max_tokens_per_rank = the largest count
  std::vector<int> tokens;  // tokens per rank, each measured separately, in the order given
  ref::RoutingKind routing = ref::RoutingKind::kUniform;
  std::string routing_name;
  uint64_t seed = 1;
  std::vector<int> devices;  // in-process: the GPUs of --gpus

  // cfg with max_tokens_per_rank = tokens (one of `tokens`).
  EpConfig config_for(int tokens) const;
};
// Throws ConfigError naming the flag, the value and the bound.
Sweep make_sweep(const SweepFlags& f);

// ---- environment -------------------------------------------------------------------------------

// Launch shapes from EPX_CONFIG_PATH (or all zero = the backend's defaults) and their origin.
struct LaunchSource {
  LaunchConfigs launch;
  std::string origin;      // "EPX_CONFIG_PATH=<path>" or "backend defaults"
  bool from_file = false;  // EPX_CONFIG_PATH was given
};
LaunchSource launch_from_env();

}  // namespace epx::cli
