#pragma once
// MoeShape: the shape of one MoE layer (routed experts, router, shared expert), a plain value
// shared by the layer (epx/moe.hpp) and its CPU reference (src/reference/moe_ref.hpp). No CUDA.

namespace epx {

enum class MoeScoring {
  // DeepSeek-V3/R1: s = sigmoid(logit); choice = s + correction_bias; a group's score is the sum
  // of its two largest choice values; the topk_groups best groups are kept; the topk experts
  // with the largest choice in kept groups are picked; weight_k = s_k / sum_j s_j *
  // routed_scaling (s without the bias), so the weights of a token sum to routed_scaling.
  kSigmoidGrouped,
  // Plain softmax top-k (Mixtral, Qwen-MoE): p = softmax(logits); the topk experts with the
  // largest p are picked; weight_k = p_k / sum_j p_j, so the weights sum to 1. Uses neither
  // the correction bias nor routed_scaling, and no groups.
  kSoftmax,
};

// The defaults are DeepSeek-R1's layer.
struct MoeShape {
  int hidden = 7168;               // H, a multiple of 128 (fp8 blocks)
  int intermediate = 2048;         // I of each routed expert, a multiple of 128
  int num_experts = 256;           // E routed experts
  int topk = 8;                    // K experts per token
  int num_groups = 8;              // G expert groups (experts g*E/G .. (g+1)*E/G - 1)
  int topk_groups = 4;             // groups kept per token (sigmoid_grouped)
  float routed_scaling = 2.5f;     // sigmoid_grouped only: the weights of a token sum to this
  int shared_intermediate = 2048;  // I of the shared expert; 0 = no shared expert
  MoeScoring scoring = MoeScoring::kSigmoidGrouped;

  int experts_per_group() const { return num_experts / num_groups; }
  bool has_shared_expert() const { return shared_intermediate > 0; }

  // Throws ConfigError naming the first impossible field, its value and the bound. The layer
  // adds bounds of its own (MoeLayer's constructor).
  void validate() const;

  // DeepSeek-R1: H 7168, I 2048, 256 experts in 8 groups, best 4 groups, top-8, scaling 2.5,
  // one shared expert of I 2048, sigmoid_grouped.
  static MoeShape deepseek_r1() { return MoeShape{}; }
};

}  // namespace epx
