#pragma once
// `epx check --moe`: the MoE layer (include/epx/moe.hpp) on an in-process world of W ranks
// against the same layer on a one-rank world with every expert local, and, on small shapes,
// against the CPU reference of the layer (src/reference/moe_ref.hpp).

#include <cstdint>
#include <string>

#include "flags.hpp"

namespace epx::cli {

// The layer's own flags (only with --moe).
struct MoeLayerFlags {
  int intermediate = 2048;
  std::string scoring = "sigmoid";  // sigmoid (DeepSeek-V3/R1 grouped) | softmax
  int groups = 8;
  int topk_groups = 4;
  int shared_intermediate = 2048;  // 0 = no shared expert
  double tolerance = 8e-2;         // bound of ||d|| / ||ref|| over all tokens
};

struct MoeCheckFlags {
  ShapeFlags shape;            // the shape flags of `epx check`
  std::string tokens = "128";  // one count, or one per rank
  std::string backend;         // empty = EPX_BACKEND or low_latency
  uint64_t seed = 1;
  MoeLayerFlags layer;
};

// Prints the procedure, the measured norms and a PASS / FAIL line; returns 0 only on PASS.
// Throws UnsupportedError without a GPU (or in a build without CUDA), ConfigError for bad flags.
int run_moe_check(const MoeCheckFlags& flags);

}  // namespace epx::cli
