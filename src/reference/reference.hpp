#pragma once
// CPU oracle of the dispatch/combine contract (DESIGN §4). No CUDA. Every GPU test and
// `epx check` compares against these functions.
//
// Conventions shared with the kernels (they must agree bit for bit):
//  * bf16 is stored as its 16 raw bits; float -> bf16 rounds to nearest even (NaN stays NaN).
//  * fp8 is e4m3fn stored as raw bytes; float -> fp8 rounds to nearest even and saturates to
//    +-448 (NaN -> 0x7F), the behaviour of cvt.rn.satfinite.e4m3x2.f32.
//  * quantisation of one 1x128 block: amax = max |x| (x as float); scale = a / 448 and
//    q = fp8(x * (448 / a)) with a = amax if amax > 0 else 1; all in f32 with IEEE rounding.
//  * token-major rows of a receiving rank are ordered by (source rank, source index).
//  * expert-major rows of each local expert are ordered the same way.
//  * a token is invalid when any id is outside [-1, E) or an expert id repeats within the
//    token; an invalid token is sent nowhere (the device also reports an input error).
//  * token-major combine: y[n] = bf16( sum over ranks r ascending that received token n of
//    float(partial_r[row]) ), f32 accumulation starting from +0.0f.
//  * expert-major combine: p_r = sum over k ascending with e_k on rank r of
//    fmaf(w_k, float(out[e_k][slot]), p_r) from +0.0f; y[n] = bf16(sum over r ascending of p_r).
//  * LogFMT combine (CombineFormat::kLogFMT, src/core/logfmt.hpp): each partial crosses encoded
//    and the token's rank adds decode(encode(partial)) instead of the partial, in the same order;
//    token-major partials are bf16 already, an expert-major p_r is rounded to bf16 first.

#include <array>
#include <cstdint>
#include <future>
#include <vector>

#include "epx/config.hpp"

namespace epx::ref {

// Runs f(i) for every i in [0, n), each on a thread of its own (n is a world size: the
// reference's passes per rank are independent). Rethrows the first exception of the lowest i.
template <typename F>
void for_each_index(int n, const F& f) {
  std::vector<std::future<void>> jobs;
  for (int i = 0; i < n; ++i) jobs.push_back(std::async(std::launch::async, [&f, i] { f(i); }));
  for (auto& j : jobs) j.get();
}

// ---- numerics ------------------------------------------------------------------------------
uint16_t bf16_from_float(float f);
float bf16_to_float(uint16_t b);
uint8_t fp8_from_float(float f);
float fp8_to_float(uint8_t q);
// fp8_to_float of all 256 codes, computed once.
const std::array<float, 256>& fp8_table();
inline constexpr float kFp8Max = 448.0f;
inline constexpr float kFp8Pow2AmaxFloor = 1e-4f;  // round_scale: a smaller amax counts as this

// bf16 [rows][hidden] -> fp8 [rows][hidden] + scales [rows][hidden/128] (row-major). Per 1x128
// block: scale = a / 448 with a = amax, or 1 for amax 0; with `round_scale` (DeepEP's rule)
// scale = 2^e, e = ceil(log2(max(amax, 1e-4) * f32(1/448))) read off the product's f32 bits.
// q = e4m3(x * f32(1 / scale)) either way.
void quantize_fp8(const uint16_t* x, int rows, int hidden, uint8_t* q, float* scales,
                  bool round_scale = false);
// The power-of-two scale of a block whose largest magnitude is `amax` (round_scale).
float pow2_fp8_scale(float amax);
// fp8 + scales -> float [rows][hidden].
void dequantize_fp8(const uint8_t* q, const float* scales, int rows, int hidden, float* out);

// ---- routing generators (deterministic by seed) ------------------------------------------
enum class RoutingKind {
  kUniform,    // top-k distinct experts, uniformly at random
  kSkewed,     // distinct experts, most picks from a few hot experts
  kOneExpert,  // every token's first id is expert `hot_expert`, the rest -1
  kMasked,     // uniform, then about a quarter of the entries set to -1
};

struct Routing {
  int num_tokens = 0;
  int topk = 0;
  std::vector<int32_t> ids;     // [num_tokens][topk], -1 = none
  std::vector<float> weights;   // [num_tokens][topk], positive, summing to 1 over valid ids
};

Routing make_routing(RoutingKind kind, int num_tokens, int num_experts, int topk, uint64_t seed,
                     int hot_expert = 0);

// Per-rank token counts in [0, max_tokens]: `spec` < 0 draws counts (0 and max included with
// good probability) from the seed, otherwise every rank gets `spec`.
std::vector<int> make_token_counts(int world_size, int max_tokens, int spec, uint64_t seed);

// ---- one rank's dispatch input -----------------------------------------------------------
struct RankInput {
  int num_tokens = 0;
  std::vector<uint16_t> x_bf16;  // [N][H], for kBF16 and kBF16ToFP8
  std::vector<uint8_t> x_fp8;    // [N][H], for kFP8
  std::vector<float> scales;     // [N][H/128], for kFP8
  Routing routing;
  // Routing by rank (DispatchInput::rank_mask, token-major only): when set, token n goes to the
  // ranks r with rank_mask[n * W + r] != 0, its rows carry ids -1 and weights 0 (routing's ids
  // are not read), and expert_counts[E] is added into each receiver's expert_counts.
  std::vector<uint8_t> rank_mask;      // [N][W] or empty
  std::vector<int32_t> expert_counts;  // [E] with rank_mask
};

// Random activations with realistic magnitudes (normal, std 1, a few outliers), by seed.
RankInput make_rank_input(const EpConfig& cfg, int num_tokens, const Routing& routing,
                          uint64_t seed);

// True when every id is in [-1, E) and no expert repeats within the token.
bool token_valid(const int32_t* ids, int topk, int num_experts);

// ---- dispatch ------------------------------------------------------------------------------
// What one rank receives in the token-major layout.
struct TokenMajorRecv {
  int count = 0;                      // M
  std::vector<uint8_t> x;             // [M][wire_row_bytes] (bf16 bits or fp8 bytes)
  std::vector<float> scales;          // fp8 only: [M][H/128] row-major, regardless of layout
  std::vector<int32_t> src_rank;      // [M]
  std::vector<int32_t> src_idx;       // [M]
  std::vector<int32_t> topk_ids;      // [M][K] the token's full row (invalid tokens never sent)
  std::vector<float> topk_weights;    // [M][K]
  std::vector<int32_t> expert_counts;  // [E/W] rows that use each local expert
};

// What one rank receives in the expert-major layout (only the first count[e] rows per expert).
struct ExpertMajorRecv {
  std::vector<int32_t> count;                  // [E/W]
  std::vector<std::vector<uint8_t>> x;         // [E/W] -> [count][wire_row_bytes]
  std::vector<std::vector<float>> scales;      // [E/W] -> [count][H/128] (fp8 only)
  std::vector<std::vector<int32_t>> src_rank;  // [E/W] -> [count]
  std::vector<std::vector<int32_t>> src_idx;   // [E/W] -> [count]
  std::vector<std::vector<int32_t>> topk_slot;  // [E/W] -> [count], k of this expert in the token
  std::vector<std::vector<float>> weight;      // [E/W] -> [count], topk_weights[k]
};

// inputs[r] is rank r's input; cfg.rank is ignored. Returns one entry per receiving rank.
// every_rank: every valid token goes to every rank, routed there or not (the all-gather of the
// naive and allgather_reducescatter backends); rows keep the same order and metadata.
std::vector<TokenMajorRecv> dispatch_token_major(const EpConfig& cfg,
                                                 const std::vector<RankInput>& inputs,
                                                 bool every_rank = false);
std::vector<ExpertMajorRecv> dispatch_expert_major(const EpConfig& cfg,
                                                   const std::vector<RankInput>& inputs);

// ---- LogFMT (src/core/logfmt.hpp: the format, its row layout and its error bound) ----------
// x [rows][hidden] bf16 bits -> out [rows][logfmt::row_stride(hidden)] bytes (padding zeroed).
// hidden must be a multiple of 128 (InputError otherwise).
void logfmt_encode(const uint16_t* x, int rows, int hidden, uint8_t* out);
// in [rows][logfmt::row_stride(hidden)] -> out [rows][hidden] f32, as combine adds them.
void logfmt_decode(const uint8_t* in, int rows, int hidden, float* out);
// decode(encode(x)) of rows of bf16 bits; of one row, into out [hidden].
std::vector<float> logfmt_round_trip(const uint16_t* x, int rows, int hidden);
void logfmt_round_trip_row(const uint16_t* x, int hidden, float* out);

// ---- combine -------------------------------------------------------------------------------
// What crosses between the ranks in combine: the public epx::CombineFormat (include/epx/config.hpp).
using CombineFormat = epx::CombineFormat;

// What token-major combine may also do (All2All::combine with CombineExtras), per rank; an empty
// vector is "not given":
//   topk_weights[r]: [M_r][K] f32 row-aligned with recv[r]; y_topk_weights[s] [N_s][K] (an
//     output) = per token the sum over ranks r ascending that received it of its row, from +0.0f;
//   bias0[s], bias1[s]: [N_s][H] bf16 bits, or empty where rank s gives none; y's f32 sum starts
//     from ((+0.0f + b0) + b1).
struct CombineExtrasRef {
  std::vector<std::vector<float>> topk_weights;
  std::vector<std::vector<uint16_t>> bias0, bias1;
  std::vector<std::vector<float>> y_topk_weights;  // filled by combine_token_major
};

// order = the ranks 0..world-1 in the order CombineOrder::kHighestSlot adds them for token n of
// `routing`: ascending by the highest top-k slot k whose expert (ids[n][k] / experts_per_rank) is
// on the rank; ranks that hold none of its experts first, in rank order.
void ranks_in_highest_slot_order(const Routing& routing, int n, int experts_per_rank, int world,
                                 std::vector<int>& order);

// partials[r]: [M_r][H] bf16 bits, row-aligned with recv[r]. Returns y[s]: [N_s][H] bf16 bits.
// The sums follow cfg.combine_order (by the ids of inputs[s].routing for kHighestSlot).
std::vector<std::vector<uint16_t>> combine_token_major(
    const EpConfig& cfg, const std::vector<RankInput>& inputs,
    const std::vector<TokenMajorRecv>& recv, const std::vector<std::vector<uint16_t>>& partials,
    CombineFormat format = CombineFormat::kBF16, CombineExtrasRef* extras = nullptr);

// out[r][e]: [count_e][H] bf16 bits, row-aligned with recv[r].x[e].
std::vector<std::vector<uint16_t>> combine_expert_major(
    const EpConfig& cfg, const std::vector<RankInput>& inputs,
    const std::vector<ExpertMajorRecv>& recv,
    const std::vector<std::vector<std::vector<uint16_t>>>& out,
    CombineFormat format = CombineFormat::kBF16);

// ---- test helpers ------------------------------------------------------------------------
// Deterministic "expert" used by tests: partial row of token-major row j on rank r is
// bf16(sum over local k of w_k * dequant(x) * (1 + e_k % 3)) etc. Kept simple: identity scaled
// by the sum of local weights, so combine of it equals sum_k w_k * x within bf16 rounding.
std::vector<uint16_t> identity_partials(const EpConfig& cfg, int rank, const TokenMajorRecv& recv);
std::vector<std::vector<uint16_t>> identity_expert_outputs(const EpConfig& cfg,
                                                           const ExpertMajorRecv& recv);

// Row of token n of rank s as floats (dequantised for fp8 inputs; the bf16-to-fp8 path uses
// the quantised values, as the wire does).
std::vector<float> token_as_float(const EpConfig& cfg, const RankInput& in, int n);

}  // namespace epx::ref
