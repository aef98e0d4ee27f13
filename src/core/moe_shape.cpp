// MoeShape::validate(): the invariants every MoE layer shape must hold, for the layer and its CPU
// reference alike.

#include "epx/moe_shape.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "epx/config.hpp"
#include "epx/error.hpp"

namespace epx {
namespace {

constexpr int kWeightBlock = 128;  // weights carry one f32 scale per 128x128 block

std::string str(int v) { return std::to_string(v); }

}  // namespace

void MoeShape::validate() const {
  // fp8 activations carry one scale per 1x128 block and weights one per 128x128 block; a
  // partial block has no defined scale. kMaxHidden keeps row offsets in 32-bit arithmetic.
  EPX_CHECK(hidden >= kWeightBlock && hidden <= kMaxHidden && hidden % kWeightBlock == 0,
            ConfigError, "hidden", hidden,
            "a multiple of 128 (fp8 blocks) in [128, kMaxHidden = " + str(kMaxHidden) + "]");
  EPX_CHECK(intermediate >= kWeightBlock && intermediate <= kMaxHidden &&
                intermediate % kWeightBlock == 0,
            ConfigError, "intermediate", intermediate,
            "a multiple of 128 (fp8 blocks) in [128, kMaxHidden = " + str(kMaxHidden) + "]");
  // 0 means no shared expert; otherwise the same block rule as the routed experts.
  EPX_CHECK(shared_intermediate >= 0 && shared_intermediate <= kMaxHidden &&
                shared_intermediate % kWeightBlock == 0,
            ConfigError, "shared_intermediate", shared_intermediate,
            "0 (no shared expert) or a multiple of 128 (fp8 blocks) in [128, kMaxHidden = " +
                str(kMaxHidden) + "]");
  EPX_CHECK(num_experts >= 1, ConfigError, "num_experts", num_experts, ">= 1");
  // A token's experts are distinct, and one routing entry sits in each lane of a warp.
  const int max_topk = std::min(kMaxTopk, num_experts);
  EPX_CHECK(topk >= 1 && topk <= max_topk, ConfigError, "topk", topk,
            "in [1, min(kMaxTopk = " + str(kMaxTopk) + ", num_experts = " + str(num_experts) +
                ")] = [1, " + str(max_topk) + "]");
  EPX_CHECK(scoring == MoeScoring::kSigmoidGrouped || scoring == MoeScoring::kSoftmax,
            ConfigError, "scoring", static_cast<int>(scoring),
            "one of sigmoid_grouped (0), softmax (1)");
  if (scoring == MoeScoring::kSoftmax) {
    // Plain top-k: a group setting would be silently ignored, so it must stay at 1.
    EPX_CHECK(num_groups == 1, ConfigError, "num_groups", num_groups,
              "1 for scoring softmax (plain top-k, no group limit)");
    EPX_CHECK(topk_groups == 1, ConfigError, "topk_groups", topk_groups,
              "1 for scoring softmax (plain top-k, no group limit)");
    return;
  }
  // Groups are equal runs of consecutive experts.
  EPX_CHECK(num_groups >= 1 && num_groups <= num_experts, ConfigError, "num_groups", num_groups,
            "in [1, num_experts = " + str(num_experts) + "]");
  EPX_CHECK(num_experts % num_groups == 0, ConfigError, "num_experts", num_experts,
            "a multiple of num_groups = " + str(num_groups));
  // A group's score is the sum of its two best experts; with one group the score is unused.
  EPX_CHECK(num_groups == 1 || experts_per_group() >= 2, ConfigError, "num_groups", num_groups,
            "<= num_experts / 2 = " + str(num_experts / 2) +
                " (a group's score sums its best 2 experts)");
  EPX_CHECK(topk_groups >= 1 && topk_groups <= num_groups, ConfigError, "topk_groups", topk_groups,
            "in [1, num_groups = " + str(num_groups) + "]");
  // The experts are picked from the kept groups only.
  const int kept = topk_groups * experts_per_group();
  EPX_CHECK(topk <= kept, ConfigError, "topk", topk,
            "<= experts in the kept groups = topk_groups * num_experts / num_groups = " +
                str(topk_groups) + " * " + str(experts_per_group()) + " = " + str(kept));
  // The weights of a token sum to routed_scaling.
  EPX_CHECK(std::isfinite(routed_scaling) && routed_scaling > 0.0f, ConfigError, "routed_scaling",
            routed_scaling, "finite and > 0");
}

}  // namespace epx
