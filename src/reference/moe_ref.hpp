#pragma once
// CPU reference of one MoE layer (the consumer in src/moe, include/epx/moe.hpp): router, fp8
// SwiGLU experts with block scales, shared expert. No CUDA. GPU tests compare the layer, and
// each of its stages, against these functions.
//
// Numerics (every step in f32 unless stated; "bf16(v)" and "fp8(v)" are the round-to-nearest-
// even conversions of reference.hpp):
//  * Router:    logits[n][e] = sum over h ascending of x[n][h] * gate[e][h], f32 from +0.0f
//               (bf16 x bf16 products are exact in f32, so only the additions round).
//  * Experts:   a token row x (bf16) is quantised with quantize_fp8 (1x128 blocks);
//               h1 = fp8_gemm_nt(x_q, W1), h3 = fp8_gemm_nt(x_q, W3)         [I]
//               act = silu(h1) * h3 with silu(h) = h / (1 + exp(-h))          [I] f32
//               act_bf16 = bf16(act)           <- the only bf16 rounding inside an expert
//               act_q = quantize_fp8(act_bf16) (1x128 blocks over I)
//               out = fp8_gemm_nt(act_q, W2)                                  [H] f32
//  * Layer:     y[n] = fmaf(w_K-1, out_K-1, ... fmaf(w_0, out_0, +0.0f)) + shared(x[n]),
//               k ascending, entries with id -1 skipped, one f32 add of the shared expert
//               (absent: +0). y is f32: the reference rounds nothing to bf16 after act, so a
//               GPU layer that writes bf16 expert outputs, partials or y is compared with a
//               tolerance that covers those roundings.
//
// Weights are generated from a seed by a counter-based generator that uses only 64-bit integer
// arithmetic and one f32 multiply per element, so a device kernel (or another rank holding a
// different subset of experts) can reproduce every byte; see "Generation" below.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "epx/moe_shape.hpp"
#include "reference/reference.hpp"

namespace epx::ref::moe {

inline constexpr int kWeightBlock = 128;  // weights carry one f32 scale per 128x128 block

// The layer's shape (include/epx/moe_shape.hpp: fields, scoring rules, validate()) under the
// names the reference has always used: one type, two spellings.
using MoeShape = epx::MoeShape;
using Scoring = epx::MoeScoring;
const char* to_string(Scoring s);

// ---- weights -------------------------------------------------------------------------------

// fp8 e4m3fn matrix with one f32 scale per 128x128 block (rows and cols multiples of 128).
// Block (i, j) covers rows [128 i, 128 i + 128) and cols [128 j, 128 j + 128); its value is
// fp8_to_float(q[r][c]) * scales[(r / 128) * (cols / 128) + c / 128].
struct Fp8BlockMatrix {
  int rows = 0;
  int cols = 0;
  std::vector<uint8_t> q;     // [rows][cols] e4m3fn, row-major
  std::vector<float> scales;  // [rows/128][cols/128] f32, row-major

  float scale_at(int r, int c) const;
  float value(int r, int c) const;        // fp8_to_float(q) * scale, one f32 multiply
  std::vector<float> dequantize() const;  // [rows][cols]
};

// Block quantisation, the rule quantize_fp8 applies to 1x128 activation blocks: amax = max |m|
// over the 128x128 block; a = amax if amax > 0 else 1; scale = a / 448; q = fp8(m * (448 / a)).
// m: [rows][cols] f32, rows and cols multiples of 128 (InputError otherwise).
Fp8BlockMatrix quantize_fp8_block128(std::span<const float> m, int rows, int cols);

struct ExpertWeights {
  Fp8BlockMatrix w1;  // gate proj [I][H]
  Fp8BlockMatrix w3;  // up proj   [I][H]
  Fp8BlockMatrix w2;  // down proj [H][I]

  int hidden() const { return w1.cols; }
  int intermediate() const { return w1.rows; }
};

// The f32 values the fp8 weights of one expert are quantised from (tests use them for an
// unquantised reference).
struct MasterExpertWeights {
  int hidden = 0;
  int intermediate = 0;
  std::vector<float> w1;  // [I][H]
  std::vector<float> w3;  // [I][H]
  std::vector<float> w2;  // [H][I]
};

struct MoeWeights {
  std::vector<uint16_t> gate;           // [E][H] bf16
  std::vector<float> correction_bias;   // [E] f32 (sigmoid_grouped; generated for softmax too)
  std::vector<ExpertWeights> experts;   // [E], expert e's intermediate = shape.intermediate
  std::optional<ExpertWeights> shared;  // present iff shape.shared_intermediate > 0
};

// ---- generation ------------------------------------------------------------------------------
// Every tensor has a key: generator_key(seed, tensor, expert) (expert = kSharedExpert for the
// shared expert and for the tensors that belong to no expert). Element i of a tensor (row-major
// index) is
//     c_i = centred_uniform_sum(key, i)   (an integer in [-262140, 262140])
//     v_i = float(c_i) * generator_step(stddev)     (one f32 multiply; float(c_i) is exact)
// where centred_uniform_sum adds the eight 16-bit lanes of h(2i) and h(2i + 1), with
// h(c) = splitmix64_mix(key + (c + 1) * 0x9E3779B97F4A7C15), and subtracts 8 * 65535 / 2.
// The sum of 8 uniforms is close to normal (Irwin-Hall: excess kurtosis -0.15, tails cut at
// 4.9 standard deviations) and, unlike Box-Muller, needs no libm call, so every machine and the
// device get the same bits.
//
// Magnitudes: gate std 1/sqrt(H), rounded to bf16 (logits of std ~1 for inputs of std 1);
// correction bias std 0.05 (comparable to the gaps between neighbouring sigmoid scores: it
// changes 13 % of the picks at E 16 top-4 and ~40 % at E 256 top-8, without dominating s); W1, W3
// std 1/sqrt(H) and W2 std 1/sqrt(I) (fan-in), then quantised with quantize_fp8_block128; inputs
// std 1 with one element in 512 an outlier of magnitude 16..23 (element i is one when the low 9
// bits of o = splitmix64_mix(kInputOutlier key + (i + 1) * 0x9E3779B97F4A7C15) are 0; its
// magnitude is 16 + ((o >> 9) & 7), its sign that of the normal value it replaces).
enum class GenTensor : uint32_t {
  kGate = 1,
  kCorrectionBias = 2,
  kW1 = 3,
  kW3 = 4,
  kW2 = 5,
  kInput = 6,
  kInputOutlier = 7,
};
inline constexpr int kSharedExpert = -1;
inline constexpr double kCorrectionBiasStd = 0.05;

uint64_t splitmix64_mix(uint64_t z);
// splitmix64_mix(seed ^ splitmix64_mix((uint64_t(tensor) << 32) | uint32_t(expert + 1))).
uint64_t generator_key(uint64_t seed, GenTensor tensor, int expert);
int32_t centred_uniform_sum(uint64_t key, uint64_t index);
// float(stddev / sqrt(8 * (65536^2 - 1) / 12)), computed in double and rounded once.
float generator_step(double stddev);

// Expert `expert` in [0, E) or kSharedExpert (InputError otherwise, or when the shape has no
// shared expert). Depends only on (shape's H and that expert's I, seed, expert), so ranks that
// generate only their local experts get the bytes of a one-rank layer.
MasterExpertWeights make_master_expert_weights(const MoeShape& shape, uint64_t seed, int expert);
ExpertWeights make_expert_weights(const MoeShape& shape, uint64_t seed, int expert);
std::vector<uint16_t> make_gate_weight(const MoeShape& shape, uint64_t seed);   // [E][H] bf16
std::vector<float> make_correction_bias(const MoeShape& shape, uint64_t seed);  // [E]
MoeWeights make_moe_weights(const MoeShape& shape, uint64_t seed);  // validates the shape
// Layer input x[N][H] bf16 (num_tokens >= 0, InputError otherwise).
std::vector<uint16_t> make_moe_input(const MoeShape& shape, int num_tokens, uint64_t seed);

// ---- router ----------------------------------------------------------------------------------

struct RouterOutput {
  int num_tokens = 0;
  int topk = 0;
  std::vector<int32_t> ids;    // [N][K] distinct experts, best first (see route_from_logits)
  std::vector<float> weights;  // [N][K] f32, aligned with ids
};

// logits[N][E] f32 (order of operations at the top of this file). gate [E][H], x [N][H] bf16.
std::vector<float> router_logits(const MoeShape& shape, std::span<const uint16_t> gate,
                                 std::span<const uint16_t> x, int num_tokens);

// Routes N tokens from their logits [N][E]. correction_bias: [E] for sigmoid_grouped, ignored
// (may be empty) for softmax. In f32, per token:
//  sigmoid_grouped: s_e = 1 / (1 + exp(-logit_e)); choice_e = s_e + bias_e;
//    group score = largest + second largest choice in the group (one f32 add);
//    the topk_groups groups with the largest score are kept (ties: lower group id);
//    ids = the topk experts of the kept groups by choice, largest first (ties: lower id);
//    S = sum over k ascending of s_{id_k}; weight_k = s_{id_k} / S * routed_scaling
//    (0 if S == 0, which needs every chosen logit below -88).
//  softmax: m = max logit; e_j = exp(logit_j - m); Z = sum over j ascending; p_j = e_j / Z;
//    ids = the topk experts by p, largest first (ties: lower id);
//    P = sum over k ascending of p_{id_k}; weight_k = p_{id_k} / P.
// Logits are expected finite; a NaN gives a deterministic but meaningless choice.
RouterOutput route_from_logits(const MoeShape& shape, std::span<const float> logits,
                               std::span<const float> correction_bias, int num_tokens);

// router_logits + route_from_logits with the layer's gate and bias.
RouterOutput route(const MoeShape& shape, const MoeWeights& weights, std::span<const uint16_t> x,
                   int num_tokens);

// ---- experts ---------------------------------------------------------------------------------

// Block-scaled fp8 GEMM, out[M][N] = dequant(a) . dequant(w)^T, computed the way a block-scaled
// kernel does: for each 128-wide K block b ascending, p = sum over i ascending of
// fp8_to_float(a_q) * fp8_to_float(w_q) (exact products, f32 sum from +0.0f), then
// acc = fmaf(p, a_scale[m][b] * w_scale[n/128][b], acc) from +0.0f. It equals the product of
// the dequantised matrices up to f32 rounding. a_q [M][K], a_scales [M][K/128] (row-major, as
// quantize_fp8 writes them), w [N][K]; InputError when the sizes do not fit together.
std::vector<float> fp8_gemm_nt(std::span<const uint8_t> a_q, std::span<const float> a_scales, int m,
                               const Fp8BlockMatrix& w);

// Every intermediate of one expert on N token rows, for stage-by-stage GPU comparisons.
struct ExpertStages {
  int num_tokens = 0;
  int hidden = 0;
  int intermediate = 0;
  std::vector<uint8_t> x_q;        // [N][H] fp8 of the bf16 input
  std::vector<float> x_scales;     // [N][H/128]
  std::vector<float> h1;           // [N][I] gate proj
  std::vector<float> h3;           // [N][I] up proj
  std::vector<float> act;          // [N][I] silu(h1) * h3, f32
  std::vector<uint16_t> act_bf16;  // [N][I] bf16(act)
  std::vector<uint8_t> act_q;      // [N][I] fp8 of act_bf16
  std::vector<float> act_scales;   // [N][I/128]
  std::vector<float> out;          // [N][H] down proj, f32
};

// x: [N][H] bf16 with H = w.hidden() (InputError on a size mismatch).
ExpertStages expert_forward_stages(const ExpertWeights& w, std::span<const uint16_t> x,
                                   int num_tokens);
std::vector<float> expert_forward(const ExpertWeights& w, std::span<const uint16_t> x,
                                  int num_tokens);  // = expert_forward_stages(...).out

// ---- the layer -------------------------------------------------------------------------------

// y[N][H] f32 for a given routing (ids in [-1, E), -1 skipped; e.g. the GPU router's output, so
// near-ties the two routers break differently do not hide expert errors).
std::vector<float> moe_forward_routed(const MoeShape& shape, const MoeWeights& weights,
                                      std::span<const uint16_t> x, int num_tokens,
                                      const RouterOutput& routing);

// y = sum_k w_k * expert_{id_k}(x) + shared(x) with the reference router.
std::vector<float> moe_forward_reference(const MoeShape& shape, const MoeWeights& weights,
                                         std::span<const uint16_t> x, int num_tokens);

}  // namespace epx::ref::moe
