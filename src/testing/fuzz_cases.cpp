#include "testing/fuzz_cases.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <utility>

namespace epx::testing {
namespace {

// The finaliser of splitmix64 (Steele, Lea, Flood 2014): a bijection that scatters every bit.
uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A counter-based stream over splitmix64: the same seed gives the same draws everywhere.
class Draws {
 public:
  explicit Draws(uint64_t key) : state_(key) {}

  uint64_t next() {
    state_ += 0x9E3779B97F4A7C15ull;
    return mix(state_);
  }
  // Uniform in [lo, hi]; the modulo bias (span / 2^64) is far below anything a case shows.
  int in(int lo, int hi) { return lo + int(next() % uint64_t(hi - lo + 1)); }
  // True with probability num / den.
  bool odds(int num, int den) { return in(1, den) <= num; }
  template <typename T, size_t N>
  T pick(const std::array<T, N>& from) {
    return from[size_t(in(0, int(N) - 1))];
  }

 private:
  uint64_t state_;
};

// The stream of case `index`: independent of every other index of the same seed.
uint64_t case_key(uint64_t seed, int64_t index) {
  return mix(mix(seed) ^ uint64_t(index) * 0xD1B54A32D192ED03ull);
}

// --routing's name of each kind (apps/epx/flags.hpp: uniform | skew | one-expert | masked).
const char* routing_flag(ref::RoutingKind kind) {
  switch (kind) {
    case ref::RoutingKind::kUniform:
      return "uniform";
    case ref::RoutingKind::kSkewed:
      return "skew";
    case ref::RoutingKind::kOneExpert:
      return "one-expert";
    case ref::RoutingKind::kMasked:
      return "masked";
  }
  return "invalid";
}

// Rows the CPU reference writes for one token: its destination ranks (every rank for the
// all-gather backends), plus one per expert in the expert-major layout.
int64_t reference_rows_per_token(const EpConfig& cfg, Backend backend) {
  const int W = cfg.world_size, K = cfg.topk;
  int64_t rows = delivers_every_token(backend) ? W : std::min(K, W);
  if (cfg.layout == OutputLayout::kExpertMajor) rows += K;
  return rows;
}

// Device bytes of the world's buffers per token of max_tokens_per_rank: every rank holds, per
// round in flight, W x max_tokens rows of wire bytes, partials and (naive) reduced rows, and in
// the expert-major layout E/W experts' rows of W x max_tokens each (wire bytes and outputs).
int64_t device_bytes_per_token(const EpConfig& cfg) {
  const int64_t W = cfg.world_size, H = cfg.hidden, E = cfg.num_experts;
  int64_t per_rank = W * H * 6;
  if (cfg.layout == OutputLayout::kExpertMajor) per_rank += E * H * 4;
  return W * cfg.rounds_in_flight * per_rank;
}

}  // namespace

const char* to_string(FuzzMode mode) {
  switch (mode) {
    case FuzzMode::kEager:
      return "eager";
    case FuzzMode::kGraph:
      return "graph";
    case FuzzMode::kMixed:
      return "mixed";
    case FuzzMode::kOneLaunch:
      return "one-launch";
    case FuzzMode::kHalves:
      return "halves";
  }
  return "invalid";
}

uint64_t fuzz_case_seed(uint64_t seed, int64_t index) {
  // Short enough to read in a command line, never 0.
  return (case_key(seed, index) >> 32) % 1000000000ull + 1;
}

FuzzCase make_fuzz_case(uint64_t seed, int64_t index) {
  Draws d(case_key(seed, index));
  FuzzCase c;
  c.index = index;
  CheckOptions& o = c.options;
  EpConfig& cfg = o.cfg;

  // World: 1, 2, 3, 4 or 8 ranks on the GPU, now and then 16.
  cfg.world_size = d.odds(1, 16) ? 16 : d.pick(std::array{1, 2, 3, 4, 8});
  const int W = cfg.world_size;
  o.backend = d.pick(std::array{Backend::kNaive, Backend::kAllgatherReduceScatter,
                                Backend::kLowLatency, Backend::kHighThroughput});
  const bool ht = o.backend == Backend::kHighThroughput;
  // The expert-major layout exists in the low_latency backend only.
  cfg.layout = o.backend == Backend::kLowLatency && d.odds(1, 3) ? OutputLayout::kExpertMajor
                                                                 : OutputLayout::kTokenMajor;
  cfg.dtype =
      d.pick(std::array{DispatchDtype::kBF16, DispatchDtype::kFP8, DispatchDtype::kBF16ToFP8});
  cfg.scale_layout = d.pick(std::array{ScaleLayout::kRowMajor, ScaleLayout::kColumnMajor});
  // Hidden: bf16 rows are 16-byte vectors (multiples of 8), fp8 rows whole 1x128 scale blocks;
  // a quarter of the cases take a model's size.
  const int step = cfg.wire_fp8() ? kFp8BlockSize : 8;
  cfg.hidden = d.odds(1, 4) ? d.pick(std::array{2048, 4096, 7168})
                            : step * d.in(1, kFuzzMaxHidden / step);
  // Experts: E / W local experts on every rank.
  const int local = d.in(1, std::min(kFuzzMaxLocalExperts, kFuzzMaxExperts / W));
  cfg.num_experts = local * W;
  // Top-k: up to 8 as models use, now and then up to 32 (one routing entry per warp lane).
  const int max_k = std::min(cfg.num_experts, d.odds(1, 8) ? kMaxTopk : 8);
  cfg.topk = d.in(1, max_k);
  cfg.rounds_in_flight = ht ? 1 : d.in(1, kMaxRoundsInFlight);  // high_throughput: one round
  cfg.deterministic = d.odds(1, 4);
  o.ids_int64 = d.odds(1, 4);
  o.routing = d.pick(std::array{ref::RoutingKind::kUniform, ref::RoutingKind::kSkewed,
                                ref::RoutingKind::kOneExpert, ref::RoutingKind::kMasked});

  // Max tokens per rank within the reference's and the device's budgets, at least 1; a quarter
  // of the cases at the cap.
  const int64_t row_elems = int64_t(W) * cfg.hidden * reference_rows_per_token(cfg, o.backend);
  const int64_t by_reference = kFuzzReferenceBudget / row_elems;
  const int64_t by_device = kFuzzDeviceBudget / device_bytes_per_token(cfg);
  const int cap = int(std::clamp<int64_t>(std::min(by_reference, by_device), 1, kFuzzMaxTokens));
  cfg.max_tokens_per_rank = d.odds(1, 4) ? cap : d.in(1, cap);
  // Tokens of each rank in [0, max]: empty and full ranks more often than their share.
  const int max_tokens = cfg.max_tokens_per_rank;
  for (int r = 0; r < W; ++r) {
    const int kind = d.in(0, 7);
    o.tokens.push_back(kind == 0 ? 0 : kind == 1 ? max_tokens : d.in(0, max_tokens));
  }

  // The mode; halves need unordered rows (their send half must not wait for peers' counts), and
  // high_throughput has none.
  const bool halves_ok = !cfg.deterministic && o.backend != Backend::kNaive && !ht;
  do {
    c.mode = FuzzMode(d.in(0, kNumFuzzModes - 1));
  } while (c.mode == FuzzMode::kHalves && !halves_ok);
  switch (c.mode) {
    case FuzzMode::kEager:
      o.iters = d.in(1, 3);
      break;
    case FuzzMode::kGraph:
      o.iters = d.in(1, 2);
      o.graph_replays = d.in(2, 5);
      break;
    case FuzzMode::kMixed:
      o.iters = d.in(0, 1);
      o.graph_replays = d.in(2, 5);
      o.mixed = true;
      break;
    case FuzzMode::kOneLaunch:
    case FuzzMode::kHalves:
      o.iters = d.in(1, 2);
      o.graph_replays = d.odds(1, 2) ? d.in(2, 4) : 0;
      o.one_launch = c.mode == FuzzMode::kOneLaunch;
      o.halves = c.mode == FuzzMode::kHalves;
      break;
  }
  // high_throughput: receive areas for the worst case where a graph is captured, and now and then
  // in eager calls too; else sized per call.
  cfg.worst_case_output = ht && (o.graph_replays > 0 || d.odds(1, 3));
  o.seed = fuzz_case_seed(seed, index);
  // A third of the cases of the backends that may push combine through push (drawn last, so
  // that the earlier draws of a seed stay what they were).
  const bool may_push = !ht && o.backend != Backend::kNaive;
  cfg.combine = may_push && d.odds(1, 3) ? CombineMode::kPush : CombineMode::kAuto;
  // A quarter of the quantised cases with power-of-two scales (drawn last too).
  cfg.round_scale = cfg.dtype == DispatchDtype::kBF16ToFP8 && d.odds(1, 4);
  // A quarter of low_latency's cases whose rows are whole LogFMT blocks combine in LogFMT (last).
  if (takes_logfmt_combine(o.backend) && cfg.hidden % kFp8BlockSize == 0 && d.odds(1, 4))
    cfg.combine_format = CombineFormat::kLogFMT;
  // A quarter of high_throughput's cases sum in the highest-slot order (last).
  if (takes_highest_slot_order(o.backend) && cfg.layout == OutputLayout::kTokenMajor &&
      d.odds(1, 4))
    cfg.combine_order = CombineOrder::kHighestSlot;

  const std::string tokens = fmt::format("{}", fmt::join(o.tokens, ","));
  const std::string calls =
      o.graph_replays == 0 ? fmt::format("{} eager", o.iters)
                           : fmt::format("{} eager + {} replays", o.iters, o.graph_replays);
  const std::string scales =
      cfg.wire_fp8() ? fmt::format(" {}-major scales", to_string(cfg.scale_layout)) : "";
  c.description = fmt::format(
      "W{} H{} E{} K{} tokens {} (max {}) {}{} {}-major{} routing {} {}{}{}{} rounds {} {} ({})",
      W, cfg.hidden, cfg.num_experts, cfg.topk, tokens, max_tokens, to_string(cfg.dtype),
      cfg.round_scale ? " round-scale" : "", to_string(cfg.layout), scales, routing_flag(o.routing), to_string(o.backend),
      cfg.deterministic   ? " deterministic"
      : cfg.worst_case_output ? " worst-case-output"
                              : "",
      o.ids_int64 ? " ids64" : "",
      fmt::format("{}{}{}", cfg.combine == CombineMode::kPush ? " push" : "",
                  cfg.combine_format == CombineFormat::kLogFMT ? " logfmt" : "",
                  cfg.combine_order == CombineOrder::kHighestSlot ? " highest-slot" : ""),
      cfg.rounds_in_flight, to_string(c.mode), calls);

  std::string cmd = fmt::format(
      "epx check --world {} --hidden {} --experts {} --topk {} --max-tokens {} --tokens {} "
      "--dtype {} --layout {} --scale-layout {} --routing {} --backend {} --rounds-in-flight {} "
      "--seed {} --iters {}",
      W, cfg.hidden, cfg.num_experts, cfg.topk, max_tokens, tokens, to_string(cfg.dtype),
      to_string(cfg.layout), to_string(cfg.scale_layout), routing_flag(o.routing),
      to_string(o.backend), cfg.rounds_in_flight, o.seed, o.iters);
  if (o.graph_replays > 0) cmd += fmt::format(" --graph {}", o.graph_replays);
  if (cfg.combine == CombineMode::kPush) cmd += " --combine push";
  if (cfg.round_scale) cmd += " --round-scale";
  if (cfg.combine_format == CombineFormat::kLogFMT) cmd += " --combine-format logfmt";
  if (cfg.combine_order == CombineOrder::kHighestSlot) cmd += " --combine-order highest_slot";
  for (const auto& [on, flag] : {std::pair{cfg.deterministic, " --deterministic"},
                                 std::pair{o.ids_int64, " --ids64"}, std::pair{o.mixed, " --mixed"},
                                 std::pair{o.one_launch, " --one-launch"},
                                 std::pair{o.halves, " --halves"},
                                 std::pair{cfg.worst_case_output, " --worst-case-output"}})
    if (on) cmd += flag;
  c.command = cmd;
  return c;
}

}  // namespace epx::testing
