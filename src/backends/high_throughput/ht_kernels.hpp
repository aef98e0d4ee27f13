#pragma once
// Launch parameters and launchers of the high_throughput kernels (ht_dispatch.cu, ht_combine.cu).
// One params struct per kernel (STYLE §7), trivially copyable, passed as __grid_constant__.
//
// A dispatch is two kernels: `count` (each rank's channels post how many rows they send to each
// rank; every rank then lays out its receive area by (source, channel) and knows M) and
// `transfer` (per channel a sending block streams rows into the rings and a receiving block
// drains the rings into the receive area). With exact output sizes the host reads M between
// them. Combine is one kernel: per channel a sending block streams each received row's partial
// back through the combine rings, and a receiving block sums, per token, the partials of the ranks
// that got it, in rank order.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

#include "backends/common/phase_clock.hpp"
#include "backends/high_throughput/ht_layout.hpp"
#include "core/device_status.hpp"
#include "epx/config.hpp"

#if defined(__CUDACC__)
#define EPX_HOST_DEVICE __host__ __device__
#else
#define EPX_HOST_DEVICE
#endif

namespace epx::ht {

// What every rank of a launch shares.
struct HtShape {
  int32_t world;
  int32_t hidden;
  int32_t num_experts;
  int32_t num_local;
  int32_t topk;
  int32_t groups;  // fp8 scale blocks per row (0: bf16 wire)
  int32_t wire_row_bytes;
  int32_t scale_col_major;  // recv scales [G][rows]
  int32_t ids_int64;
  int32_t round_scale;  // EpConfig::round_scale: power-of-two fp8 scales
  int32_t highest_slot;  // EpConfig::combine_order kHighestSlot: HtLayout::token_order is kept
};

// Ranks one launch may serve (an in-process group sharing a GPU).
inline constexpr int kMaxLaunchRanks = 32;

#if EPX_MEASUREMENT
// The phases of each kernel that the phase clock of a measurement build (EPX_PHASE_CLOCK,
// backends/common/phase_clock.hpp) times, each from its own block's start: op 0 the count
// kernel, op 1 the transfer kernel, op 2 combine.
enum class CountPhase : int {
  kSetUp,       // the epoch read, the block's expert sums cleared
  kIdsIn,       // warp 0: the top-k ids of its first step in hand (one load's latency)
  kWalked,      // the block's tokens walked (destinations, expert pairs, rows per destination)
  kRouted,      // ... and the block's expert sums added at the experts' ranks
  kCounted,     // the channel's rows per destination posted to every rank
  kPlaced,      // direct: each token's row within its segment (the walk's places + the scan)
  kCountsSeen,  // block 0: every count of the round seen
  kLaidOut,     // block 0: the segments laid out
  kCount
};
enum class TransferPhase : int {
  kAreas,       // direct: every destination's published receive area read
  kPayload,     // direct: the block's rows written; rings: the sending block's rows published
  kSignalled,   // direct: the last-block ticket taken (the last block: arrival released)
  kArrived,     // direct, block 0: every rank's rows here
  kReceived,    // rings: the receiving block's rows drained
  kAfterCount,  // block 0: its start less the start of block 0 of the rank's count kernel
  kCount
};
enum class CombinePhase : int {
  kPublished,     // direct, block 0: the partials' pointer published
  kPartialsSeen,  // direct: every rank's published partials read
  kPulled,        // direct: the block's tokens summed
  kAllRead,       // direct, block 0: every owner has read this rank's partials
  kSummed,        // rings: the receiving block's tokens summed
  kCount
};
static_assert(kMaxPhaseOps >= 3 && int(CountPhase::kCount) <= kMaxPhases &&
              int(TransferPhase::kCount) <= kMaxPhases && int(CombinePhase::kCount) <= kMaxPhases);
#endif

// Direct mode's staging (dynamic shared memory of the transfer kernel): a batch of up to
// kMaxStageTokens of a block's tokens, as they go on the wire, then written destination by
// destination, so that each destination gets one contiguous run of rows per batch (rows of a
// segment are in token order at every destination). On the H200 a dispatch-shaped scatter that
// writes pieces of each row at each of its destinations runs 1.24x its floor, the same bytes
// written in order 1.16x (tools/diag/scatter_probe.cu).
inline constexpr int kMaxStageTokens = 32;  // one lane per token when the lists are made
static_assert(kMaxStageTokens <= 32, "a batch's tokens are the lanes of one warp");
// Rows (in two buffers where they fit: a batch is loaded into one while the bulk copies of the
// one before read the other) + scales + lists + top-k entries, per block: 192 KiB beside the
// kernel's static shared memory (under 9 KiB) stays within an H100/H200 block's 227 KiB.
inline constexpr int kStageBudgetBytes = 192 << 10;
// Staged bytes per token with `buffers` row buffers: its rows, scales, place in the W lists, top-k
// ids and weights.
constexpr EPX_HOST_DEVICE int ht_stage_token_bytes(const HtShape& S, int buffers) {
  return buffers * S.wire_row_bytes + S.groups * 4 + S.world * 4 + S.topk * 8;
}
// Row buffers: two where one token's fit the budget, else one.
constexpr EPX_HOST_DEVICE int ht_stage_buffers(const HtShape& S) {
  return ht_stage_token_bytes(S, 2) <= kStageBudgetBytes ? 2 : 1;
}
// Tokens per batch: as many as fit the budget, at least one (a row is at most 128 KiB).
constexpr EPX_HOST_DEVICE int ht_stage_tokens(const HtShape& S) {
  const int t = kStageBudgetBytes / ht_stage_token_bytes(S, ht_stage_buffers(S));
  return t < 1 ? 1 : (t > kMaxStageTokens ? kMaxStageTokens : t);
}
// The most ht_stage_bytes can be: the budget, or one bf16 row of kMaxHidden with its list and
// top-k entries.
inline constexpr int kMaxOneTokenStage = 2 * kMaxHidden + 4 * kMaxRanks + 8 * kMaxTopk;
inline constexpr int kMaxStageBytes =
    kStageBudgetBytes > kMaxOneTokenStage ? kStageBudgetBytes : kMaxOneTokenStage;
// [buffers][T][wire_row_bytes] rows, then f32 [T][groups] scales, int32 [world][T] lists, int32
// [T][topk] ids and f32 [T][topk] weights.
constexpr EPX_HOST_DEVICE size_t ht_stage_bytes(const HtShape& S) {
  return size_t(ht_stage_tokens(S)) * size_t(ht_stage_token_bytes(S, ht_stage_buffers(S)));
}

// DeepSeek-R1 (H 7168, fp8 on the wire, 56 scale groups, top-8, 8 ranks): two buffers, 13 tokens.
inline constexpr HtShape kR1Stage{
    .world = 8, .hidden = 7168, .topk = 8, .groups = 56, .wire_row_bytes = 7168};
static_assert(ht_stage_buffers(kR1Stage) == 2 && ht_stage_tokens(kR1Stage) == 13);
// The largest rows: one bf16 row of kMaxHidden values, and one fp8 row with its scales.
static_assert(ht_stage_bytes(HtShape{.world = kMaxRanks,
                                     .hidden = kMaxHidden,
                                     .topk = kMaxTopk,
                                     .groups = 0,
                                     .wire_row_bytes = 2 * kMaxHidden}) <= kMaxStageBytes);
static_assert(ht_stage_bytes(HtShape{.world = kMaxRanks,
                                     .hidden = kMaxHidden,
                                     .topk = kMaxTopk,
                                     .groups = kMaxHidden / kFp8BlockSize,
                                     .wire_row_bytes = kMaxHidden}) <= kMaxStageBytes);

struct HtCommon {
  uint8_t* const* peers;  // device array [W]: every rank's symmetric buffer
  HtLayout layout;
  HtShape shape;
  uint64_t timeout_ns;
  int32_t num_ranks;  // ranks served by this launch, gridDim.x / num_ranks blocks each
#if EPX_MEASUREMENT
  PhaseClock* clock;  // EPX_PHASE_CLOCK: the phase sums of this launch, else null
#endif
};

// The received rows' areas of `rows` rows, in one allocation (the host sizes it, the kernels
// address it): one definition for both sides.
inline EPX_HOST_DEVICE HtRowsLayout rows_layout(int rows, int64_t row_bytes, int groups, int topk,
                                                int hidden) {
  auto carve = [](size_t& c, size_t bytes) {
    const size_t off = c;
    c = (c + bytes + 255) / 256 * 256;
    return off;
  };
  const size_t R = size_t(rows);
  HtRowsLayout L{};
  size_t c = 0;
  L.rows = rows;
  L.recv_x = carve(c, R * size_t(row_bytes));
  L.recv_scales = carve(c, R * size_t(groups) * sizeof(float));
  L.recv_src_rank = carve(c, R * sizeof(int32_t));
  L.recv_src_idx = carve(c, R * sizeof(int32_t));
  L.recv_topk_ids = carve(c, R * size_t(topk) * sizeof(int32_t));
  L.recv_topk_w = carve(c, R * size_t(topk) * sizeof(float));
  L.partials = carve(c, R * size_t(hidden) * 2);
  L.combine_w = carve(c, R * size_t(topk) * sizeof(float));
  L.total = c;
  return L;
}

struct HtDispatchRank {
  uint8_t* local;             // this rank's symmetric buffer (== peers[rank])
  DeviceStatus* host_status;  // mapped host mirror of its status word
  int32_t rank;
  int32_t num_tokens;
  const void* x;
  const float* x_scales;
  const void* topk_ids;        // null: routing by rank_mask (DispatchInput)
  const float* topk_weights;   // null with topk_ids
  const uint8_t* rank_mask;    // [N][W] or null
  const int32_t* expert_sums;  // [E]: the sender's pairs per expert (with rank_mask)
  uint8_t* rows;      // the received rows' allocation (transfer only)
  int32_t area_rows;  // its rows
};

struct HtDispatchParams {
  HtCommon common;
  HtDispatchRank ranks[kMaxLaunchRanks];
};

struct HtCombineRank {
  uint8_t* local;
  DeviceStatus* host_status;
  int32_t rank;
  const void* expert_out;  // [M][H] bf16 partials, row j = received row j
  void* y;                 // [N][H] bf16
  // CombineExtras: each received row's top-k weights back ([M][K] f32; direct mode: the rows
  // area's combine_w), their per-token sums ([N][K]), and up to two bias rows ([N][H] bf16)
  // that start each token's f32 sum. Null when not asked for.
  const float* topk_w;
  float* y_topk_w;
  const void* bias0;
  const void* bias1;
};

struct HtCombineParams {
  HtCommon common;
  HtCombineRank ranks[kMaxLaunchRanks];
};

static_assert(std::is_trivially_copyable_v<HtDispatchParams> && sizeof(HtDispatchParams) <= 4096);
static_assert(std::is_trivially_copyable_v<HtCombineParams> && sizeof(HtCombineParams) <= 4096);

// Load the kernels on the current device (see peer::preload_kernels for why up front).
void load_ht_dispatch_kernels();
void load_ht_combine_kernels();
// `channels` per rank: count launches one block per segment (HtLayout::segments: a channel, or
// in direct mode a half channel), transfer and combine two per channel (a sending and a receiving
// block, or in direct mode one per half channel), each of `warps` warps.
void launch_ht_count(const HtDispatchParams& p, int warps, cudaStream_t stream);
void launch_ht_transfer(const HtDispatchParams& p, DispatchDtype dtype, int channels, int warps,
                        cudaStream_t stream);
void launch_ht_combine(const HtCombineParams& p, int channels, int warps, cudaStream_t stream);
// dst = src for the first *rows (a device scalar) partial rows of `hidden` bf16 each (hidden * 2
// a multiple of 16 bytes, both pointers 16-byte aligned).
void launch_ht_copy_partials(const void* src, void* dst, const int32_t* rows, int hidden,
                             cudaStream_t stream);
// dst = src for the first *rows rows of `row_words` 4-byte words each (both 4-byte aligned).
void launch_ht_copy_words(const void* src, void* dst, const int32_t* rows, int row_words,
                          cudaStream_t stream);

}  // namespace epx::ht
