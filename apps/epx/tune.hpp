#pragma once
// Inside `epx tune`: the plan of a sweep (tune.cpp turns the flags into it), its candidates, the
// sweep itself (tune_sweep.cpp) and its report (tune_report.cpp: the table of candidates and
// why the choice won).

#include <limits>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace epx::cli::tune {

inline constexpr int kMinIters = 10;
inline constexpr int kMaxIters = 100000;
// Block counts tried, up to the SM budget of one rank (which is added when not listed).
inline constexpr int kBlockSeries[] = {4,  8,   12,  16,  24,  32,  48,  64,
                                       96, 128, 192, 256, 384, 512, 768, 1024};

struct Plan {
  Sweep shape;
  Backend backend{};
  int iters = 0;
  int warmup = 0;
  std::string output;
  std::vector<int> blocks;  // empty = derived from the SM budget
  std::vector<int> warps;
  std::vector<int> ring_rows;  // high_throughput; empty = the backend's choice
};

// The sum of `v` (a candidate's medians over the token counts).
inline double total(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s;
}

// One launch shape tried, and how it fared.
struct Candidate {
  std::string phase;  // default | dispatch | combine
  LaunchConfigs launch;
  std::string status = "ok";  // ok | FAILED (check) | skipped (config) | error
  std::string message;
  std::vector<double> median_us[2];  // [dispatch, combine][token count]

  // Summed median over the token counts; +inf unless every step passed.
  double sum(int op) const {
    return status == "ok" ? total(median_us[op]) : std::numeric_limits<double>::infinity();
  }
  const LaunchConfig& swept() const {
    return phase == "combine" ? launch.combine : launch.dispatch;
  }
};

// "16x8" (num_blocks x warps_per_block), "16x8r64" with ring_rows, or "default" for the
// backend's own choice.
std::string shape_name(const LaunchConfig& lc);
// Index of the candidate of `phase` with the lowest summed median of `op`; -1 if none passed.
int best_of(const std::vector<Candidate>& cands, const std::string& phase, int op);
// Why cands[best] won its phase: its sum, the runner-up's and the backend default's.
std::string reason(const std::vector<Candidate>& cands, const std::string& phase, int op, int best,
                   const std::string& tokens);
// The table of every candidate: medians per token count (and their sum), status.
void print_candidates(const std::vector<Candidate>& cands, const std::vector<int>& tokens);
// "1.23", "4.56": medians to print.
std::vector<std::string> format_us(const std::vector<double>& v);

#if EPX_HAVE_CUDA
// The sweep on an in-process world (tune_sweep.cpp); writes p.output and returns true when a
// dispatch and a combine shape passed.
bool run(const Plan& p);
#endif

}  // namespace epx::cli::tune
