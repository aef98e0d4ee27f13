#pragma once
// End-to-end correctness check of a backend on an in-process world: random inputs from the
// reference generators, dispatch -> identity expert -> combine on the GPU, every output
// compared with the CPU reference (dispatch exactly, combine bit for bit). Shared by `epx check`
// and the GPU test suite.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "epx/config.hpp"
#include "reference/reference.hpp"

namespace epx::check {

struct CheckOptions {
  EpConfig cfg;                     // world_size = ranks of the in-process world
  Backend backend = Backend::kLowLatency;
  LaunchConfigs launch;
  std::vector<int> tokens;          // one count for all ranks, one per rank, or empty = random
  ref::RoutingKind routing = ref::RoutingKind::kUniform;
  uint64_t seed = 1;
  int iters = 2;                    // eager calls, each with fresh inputs
  int graph_replays = 0;            // > 0: capture once per rank, replay this many times
  bool mixed = false;               // with graph_replays: rank 0 eager, the others replay
  int pool = 3;                     // distinct input sets cycled through (each call differs)
  bool ids_int64 = false;
  int max_report = 8;               // mismatches listed
  int corrupt_rank = -1;            // test hook: flip one output byte of this rank before the
                                    // comparison, to prove that the comparison can fail
  std::function<void(const std::string&)> log;  // progress lines, may be empty
};

struct CheckReport {
  bool ok = true;
  int64_t calls = 0;                // dispatch+combine rounds checked
  std::vector<std::string> mismatches;
  size_t buffer_bytes = 0;          // device memory of one rank's object
  std::vector<int> tokens;          // per-rank counts of the first input set
};

CheckReport run_check(const CheckOptions& options);

// Parses "128" or "0,7,128,1024" (one per rank); throws InputError naming `what`.
std::vector<int> parse_token_list(const std::string& text, const char* what);

}  // namespace epx::check
