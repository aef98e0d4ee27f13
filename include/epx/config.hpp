#pragma once
// EpConfig: the shape of one expert-parallel MoE layer as seen by one rank, and LaunchConfig:
// the kernel launch shape per op. Both are plain values; validate() is the single place that
// decides whether a combination is possible, and every message names the field, the value and
// the bound.

#include <cstdint>
#include <optional>
#include <string>

namespace epx {

// Hard limits of this build. Each exists for a reason stated here, not for convenience.
inline constexpr int kMaxRanks = 64;               // rank masks are 64-bit words in the kernels
inline constexpr int kMaxTopk = 32;                // one routing entry per lane of a warp
inline constexpr int kMaxHidden = 1 << 16;         // row offsets stay in 32-bit arithmetic
inline constexpr int kMaxTokensPerRank = 1 << 16;  // world_size * max_tokens fits in int32
inline constexpr int kFp8BlockSize = 128;          // 1x128 activation scale blocks
inline constexpr int kMaxTimeoutMs = 24 * 3600 * 1000;

// What dispatch reads and what it puts on the wire.
enum class DispatchDtype {
  kBF16,       // bf16 in, bf16 on the wire and out
  kFP8,        // fp8 e4m3 + f32 1x128 scales in, the same out
  kBF16ToFP8,  // bf16 in, quantised inside dispatch, fp8 + scales out
};

// Layout of the received f32 scales. Input scales are always row-major [N, H/128].
enum class ScaleLayout {
  kRowMajor,     // recv_scales[row][group]
  kColumnMajor,  // recv_scales[group][row] (token index fastest, as grouped fp8 GEMMs read)
};

enum class OutputLayout {
  kTokenMajor,   // recv_x[M, H], one row per (source token, destination rank)
  kExpertMajor,  // recv_x[E/W, W*max_tokens, H], one row per (source token, local expert)
};

// How combine moves each partial to its token's rank (low_latency and allgather_reducescatter).
enum class CombineMode {
  kAuto,  // pull when every rank's memory is on this rank's GPU, push when a peer's is not
  kPull,  // each rank publishes its partials; the token's rank reads them from the ranks that
          // hold them (round-trip reads; on one GPU the fewest bytes)
  kPush,  // each rank writes each partial into the token's rank (posted writes, which beat
          // round-trip reads over NVLink), then flags it; the token's rank sums from its own
          // memory. Holds one more area per round: world_size * max_tokens_per_rank rows of
          // hidden bf16 (f32 for the expert-major layout)
};

// What crosses between the ranks in combine (DeepEP's use_logfmt). low_latency only: every other
// backend refuses kLogFMT with ConfigError.
enum class CombineFormat {
  kBF16,    // bf16 partials, 2 * hidden bytes a row
  kLogFMT,  // LogFMT-10 rows (src/core/logfmt.hpp): 41 * hidden / 32 bytes a row, about 0.64 of
            // the bytes at any hidden that is a multiple of 512; hidden a multiple of 128
};

// The order in which the token's rank adds the partials of the ranks that hold it (f32, rounded
// once). Either order gives the same bits on every backend that takes it and in the reference.
enum class CombineOrder {
  kRank,         // ranks ascending
  kHighestSlot,  // each rank at its highest top-k slot of the token, slots ascending (DeepEP V2's
                 // order: the rank whose experts end the token's top-k row adds last)
};

enum class Backend { kNaive, kAllgatherReduceScatter, kLowLatency, kHighThroughput };

// The baselines deliver every token of every rank (that is what they are); low_latency and
// high_throughput deliver only routed tokens, once per destination rank.
constexpr bool delivers_every_token(Backend b) {
  return b == Backend::kNaive || b == Backend::kAllgatherReduceScatter;
}

// The backends that take CombineFormat::kLogFMT; every other backend refuses it (ConfigError).
constexpr bool takes_logfmt_combine(Backend b) { return b == Backend::kLowLatency; }

// The backends that take CombineOrder::kHighestSlot; every other backend refuses it (ConfigError).
constexpr bool takes_highest_slot_order(Backend b) { return b == Backend::kHighThroughput; }

struct EpConfig {
  int rank = 0;
  int world_size = 1;
  int hidden = 7168;
  int num_experts = 256;
  int topk = 8;
  int max_tokens_per_rank = 128;
  DispatchDtype dtype = DispatchDtype::kBF16ToFP8;
  ScaleLayout scale_layout = ScaleLayout::kRowMajor;
  // bf16-to-fp8 only: each 1x128 block's scale is a power of two (DeepEP's round_scale, what
  // UE8M0-scaled GEMMs take): amax = max(max |x|, 1e-4), scale = 2^ceil(log2(amax / 448)), the
  // fp8 values x / scale (exact division). Otherwise scale = amax / 448 (amax 0: 1 / 448).
  bool round_scale = false;
  OutputLayout layout = OutputLayout::kTokenMajor;
  // Token-major rows ordered by (source rank, source index) on every call. Costs one exchange of
  // counts between the ranks before any row moves; without it each sender reserves its rows in
  // the receiver's area with one atomic (rows from different senders interleave). Combine's
  // result is the same bits either way.
  bool deterministic = false;
  // Dispatches whose combine may still be due: 1, or 2 to issue the dispatch of the next round
  // (another micro-batch) before the combine of this one. Each round beyond the first holds its
  // own receive area, partials and per-round state: 2 doubles the memory of the data areas.
  int rounds_in_flight = 1;
  // A peer that does not arrive within timeout_ms is masked instead of failing the call (DeepEP's
  // shrink mode, NCCL EP's masks): the call completes without it, and later calls skip it
  // (tokens routed to its experts are dropped and counted; its partials are left out of combine)
  // until All2All::clear_mask(). Unordered rows only (not with deterministic or naive).
  bool mask_failed_ranks = false;
  // high_throughput only: hold the received rows (and the partials combine reads) for the worst
  // case, world_size * max_tokens_per_rank rows, so that dispatch never reads a count back on the
  // host and can be captured in a CUDA graph. Without it (the default) dispatch exchanges the
  // counts, reads the round's row count back on the host (the host waits for the peers' counts)
  // and sizes those areas to it: memory follows the rows actually received.
  bool worst_case_output = false;
  // Pull or push combine (CombineMode); the sums, in rank order, are the same bits either way.
  // naive (an all-reduce), high_throughput and mask_failed_ranks take kAuto (which then pulls)
  // or kPull only.
  CombineMode combine = CombineMode::kAuto;
  // What each partial crosses as (CombineFormat): bf16, or LogFMT-10 rows, which the token's rank
  // decodes and adds in the same order as the bf16 sum (the error of the format, not of the order,
  // is what differs). kLogFMT needs hidden a multiple of 128 and the low_latency backend.
  CombineFormat combine_format = CombineFormat::kBF16;
  // The order of combine's sum (CombineOrder). kHighestSlot needs the high_throughput backend and
  // the token-major layout.
  CombineOrder combine_order = CombineOrder::kRank;
  int timeout_ms = 10000;

  int num_local_experts() const { return num_experts / world_size; }
  int num_scale_groups() const { return hidden / kFp8BlockSize; }
  bool input_fp8() const { return dtype == DispatchDtype::kFP8; }
  bool wire_fp8() const { return dtype != DispatchDtype::kBF16; }
  // Receive capacity of the token-major layout, and of each expert in the expert-major one.
  int capacity() const { return world_size * max_tokens_per_rank; }
  // Bytes of one received activation row.
  int64_t wire_row_bytes() const { return wire_fp8() ? hidden : int64_t(hidden) * 2; }
  int expert_rank(int expert) const { return expert / num_local_experts(); }

  // Throws ConfigError naming the first impossible field.
  void validate() const;
};

// high_throughput without worst-case output reads each round's counts back on the host during
// dispatch (every world): its calls cannot be captured in a CUDA graph, and a rank's dispatch
// waits for its peers' counts.
constexpr bool reads_counts_on_host(Backend backend, const EpConfig& cfg) {
  return backend == Backend::kHighThroughput && !cfg.worst_case_output;
}

inline constexpr int kMaxRoundsInFlight = 2;

struct LaunchConfig {
  int num_blocks = 0;       // 0 = choose per world and shape
  int warps_per_block = 0;  // 0 = choose per world and shape
  // high_throughput: rows of each ring (one per channel and peer) that this op's rows flow
  // through; fixes the backend's memory. 0 = choose. Ignored by the other backends. An
  // in-process group whose two ops both leave it 0 uses no rings: its ranks address each other's
  // memory, so rows and partials go straight between their receive areas.
  int ring_rows = 0;
};

inline constexpr int kMaxWarpsPerBlock = 32;
inline constexpr int kMaxBlocks = 1024;
inline constexpr int kMaxRingRows = 1 << 14;

struct LaunchConfigs {
  LaunchConfig dispatch;
  LaunchConfig combine;
};

// Reads the JSON launch file (DESIGN §6): {"global": {...}, "dispatch": {...}, "combine": {...}}
// with keys num_blocks / warps_per_block (aliases block_num / warp_num_per_block) and ring_rows
// (high_throughput). "global" fills what an op leaves unset. Unknown keys, wrong types and
// out-of-range values throw ConfigError naming the file, the key and the allowed range.
LaunchConfigs load_launch_configs(const std::string& path);
LaunchConfigs parse_launch_configs(const std::string& json_text, const std::string& origin);
std::string to_json(const LaunchConfigs& configs);

// Process environment, parsed and validated in one place.
struct EnvSettings {
  std::optional<Backend> backend;          // EPX_BACKEND
  std::optional<int> timeout_ms;           // EPX_TIMEOUT_MS
  std::optional<std::string> config_path;  // EPX_CONFIG_PATH
};
EnvSettings read_env();
EnvSettings parse_env(const char* backend, const char* timeout_ms, const char* config_path);

// Hardware work queues per GPU from the value of CUDA_DEVICE_MAX_CONNECTIONS (nullptr: unset,
// CUDA's default 8). ConfigError names the variable, the value and the range 1..32.
int hardware_queues_per_gpu(const char* max_connections);

Backend parse_backend(const std::string& name);  // throws ConfigError listing the valid names
const char* to_string(Backend b);
const char* to_string(DispatchDtype d);
const char* to_string(ScaleLayout s);
const char* to_string(OutputLayout l);
const char* to_string(CombineMode m);
const char* to_string(CombineFormat f);
const char* to_string(CombineOrder o);
DispatchDtype parse_dispatch_dtype(const std::string& name);
OutputLayout parse_output_layout(const std::string& name);
ScaleLayout parse_scale_layout(const std::string& name);
CombineMode parse_combine_mode(const std::string& name);
CombineFormat parse_combine_format(const std::string& name);
CombineOrder parse_combine_order(const std::string& name);

}  // namespace epx
