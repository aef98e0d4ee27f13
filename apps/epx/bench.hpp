#pragma once
// Inside `epx bench`: the plan of a run (bench.cpp turns the flags into it), the results per
// token count and backend, the runs (bench_run.cpp: in-process; bench_ipc.cpp: one process per
// rank; bench_nccl.cpp: NCCL's own collectives on the same data) and the report
// (bench_report.cpp: the table and the JSON).

#include <nlohmann/json.hpp>

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "bench_common.hpp"

#if EPX_HAVE_CUDA
#include "testing/harness.hpp"
#endif

namespace epx {
class InProcessWorld;
class NcclWorld;
}  // namespace epx

namespace epx::cli::bench {

inline constexpr int kMinIters = 50;  // DESIGN §8: median and p90 over >= 50 timed iterations
inline constexpr int kMaxIters = 1000000;
inline constexpr size_t kCopyBytes = size_t(1) << 30;
inline constexpr int kCopyRepeats = 20;
inline constexpr const char* kOps[] = {"dispatch", "combine"};

struct Plan {
  Sweep shape;  // shape.cfg.combine_format is formats.front(); each result sets its own
  std::vector<Backend> backends;
  // --combine-format: each backend is measured once per format, in this order (a backend that
  // does not take a format gets an "unavailable" result for it, not a run)
  std::vector<CombineFormat> formats{CombineFormat::kBF16};
  LaunchSource launch;
  int iters = 0;
  int warmup = 0;
  bool verify = true;
  std::string json_path;
  bool ipc = false;   // one process per rank (--world-kind ipc or nccl)
  bool nccl = false;  // --world-kind nccl
};

// One backend at one token count.
// One backend in one combine format at one token count.
struct BackendResult {
  Backend backend{};
  CombineFormat format = CombineFormat::kBF16;
  std::string status = "ok";             // ok | unavailable | failed (verification) | error
  std::string verification = "not_run";  // passed | failed | skipped | not_run
  std::string message;
  struct Mode {
    bool run = false;  // this timing / launch pair was measured (ok or error)
    bool ok = false;
    std::string error;
    Stats op[2];  // dispatch, combine; ipc: those of the slowest rank (largest median)
    // ipc only: every rank's own figures, and which rank op[] comes from
    std::vector<Stats> per_rank[2];
    int slowest_rank[2] = {-1, -1};
  } mode[4];  // mode_index(timing, launch)
};

// Index into BackendResult::mode. In-process runs measure all four; one process per rank (ipc)
// launches per rank only.
inline int mode_index(TimingMode t, LaunchMode l) {
  return (l == LaunchMode::kOnePerGpu ? 0 : 2) + (t == TimingMode::kGraph ? 0 : 1);
}
inline TimingMode timing_of(int m) { return m % 2 == 0 ? TimingMode::kGraph : TimingMode::kEager; }
inline LaunchMode launch_of(int m) { return m < 2 ? LaunchMode::kOnePerGpu : LaunchMode::kPerRank; }
// The mode of the headline figures (table, floor ratio): one launch per GPU in graph mode where
// measured, else per-rank graph.
// The mode of the table's headline: graph replay with one launch per GPU, else (a backend that
// cannot be captured: high_throughput with exact output sizes) eager with one launch per GPU,
// else graph replay per rank.
inline int headline_mode(const BackendResult& br) {
  for (const int m : {mode_index(TimingMode::kGraph, LaunchMode::kOnePerGpu),
                      mode_index(TimingMode::kEager, LaunchMode::kOnePerGpu)}) {
    if (br.mode[m].run) return m;
  }
  return mode_index(TimingMode::kGraph, LaunchMode::kPerRank);
}

struct TokenResult {
  int tokens = 0;
  Volumes volumes;         // combine's bytes as bf16 rows
  Volumes logfmt_volumes;  // the same with combine's bytes as LogFMT rows
  double floor_us[2] = {0, 0};  // dispatch, combine
  std::vector<BackendResult> backends;
};

inline const OpBytes& op_bytes(const Volumes& v, int op) {
  return op == 0 ? v.dispatch : v.combine;
}
inline const Volumes& volumes_of(const TokenResult& tr, CombineFormat f) {
  return f == CombineFormat::kLogFMT ? tr.logfmt_volumes : tr.volumes;
}
// cfg with combine_format = f.
inline EpConfig with_format(EpConfig cfg, CombineFormat f) {
  cfg.combine_format = f;
  return cfg;
}
// The result of a pair the run does not measure: a backend that refuses the format (LogFMT is
// low_latency's only), or nullopt when the pair is measured.
std::optional<BackendResult> format_not_taken(Backend b, CombineFormat f);
// "low_latency" or "low_latency logfmt": a result's name in the table and the progress lines.
std::string result_name(Backend b, CombineFormat f);

// ---- report (bench_report.cpp) -----------------------------------------------------------------

// The table of every token count, op and backend, and what its columns mean.
void print_table(const Plan& p, const std::vector<TokenResult>& results);
// NCCL's collectives (run_nccl_yardstick's records), one line per token count and collective.
void print_yardstick(const nlohmann::json& records);
// The "epx-bench/1" document. `world_json`: the "world" object (kind, ranks, placement);
// `fork_join_us`: the in-process harness floor (none over ipc).
nlohmann::json make_json(const Plan& p, const nlohmann::json& world_json, const GpuInfo& gpu,
                         const CopyBandwidth& bw, std::optional<double> fork_join_us,
                         const std::vector<TokenResult>& results);
// True unless a backend failed or erred (an unavailable backend is reported, not a failure).
bool all_ok(const std::vector<TokenResult>& results);
// "low_latency,naive": the backends of the plan, then " combine bf16,logfmt" when the plan
// measures more than bf16.
std::string backend_list(const Plan& p);

#if EPX_HAVE_CUDA
// The "world" object of an in-process run: ranks, GPUs used, ranks per GPU, SM budget.
nlohmann::json in_process_world_json(const InProcessWorld& world);

// ---- runs --------------------------------------------------------------------------------------

// The check `epx bench` runs before timing a backend: one call on the bench's own inputs.
testing::CheckOptions verify_options(const Plan& p, Backend backend, const EpConfig& cfg,
                                     int tokens);
// Every rank a stream of this process (bench_run.cpp). True when every backend passed.
bool run_in_process(const Plan& p);
// This process is one rank of `epx launch` (--world-kind ipc or nccl, bench_ipc.cpp); rank 0
// reports. True when every backend passed (the same on every rank).
bool run_one_process_per_rank(const Plan& p);
// NCCL's own collectives on the same data as the backends (bench_nccl.cpp): one JSON record per
// collective at token count T.
nlohmann::json run_nccl_yardstick(const Plan& p, NcclWorld& world, const EpConfig& cfg, int T,
                                  const std::vector<ref::Routing>& routings);
#endif

}  // namespace epx::cli::bench
