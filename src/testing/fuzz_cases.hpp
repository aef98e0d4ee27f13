#pragma once
// The cases of `epx check --fuzz`: random shapes, dtypes, layouts, routings, backends and call
// modes, one case at a time from a seed, each a valid CheckOptions (validate_check_options
// accepts it) small enough to check in a second or two on an in-process world on one GPU. No
// CUDA: a CPU test holds every case to the harness's rules.

#include <cstdint>
#include <string>

#include "testing/harness.hpp"

namespace epx::testing {

// How a case calls the ops.
enum class FuzzMode {
  kEager,      // eager calls only
  kGraph,      // eager calls, then a few graph replays
  kMixed,      // graph replays, rank 0 calling eagerly while the others replay
  kOneLaunch,  // the ranks of the GPU in one kernel per op, eager, sometimes also replayed
  kHalves,     // each op as its send and receive halves on one stream, as kOneLaunch
};
inline constexpr int kNumFuzzModes = 5;
const char* to_string(FuzzMode mode);

// Bounds of what is drawn.
inline constexpr int kFuzzMaxHidden = 7168;         // the DeepSeek-R1 hidden size
inline constexpr int kFuzzMaxExperts = 256;
inline constexpr int kFuzzMaxLocalExperts = 32;     // E / W
inline constexpr int kFuzzMaxTokens = 512;          // max tokens per rank
// Elements the CPU reference writes for one input set: W x max_tokens x H x the rows each token
// becomes (its destination ranks, every rank for the all-gather backends, plus its experts in
// the expert-major layout). The reference is the slow part of a case: at this budget it takes
// 0.1 s on average, 1 s at most, on two shared cores (200 cases of seed 1).
inline constexpr int64_t kFuzzReferenceBudget = int64_t(1) << 24;
// Device memory of the world's buffers (all ranks share the GPU), estimated from the layout:
// rows of W x max_tokens per rank and round, plus E/W experts' rows in the expert-major layout.
inline constexpr int64_t kFuzzDeviceBudget = int64_t(4) << 30;

struct FuzzCase {
  int64_t index = 0;
  FuzzMode mode = FuzzMode::kEager;
  CheckOptions options;      // one GPU, the backends' default launch shapes, no log
  std::string description;   // one line: shape, counts, dtype, layouts, routing, backend, mode
  std::string command;       // the `epx check ...` line that runs this case alone
};

// Case `index` of the stream of `seed`. A pure function: the same arguments give the same case
// on every machine and build (its own generator, no std distributions).
FuzzCase make_fuzz_case(uint64_t seed, int64_t index);

// The seed of the harness's inputs of case `index` (`--seed` of its command).
uint64_t fuzz_case_seed(uint64_t seed, int64_t index);

}  // namespace epx::testing
