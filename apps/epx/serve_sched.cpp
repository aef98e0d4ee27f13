#include "serve_sched.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include <fmt/format.h>

#include "epx/config.hpp"
#include "epx/error.hpp"

namespace epx::cli::serve {
namespace {

void check_flag(const char* flag, int64_t value, int64_t lo, int64_t hi, const char* why = "") {
  if (value >= lo && value <= hi) return;
  std::string msg =
      std::string(flag) + " = " + std::to_string(value) + ", expected " +
      (hi == INT32_MAX ? "at least " + std::to_string(lo)
                       : "in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  if (*why) msg += std::string(" (") + why + ")";
  EPX_THROW(ConfigError, msg);
}

}  // namespace

void validate(const Workload& w) {
  check_flag("--world", w.world, 1, 32, "in-process ranks on one GPU");
  check_flag("--num-prompts", w.num_prompts, 1, 1 << 20);
  check_flag("--isl", w.isl, 1, 1 << 20);
  check_flag("--osl", w.osl, 1, 1 << 20);
  check_flag("--concurrency", w.concurrency, 1, INT32_MAX);
  check_flag("--max-batched-tokens", w.max_batched_tokens, 1, 1 << 20, "tokens per rank per step");
  check_flag("--chunk-size", w.chunk_size, 1, kMaxTokensPerRank,
             "the All2All's max_tokens_per_rank");
}

int StepPlan::total_tokens() const {
  int n = 0;
  for (int t : tokens) n += t;
  return n;
}

bool StepPlan::has_prefill() const {
  for (size_t r = 0; r < tokens.size(); ++r)
    if (tokens[r] > decode_tokens[r]) return true;
  return false;
}

Scheduler::Scheduler(const Workload& w) : w_(w) {
  validate(w);
  requests_.resize(size_t(w.num_prompts));
  records_.resize(size_t(w.num_prompts));
  for (int i = 0; i < w.num_prompts; ++i) {
    records_[size_t(i)].id = i;
    records_[size_t(i)].rank = i % w.world;
    records_[size_t(i)].token_times.reserve(size_t(w.osl));
  }
  running_.resize(size_t(w.world));
  plan_.tokens.assign(size_t(w.world), 0);
  plan_.decode_tokens.assign(size_t(w.world), 0);
}

const StepPlan& Scheduler::plan_step() {
  if (planned_) EPX_THROW(StateError, "Scheduler::plan_step: the last step was not finished");
  if (done()) EPX_THROW(StateError, "Scheduler::plan_step: every request has finished");
  // Admission: global id order, up to the concurrency cap.
  while (next_waiting_ < w_.num_prompts && in_flight_ < w_.concurrency) {
    running_[size_t(next_waiting_ % w_.world)].push_back(next_waiting_);
    ++next_waiting_;
    ++in_flight_;
  }
  plan_.num_chunks = 1;
  for (int r = 0; r < w_.world; ++r) {
    int budget = w_.max_batched_tokens;
    int decode = 0;
    const std::vector<int>& ids = running_[size_t(r)];
    for (int id : ids) {  // 1. decodes
      State& s = requests_[size_t(id)];
      s.step_tokens = 0;
      s.step_decode = false;
      if (s.prefilled == w_.isl && budget > 0) {
        s.step_tokens = 1;
        s.step_decode = true;
        --budget;
        ++decode;
      }
    }
    for (int id : ids) {  // 2. prefill chunks
      State& s = requests_[size_t(id)];
      if (s.prefilled < w_.isl && budget > 0) {
        s.step_tokens = std::min(w_.isl - s.prefilled, budget);
        budget -= s.step_tokens;
      }
    }
    const int n = w_.max_batched_tokens - budget;
    plan_.tokens[size_t(r)] = n;
    plan_.decode_tokens[size_t(r)] = decode;
    plan_.num_chunks = std::max(plan_.num_chunks, (n + w_.chunk_size - 1) / w_.chunk_size);
  }
  // Every running request is in prefill or decoding and the budget is >= 1, so a step with
  // requests in flight always has tokens.
  if (plan_.total_tokens() == 0) EPX_THROW(StateError, "Scheduler::plan_step: empty step");
  planned_ = true;
  return plan_;
}

void Scheduler::finish_step(double t) {
  if (!planned_) EPX_THROW(StateError, "Scheduler::finish_step: no step was planned");
  planned_ = false;
  ++steps_;
  for (std::vector<int>& ids : running_) {
    for (int id : ids) {
      State& s = requests_[size_t(id)];
      if (s.step_tokens == 0) continue;
      bool emits = s.step_decode;
      if (!s.step_decode) {
        s.prefilled += s.step_tokens;
        emits = s.prefilled == w_.isl;  // the step that finishes the prefill emits token 1
      }
      s.step_tokens = 0;
      s.step_decode = false;
      if (!emits) continue;
      ++s.generated;
      ++output_tokens_;
      records_[size_t(id)].token_times.push_back(t);
    }
    const auto gone = std::remove_if(
        ids.begin(), ids.end(), [&](int id) { return requests_[size_t(id)].generated == w_.osl; });
    const int left = int(ids.end() - gone);
    ids.erase(gone, ids.end());
    finished_ += left;
    in_flight_ -= left;
  }
}

// ---- statistics --------------------------------------------------------------------------------

double percentile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) EPX_THROW(InputError, "percentile: no values");
  if (!(q >= 0 && q <= 100))
    EPX_THROW(InputError, "percentile: q = " + std::to_string(q) + ", expected in [0, 100]");
  const double p = q / 100.0 * double(sorted.size() - 1);
  const size_t lo = size_t(std::floor(p));
  if (lo + 1 >= sorted.size()) return sorted.back();
  return sorted[lo] + (p - double(lo)) * (sorted[lo + 1] - sorted[lo]);
}

Summary summarize_values(std::vector<double> v) {
  Summary s;
  s.count = int64_t(v.size());
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  double sum = 0;
  for (double x : v) sum += x;
  s.mean = sum / double(v.size());
  s.p25 = percentile(v, 25);
  s.p50 = percentile(v, 50);
  s.p75 = percentile(v, 75);
  s.max = v.back();
  return s;
}

LatencyReport latency_report(const std::vector<RequestRecord>& requests) {
  LatencyReport rep;
  std::vector<double> itl, ttft;
  for (const RequestRecord& r : requests) {
    const std::vector<double>& t = r.token_times;
    if (t.empty()) continue;
    ttft.push_back(t.front() - r.submitted);
    for (size_t i = 1; i < t.size(); ++i) itl.push_back(t[i] - t[i - 1]);
    rep.output_tokens += int64_t(t.size());
    rep.end_s = std::max(rep.end_s, t.back());
  }
  rep.itl_s = summarize_values(std::move(itl));
  rep.ttft_s = summarize_values(std::move(ttft));
  rep.output_tokens_per_s = rep.end_s > 0 ? double(rep.output_tokens) / rep.end_s : 0;
  return rep;
}

// ---- decode graph buckets ----------------------------------------------------------------------

int largest_decode_bucket(const Workload& w) {
  return std::min({w.chunk_size, w.max_batched_tokens, kMaxGraphBatch});
}

std::vector<int> decode_buckets(int largest) {
  std::vector<int> out;
  for (int b = 1; b < largest; b *= 2) out.push_back(b);
  out.push_back(largest);
  return out;
}

int decode_bucket(const std::vector<int>& buckets, int tokens) {
  for (int b : buckets)
    if (b >= std::max(tokens, 1)) return b;
  return 0;
}

std::string graph_piece_name(int i, int num_pieces) {
  EPX_CHECK(num_pieces >= 1 && num_pieces % 2 == 1, InputError, "num_pieces", num_pieces,
            "odd (2 x layers + 1)");
  EPX_CHECK(i >= 0 && i < num_pieces, InputError, "i", i,
            "in [0, num_pieces = " + std::to_string(num_pieces) + ")");
  const int layer = i / 2 + 1;
  if (i % 2 == 1) return fmt::format("L{} experts", layer);
  if (i == 0) return "L1 dispatch";
  if (i == num_pieces - 1) return fmt::format("L{} combine", layer - 1);
  return fmt::format("L{} combine + L{} dispatch", layer - 1, layer);
}

}  // namespace epx::cli::serve
