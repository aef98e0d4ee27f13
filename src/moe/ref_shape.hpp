#pragma once
// The reference model's view of a MoeShape (same fields and meaning; see moe.hpp), used by the
// layer itself and by the tests that compare it with the reference. Host-only.

#include "epx/moe.hpp"
#include "reference/moe_ref.hpp"

namespace epx::moe {

inline ref::moe::MoeShape to_ref(const MoeShape& s) {
  return ref::moe::MoeShape{.hidden = s.hidden,
                            .intermediate = s.intermediate,
                            .num_experts = s.num_experts,
                            .topk = s.topk,
                            .num_groups = s.num_groups,
                            .topk_groups = s.topk_groups,
                            .routed_scaling = s.routed_scaling,
                            .shared_intermediate = s.shared_intermediate,
                            .scoring = s.scoring == MoeScoring::kSoftmax
                                           ? ref::moe::Scoring::kSoftmax
                                           : ref::moe::Scoring::kSigmoidGrouped};
}

}  // namespace epx::moe
