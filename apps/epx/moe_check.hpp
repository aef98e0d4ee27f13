#pragma once
// `epx check --moe`: the MoE layer (include/epx/moe.hpp) on an in-process world of W ranks
// against the same layer on a one-rank world with every expert local, and, on small shapes,
// against the CPU reference of the layer (src/reference/moe_ref.hpp).

#include <cstdint>
#include <string>

namespace epx::cli {

struct MoeCheckFlags {
  // The shape flags of `epx check`.
  int world = 8;
  int hidden = 7168;
  int experts = 256;
  int topk = 8;
  int max_tokens = 0;          // 0 = the largest of --tokens (at least 1)
  std::string tokens = "128";  // one count, or one per rank
  std::string dtype = "bf16-to-fp8";
  std::string layout = "token";
  std::string scale_layout = "row";
  int timeout_ms = 0;   // 0 = EPX_TIMEOUT_MS or the default
  std::string backend;  // empty = EPX_BACKEND or low_latency
  uint64_t seed = 1;
  // The layer's own.
  int intermediate = 2048;
  std::string scoring = "sigmoid";  // sigmoid (DeepSeek-V3/R1 grouped) | softmax
  int groups = 8;
  int topk_groups = 4;
  int shared_intermediate = 2048;  // 0 = no shared expert
  double tolerance = 8e-2;         // bound of ||d|| / ||ref|| over all tokens
};

// Prints the procedure, the measured norms and a PASS / FAIL line; returns 0 only on PASS.
// Throws UnsupportedError without a GPU (or in a build without CUDA), ConfigError for bad flags.
int run_moe_check(const MoeCheckFlags& flags);

}  // namespace epx::cli
