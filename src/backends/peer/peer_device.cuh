#pragma once
// Device helpers shared by the peer engine's dispatch (dispatch.cu) and combine (combine.cu)
// kernels: the limits they rely on, the block's rank, and the per-token rank slots a warp holds
// (addressing and bf16 vectors come from core/vec_device.cuh). Included by .cu files only.

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "backends/common/phase_clock.cuh"
#include "backends/peer/kernels.hpp"
#include "core/sync_device.cuh"
#include "core/vec_device.cuh"
#include "epx/config.hpp"

namespace epx::peer {

using dev::at;
using dev::bf16x8_to_float;
using dev::kFullWarp;
using dev::kWarpSize;
using dev::load_bf16x8;
using dev::lowest_rank;
using dev::store_bf16x8;

// Every kernel is launched with warps_per_block <= kMaxWarpsPerBlock (resolve() checks it).
inline constexpr int kMaxThreadsPerBlock = kMaxWarpsPerBlock * kWarpSize;

static_assert(kMaxThreadsPerBlock <= 1024, "a CUDA block holds at most 1024 threads");
static_assert(kMaxRanks <= 64, "rank masks (destinations of a token) are one uint64_t");
static_assert(kMaxRanks <= 2 * kWarpSize,
              "a warp holds one slot per rank: rank r in lane r % 32, of RankSlots::lo or ::hi");
static_assert(kMaxTopk <= kWarpSize, "a token's top-k entries are read one per lane");
static_assert(sizeof(int4) == 16, "rows move in 16-byte vectors");
static_assert(kFp8BlockSize % 16 == 0, "an fp8 scale block is whole 16-byte vectors");

// Which rank of a launch this block serves, and its place among that rank's blocks.
struct RankBlock {
  int slot;  // index into the launch's per-rank arguments
  int b;     // block of this rank: 0 .. nb - 1
  int nb;    // blocks per rank
};

__device__ __forceinline__ RankBlock rank_block(int num_ranks) {
  const int nb = int(gridDim.x) / num_ranks;
  return RankBlock{int(blockIdx.x) / nb, int(blockIdx.x) % nb, nb};
}

// The bounded-wait context of a rank: its status word, the host mirror, the timeout.
__device__ __forceinline__ dev::WaitContext make_wait(uint8_t* local, DeviceStatus* host_status,
                                                      int rank, const LaunchCommon& common) {
  dev::WaitContext w{at<DeviceStatus>(local, common.layout.status), host_status,
                     common.timeout_ns, rank};
  if (common.shape.mask_failed) w.masked = &at<State>(local, common.layout.state)->masked;
  return w;
}

// Index of the f32 scale of (row, group) in a [rows][groups] or [groups][rows] scale area.
__device__ __forceinline__ size_t scale_index(const Shape& S, int row, int group, int rows) {
  return S.scale_col_major ? size_t(group) * rows + row : size_t(row) * S.groups + group;
}

#if EPX_MEASUREMENT
// The phase clock's mark (EPX_PHASE_MARK, backends/common/phase_clock.cuh): thread 0 of the
// block adds the time since `start` to the phase's sum; call it where the whole block has
// finished the phase (after a __syncthreads).
template <typename PhaseT>
__device__ __forceinline__ void phase_mark(const LaunchCommon& c, PhaseT phase, uint64_t start) {
  constexpr int op = std::is_same_v<PhaseT, DispatchPhase> ? 0 : 1;
  phase_since(c.clock, op, int(phase), start);
}
#endif

// A token's row in every rank's receive area (-1: not sent there), spread over a warp: lane l
// holds rank l in `lo` and rank l + 32 in `hi`. Every lane of the warp calls the members.
struct RankSlots {
  int lo;
  int hi;
  // The row at rank r, in every lane.
  __device__ __forceinline__ int of(int r) const {
    return __shfl_sync(kFullWarp, r < 32 ? lo : hi, r & 31);
  }
  // The ranks with a row.
  __device__ __forceinline__ uint64_t ranks() const {
    return uint64_t(__ballot_sync(kFullWarp, lo >= 0)) |
           (uint64_t(__ballot_sync(kFullWarp, hi >= 0)) << 32);
  }
};

// Token n's slots from send_slot ([tokens][W]).
__device__ __forceinline__ RankSlots load_rank_slots(const int32_t* send_slot, int n, int W,
                                                     int lane) {
  const int32_t* row = send_slot + size_t(n) * W;
  return RankSlots{lane < W ? row[lane] : -1, lane + 32 < W ? row[lane + 32] : -1};
}

}  // namespace epx::peer
