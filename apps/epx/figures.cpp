#include "figures.hpp"

#include <algorithm>
#include <bit>
#include <cmath>

#include "core/logfmt.hpp"

namespace epx::cli {

Volumes compute_volumes(const EpConfig& cfg, const std::vector<ref::Routing>& routings) {
  Volumes v;
  const int64_t H = cfg.hidden, G = cfg.num_scale_groups(), K = cfg.topk;
  v.wire_row_bytes = cfg.wire_row_bytes() + (cfg.wire_fp8() ? G * int64_t(sizeof(float)) : 0);
  const int64_t input_row = cfg.input_fp8() ? H + G * int64_t(sizeof(float)) : 2 * H;
  for (int s = 0; s < int(routings.size()); ++s) {
    const ref::Routing& r = routings[s];
    v.tokens += r.num_tokens;
    for (int n = 0; n < r.num_tokens; ++n) {
      const int32_t* ids = r.ids.data() + size_t(n) * K;
      if (!ref::token_valid(ids, int(K), cfg.num_experts)) continue;  // sent nowhere
      uint64_t mask = 0;
      for (int k = 0; k < K; ++k)
        if (ids[k] >= 0) mask |= uint64_t(1) << cfg.expert_rank(ids[k]);
      const int64_t self = (mask >> s) & 1u;
      v.rows_self += self;
      v.rows_crossing += std::popcount(mask) - self;
    }
  }
  const int64_t rows = v.rows_crossing + v.rows_self;
  v.dispatch.crossing = v.rows_crossing * v.wire_row_bytes;
  v.dispatch.algorithm = rows * v.wire_row_bytes;
  v.dispatch.floor = v.tokens * input_row + rows * v.wire_row_bytes;
  // The partials are bf16 in HBM whatever crosses; only the bytes between ranks shrink.
  v.combine_row_bytes =
      cfg.combine_format == CombineFormat::kLogFMT ? logfmt::row_bytes(cfg.hidden) : 2 * H;
  v.combine.crossing = v.rows_crossing * v.combine_row_bytes;
  v.combine.algorithm = rows * v.combine_row_bytes;
  v.combine.floor = rows * 2 * H + v.tokens * 2 * H;
  return v;
}

Stats summarize(std::vector<double> us) {
  Stats s;
  s.samples = int(us.size());
  if (us.empty()) return s;
  std::sort(us.begin(), us.end());
  const size_t n = us.size();
  s.median_us = n % 2 ? us[n / 2] : 0.5 * (us[n / 2 - 1] + us[n / 2]);
  s.p90_us = us[size_t(std::ceil(0.9 * double(n))) - 1];
  s.min_us = us.front();
  double sum = 0;
  for (double x : us) sum += x;
  s.mean_us = sum / double(n);
  return s;
}

double gbps(int64_t bytes, double us, int ranks) {
  if (us <= 0 || ranks <= 0) return 0;
  return double(bytes) / (us * 1e3) / ranks;  // bytes / (us * 1e-6) / 1e9
}

nlohmann::json stats_json(const Stats& s) {
  return {{"samples", s.samples},
          {"median_us", s.median_us},
          {"p90_us", s.p90_us},
          {"min_us", s.min_us},
          {"mean_us", s.mean_us}};
}

Stats stats_from_json(const nlohmann::json& j) {
  Stats s;
  s.samples = j.at("samples").get<int>();
  s.median_us = j.at("median_us").get<double>();
  s.p90_us = j.at("p90_us").get<double>();
  s.min_us = j.at("min_us").get<double>();
  s.mean_us = j.at("mean_us").get<double>();
  return s;
}

}  // namespace epx::cli
