// `epx check --moe`, steps 5 and 6: the comparisons of the forwards' outputs (no CUDA).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "moe_check_steps.hpp"
#include "reference/reference.hpp"
#include "report.hpp"

namespace epx::cli::moe {
namespace {

// ||a - b|| / ||b|| over all tokens, and the worst token's own ratio.
struct NormReport {
  double rel = 0;  // ||d|| / ||ref|| over all tokens
  double d_norm = 0;
  double ref_norm = 0;
  double worst = 0;         // max over tokens of ||d_n|| / ||ref_n||
  std::string worst_where;  // "rank r token n"
  int64_t tokens = 0;
};

class NormAccumulator {
 public:
  // got, want: one token of H values.
  void add(const float* got, const float* want, int hidden, const std::string& where) {
    double dd = 0, rr = 0;
    for (int h = 0; h < hidden; ++h) {
      const double d = double(got[h]) - double(want[h]);
      dd += d * d;
      rr += double(want[h]) * double(want[h]);
    }
    d2_ += dd;
    r2_ += rr;
    ++tokens_;
    // A token whose reference is exactly 0 (no shared expert, all weights 0) counts its
    // absolute error.
    const double ratio = rr > 0 ? std::sqrt(dd / rr) : std::sqrt(dd);
    // The first NaN stays the worst.
    if (!worst_nan_ && (worst_where_.empty() || std::isnan(ratio) || ratio > worst_)) {
      worst_ = ratio;
      worst_where_ = where;
      worst_nan_ = std::isnan(ratio);
    }
  }
  NormReport report() const {
    NormReport r;
    r.d_norm = std::sqrt(d2_);
    r.ref_norm = std::sqrt(r2_);
    r.rel = r2_ > 0 ? r.d_norm / r.ref_norm : r.d_norm;
    r.worst = worst_;
    r.worst_where = worst_where_;
    r.tokens = tokens_;
    return r;
  }

 private:
  double d2_ = 0, r2_ = 0, worst_ = 0;
  bool worst_nan_ = false;
  std::string worst_where_;
  int64_t tokens_ = 0;
};

bool report_line(const char* what, const NormReport& r, double tolerance) {
  // NaN fails.
  const bool ok = r.rel < tolerance;
  fmt::print(
      "  {}: ||d||/||ref|| = {:.3e} (||d|| {:.4e}, ||ref|| {:.4e}, {} tokens), worst "
      "token {} at {:.3e}: {}\n",
      what, r.rel, r.d_norm, r.ref_norm, r.tokens, r.worst_where, r.worst,
      ok ? "ok" : "OVER TOLERANCE");
  return ok;
}

std::vector<float> to_float(const uint16_t* bf16, size_t count) {
  std::vector<float> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = ref::bf16_to_float(bf16[i]);
  return v;
}

}  // namespace

void compare_with_one_rank(const Plan& p, const std::vector<HostRun>& ranks, const HostRun& one,
                           Verdict& v) {
  const int h = p.shape.hidden;
  const int k = p.shape.topk;
  NormAccumulator acc;
  int64_t routing_diff = 0;
  int64_t off = 0;
  for (int r = 0; r < int(ranks.size()); ++r) {
    const HostRun& run = ranks[size_t(r)];
    for (int n = 0; n < run.tokens; ++n) {
      const auto got = to_float(run.y.data() + size_t(n) * h, size_t(h));
      const auto want = to_float(one.y.data() + size_t(off + n) * h, size_t(h));
      acc.add(got.data(), want.data(), h, fmt::format("rank {} token {}", r, n));
      if (!std::equal(run.ids.begin() + int64_t(n) * k, run.ids.begin() + int64_t(n + 1) * k,
                      one.ids.begin() + (off + n) * k))
        ++routing_diff;
    }
    off += run.tokens;
  }
  fmt::print("  routing: {} of {} token(s) routed differently by the two runs\n", routing_diff,
             p.total);
  const NormReport rep = acc.report();
  v.ok &= report_line(fmt::format("world {} vs one rank", ranks.size()).c_str(), rep, p.tolerance);
  v.summary += fmt::format("vs one rank {:.3e} (worst token {:.3e})", rep.rel, rep.worst);
}

void compare_with_reference(const Plan& p, const std::vector<HostRun>& ranks, const HostRun& one,
                            Verdict& v) {
  const int h = p.shape.hidden;
  const int k = p.shape.topk;
  const int num_ranks = int(ranks.size());
  const auto t0 = std::chrono::steady_clock::now();
  const ref::moe::MoeWeights weights = ref::moe::make_moe_weights(p.shape, p.seed);
  std::vector<std::vector<float>> ref_w(static_cast<size_t>(num_ranks)),
      ref_1(static_cast<size_t>(num_ranks));
  parallel_for(num_ranks, [&](int r) {
    const HostRun& run = ranks[size_t(r)];
    int64_t start = 0;
    for (int q = 0; q < r; ++q) start += ranks[size_t(q)].tokens;
    ref::moe::RouterOutput gw{run.tokens, k, run.ids, run.weights};
    ref_w[size_t(r)] = ref::moe::moe_forward_routed(p.shape, weights, run.x, run.tokens, gw);
    ref::moe::RouterOutput g1{run.tokens, k,
                              std::vector<int32_t>(one.ids.begin() + start * k,
                                                   one.ids.begin() + (start + run.tokens) * k),
                              std::vector<float>(one.weights.begin() + start * k,
                                                 one.weights.begin() + (start + run.tokens) * k)};
    ref_1[size_t(r)] = ref::moe::moe_forward_routed(p.shape, weights, run.x, run.tokens, g1);
  });
  NormAccumulator acc_w, acc_1;
  int64_t off = 0;
  for (int r = 0; r < num_ranks; ++r) {
    const HostRun& run = ranks[size_t(r)];
    for (int n = 0; n < run.tokens; ++n) {
      const auto got_w = to_float(run.y.data() + size_t(n) * h, size_t(h));
      const auto got_1 = to_float(one.y.data() + size_t(off + n) * h, size_t(h));
      const std::string where = fmt::format("rank {} token {}", r, n);
      acc_w.add(got_w.data(), ref_w[size_t(r)].data() + size_t(n) * h, h, where);
      acc_1.add(got_1.data(), ref_1[size_t(r)].data() + size_t(n) * h, h, where);
    }
    off += run.tokens;
  }
  fmt::print("  CPU reference (moe_forward_routed with the GPU routing) in {:.1f} s\n",
             seconds_since(t0));
  const NormReport rep_w = acc_w.report();
  const NormReport rep_1 = acc_1.report();
  v.ok &=
      report_line(fmt::format("world {} vs CPU reference", num_ranks).c_str(), rep_w, p.tolerance);
  v.ok &= report_line("one rank vs CPU reference", rep_1, p.tolerance);
  v.summary += fmt::format(
      ", vs CPU reference {:.3e} (worst token {:.3e}), one rank vs CPU "
      "reference {:.3e}",
      rep_w.rel, rep_w.worst, rep_1.rel);
}

}  // namespace epx::cli::moe
