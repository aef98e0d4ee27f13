#pragma once
// The figures of a measurement (DESIGN §8), no CUDA: the byte volumes of an op from the host
// routing, the statistics of timed samples, and bandwidth.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <vector>

#include "epx/config.hpp"
#include "reference/reference.hpp"

namespace epx::cli {

// Bytes of token payload of one op over all ranks (DESIGN §8), from the host routing:
//  crossing  : rows that go between distinct ranks after per-rank dedup;
//  algorithm : the same rows plus those a rank sends to itself;
//  floor     : fewest bytes the op moves through HBM on one GPU (each input row read once, each
//              output row written once). The low_latency dedup volume, used for every backend.
struct OpBytes {
  int64_t crossing = 0;
  int64_t algorithm = 0;
  int64_t floor = 0;
};
struct Volumes {
  int64_t tokens = 0;          // over all ranks
  int64_t rows_crossing = 0;   // (token, destination rank != source) pairs
  int64_t rows_self = 0;       // (token, its own rank) pairs
  int64_t wire_row_bytes = 0;  // dispatched row: payload + fp8 scales
  // combined partial as it crosses: 2 * hidden (bf16) or logfmt::row_bytes(hidden) (LogFMT)
  int64_t combine_row_bytes = 0;
  OpBytes dispatch;
  OpBytes combine;  // crossing and algorithm in cfg.combine_format; floor in bf16 (what HBM holds)
};
Volumes compute_volumes(const EpConfig& cfg, const std::vector<ref::Routing>& routings);

struct Stats {
  int samples = 0;
  double median_us = 0;
  double p90_us = 0;  // nearest-rank 90th percentile
  double min_us = 0;
  double mean_us = 0;
};
Stats summarize(std::vector<double> us);
// {"samples", "median_us", "p90_us", "min_us", "mean_us"}, and back.
nlohmann::json stats_json(const Stats& s);
Stats stats_from_json(const nlohmann::json& j);

// GB/s (1e9 bytes per second) of `bytes` moved in `us` microseconds, divided by `ranks`.
double gbps(int64_t bytes, double us, int ranks = 1);

}  // namespace epx::cli
