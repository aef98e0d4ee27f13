// `epx tune`'s report: the table of candidates and why the chosen shapes won.
#include <fmt/format.h>

#include "tune.hpp"

namespace epx::cli::tune {

std::string shape_name(const LaunchConfig& lc) {
  if (lc.num_blocks == 0 && lc.warps_per_block == 0 && lc.ring_rows == 0) return "default";
  std::string s = fmt::format("{}x{}", lc.num_blocks, lc.warps_per_block);
  if (lc.ring_rows != 0) s += fmt::format("r{}", lc.ring_rows);
  return s;
}

std::vector<std::string> format_us(const std::vector<double>& v) {
  std::vector<std::string> out;
  for (double x : v) out.push_back(fmt::format("{:.2f}", x));
  return out;
}

int best_of(const std::vector<Candidate>& cands, const std::string& phase, int op) {
  int best = -1;
  for (int i = 0; i < int(cands.size()); ++i) {
    if (cands[i].phase != phase || cands[i].status != "ok") continue;
    if (best < 0 || cands[i].sum(op) < cands[best].sum(op)) best = i;
  }
  return best;
}

std::string reason(const std::vector<Candidate>& cands, const std::string& phase, int op, int best,
                   const std::string& tokens) {
  const Candidate& b = cands[best];
  std::string r = fmt::format("lowest {} median summed over tokens/rank {}: {:.2f} us", phase,
                              tokens, b.sum(op));
  int runner = -1;
  for (int i = 0; i < int(cands.size()); ++i) {
    if (i == best || cands[i].phase != phase || cands[i].status != "ok") continue;
    if (runner < 0 || cands[i].sum(op) < cands[runner].sum(op)) runner = i;
  }
  if (runner >= 0) {
    r += fmt::format("; runner-up {} at {:.2f} us ({:+.1f}%)", shape_name(cands[runner].swept()),
                     cands[runner].sum(op), 100.0 * (cands[runner].sum(op) / b.sum(op) - 1.0));
  }
  for (const Candidate& c : cands) {
    if (c.phase != "default") continue;
    if (c.status == "ok") {
      r += fmt::format("; backend default at {:.2f} us ({:+.1f}%)", c.sum(op),
                       100.0 * (c.sum(op) / b.sum(op) - 1.0));
    } else {
      r += fmt::format("; backend default {}", c.status);
    }
  }
  return r;
}

void print_candidates(const std::vector<Candidate>& cands, const std::vector<int>& tokens) {
  const std::string tok = fmt::format("{}", fmt::join(tokens, "/"));
  fmt::print("\n{:<9} {:<9} {:<9} {:>28} {:>28}  {}\n", "phase", "dispatch", "combine",
             "dispatch us (" + tok + ")", "combine us (" + tok + ")", "status");
  for (const Candidate& c : cands) {
    auto col = [&](int op) {
      const std::vector<double>& m = c.median_us[op];
      if (m.empty()) return std::string("-");
      if (tokens.size() == 1) return fmt::format("{:.2f}", m[0]);
      return fmt::format("{} = {:.2f}", fmt::join(format_us(m), "/"), total(m));
    };
    fmt::print("{:<9} {:<9} {:<9} {:>28} {:>28}  {}\n", c.phase, shape_name(c.launch.dispatch),
               shape_name(c.launch.combine), col(0), col(1),
               c.status == "ok" ? "ok" : c.status + ": " + one_line(c.message, 140));
  }
}

}  // namespace epx::cli::tune
