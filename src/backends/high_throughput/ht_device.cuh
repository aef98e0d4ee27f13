#pragma once
// Device helpers shared by the high_throughput kernels (ht_dispatch.cu, ht_combine.cu).
// Included by .cu files only.

#include <cstdint>
#include <type_traits>

#include "backends/common/phase_clock.cuh"
#include "backends/high_throughput/ht_kernels.hpp"
#include "core/sync_device.cuh"
#include "core/vec_device.cuh"
#include "epx/config.hpp"

namespace epx::ht {

using dev::at;
using dev::kFullWarp;
using dev::kWarpSize;
using dev::lowest_rank;

inline constexpr int kMaxThreads = kMaxWarpsPerBlock * kWarpSize;
static_assert(kMaxThreads <= 1024, "a CUDA block holds at most 1024 threads");
static_assert(kMaxWarpsPerBlock <= kWarpSize,
              "a batch holds one token per warp, one per lane of warp 0");
static_assert(kMaxRanks <= 64, "destinations of a token are one uint64_t");

// Channel c's tokens of a rank with N tokens: [channel_begin(c), channel_begin(c + 1)).
__device__ __forceinline__ int channel_begin(int N, int channels, int c) {
  return int(int64_t(N) * c / channels);
}

// Direct mode: block b of a rank's 2C serves half b % 2 of channel b / 2's tokens [first, second).
struct TokenRange {
  int first, second;
};
__device__ __forceinline__ TokenRange half_channel(int N, int channels, int b) {
  const int c0 = channel_begin(N, channels, b / 2), c1 = channel_begin(N, channels, b / 2 + 1);
  const int mid = c0 + (c1 - c0) / 2;
  return b % 2 == 0 ? TokenRange{c0, mid} : TokenRange{mid, c1};
}

// Direct mode: the half channel (segment) that holds token n, 0 <= n < N.
__device__ __forceinline__ int segment_of(int N, int channels, int n) {
  int c = int(int64_t(n) * channels / N);  // channel_begin(c) <= n; the later ones may be too
  while (c + 1 < channels && channel_begin(N, channels, c + 1) <= n) ++c;
  return 2 * c + (n >= half_channel(N, channels, 2 * c).second ? 1 : 0);
}

// Segment c's tokens (HtLayout::segments): channel c, or in direct mode half channel c.
__device__ __forceinline__ TokenRange segment_tokens(int N, int channels, bool direct, int c) {
  return direct ? half_channel(N, channels, c)
                : TokenRange{channel_begin(N, channels, c), channel_begin(N, channels, c + 1)};
}

// Which rank of a launch this block serves, and its block among that rank's nb.
struct HtBlock {
  int slot;
  int b;
  int nb;
};
__device__ __forceinline__ HtBlock ht_block(int num_ranks) {
  const int nb = int(gridDim.x) / num_ranks;
  return HtBlock{int(blockIdx.x) / nb, int(blockIdx.x) % nb, nb};
}

__device__ __forceinline__ dev::WaitContext ht_wait(uint8_t* local, DeviceStatus* host_status,
                                                    int rank, const HtCommon& c) {
  return dev::WaitContext{at<DeviceStatus>(local, c.layout.status), host_status, c.timeout_ns,
                          rank};
}

#if EPX_MEASUREMENT
// The phase clock (backends/common/phase_clock.cuh). These kernels have no register to spare:
// thread 0 keeps the block's start in shared memory (phase_block_start), and each mark reads the
// launch's clock from the kernel's parameters.

// At the block's start (before any mark), thread 0.
__device__ __forceinline__ void phase_begin(const HtCommon& c) {
  if (c.clock != nullptr && threadIdx.x == 0) phase_block_start() = dev::globaltimer_ns();
}

// EPX_PHASE_MARK(common, phase): thread 0 of the block adds the time since the block's start to
// the phase's sum; call it where the whole block has finished the phase (after a __syncthreads).
template <typename PhaseT>
__device__ __forceinline__ void phase_mark(const HtCommon& c, PhaseT phase) {
  static_assert(std::is_same_v<PhaseT, CountPhase> || std::is_same_v<PhaseT, TransferPhase> ||
                std::is_same_v<PhaseT, CombinePhase>);
  constexpr int op = std::is_same_v<PhaseT, CountPhase>      ? 0
                     : std::is_same_v<PhaseT, TransferPhase> ? 1
                                                             : 2;
  if (threadIdx.x != 0 || c.clock == nullptr) return;
  phase_add(c.clock, op, int(phase), dev::globaltimer_ns() - phase_block_start());
}

// Block 0 of the count kernel, after phase_begin: its start, for the rank's transfer kernel.
__device__ __forceinline__ void phase_count_started(const HtCommon& c, int rank) {
  if (c.clock != nullptr && threadIdx.x == 0) c.clock->first_start[rank] = phase_block_start();
}

// Block 0 of the transfer kernel, after phase_begin: the time from the start of block 0 of the
// rank's count kernel to its own (TransferPhase::kAfterCount).
__device__ __forceinline__ void phase_after_count(const HtCommon& c, int rank) {
  if (c.clock == nullptr || threadIdx.x != 0) return;
  const uint64_t count_start = c.clock->first_start[rank], start = phase_block_start();
  if (count_start == 0 || count_start > start) return;  // no count kernel timed before it
  phase_add(c.clock, 1, int(TransferPhase::kAfterCount), start - count_start);
}
#endif

// Bytes of a dispatch ring row: payload, then f32 scales, int32 ids, f32 weights, int32 index.
struct SlotParts {
  int scales, ids, weights, index;
};
__device__ __forceinline__ SlotParts slot_parts(const HtShape& S) {
  SlotParts p;
  p.scales = S.wire_row_bytes;
  p.ids = p.scales + S.groups * 4;
  p.weights = p.ids + S.topk * 4;
  p.index = p.weights + S.topk * 4;
  return p;
}

// How long a block that polls several peers waits without progress before it names one: a little
// longer than the bounded waits of single peers, so that the rank that really stopped is named by
// the wait that depends on it alone (a writer waiting for room in its ring) and not a healthy
// peer held up by it.
__device__ __forceinline__ uint64_t idle_limit_ns(uint64_t timeout_ns) {
  return timeout_ns + min(timeout_ns / 4, uint64_t(500) * 1000 * 1000);
}

// Index of the f32 scale of (row, group) in a [rows][groups] or [groups][rows] scale area.
__device__ __forceinline__ size_t ht_scale_index(const HtShape& S, int row, int group, int rows) {
  return S.scale_col_major ? size_t(group) * rows + row : size_t(row) * S.groups + group;
}

// A 16-byte load that bypasses L1: ring rows are rewritten while a kernel runs, and L1 is not
// kept coherent with writes of other SMs or GPUs.
__device__ __forceinline__ int4 ld_ring(const void* p) {
  return __ldcg(static_cast<const int4*>(p));
}

// The destination ranks of the tokens [t, t_end) of a batch (at most kWarpSize), by warp 0:
// mask_of[i] for token t + i (0 past t_end), bal[r] = bit i set when token t + i goes to rank r.
// Position of token t + i in ring r among the batch: popc(bal[r] & ((1 << i) - 1)).
__device__ __forceinline__ void batch_ballots(const uint64_t* token_mask, int t, int t1, int W,
                                              uint64_t* mask_of, uint32_t* bal) {
  const int lane = threadIdx.x % kWarpSize;
  const int n = t + lane;
  const uint64_t m = n < t1 ? token_mask[n] : 0;
  mask_of[lane] = m;
  for (int r = 0; r < W; ++r) {
    const uint32_t b = __ballot_sync(kFullWarp, (m >> r) & 1);
    if (lane == 0) bal[r] = b;
  }
}

// After a batch: each rank r the batch touched learns, by one release after the block's writes
// (or reads), that ring position base[r] + (its tokens in the batch) is reached; base advances.
// The word is `word_at(r)` (in r's memory). Called by the whole block, after a __syncthreads.
template <typename WordAt>
__device__ __forceinline__ void publish_batch(uint64_t* base, const uint32_t* bal, int W,
                                              WordAt word_at) {
  for (int r = threadIdx.x; r < W; r += blockDim.x) {
    const int cnt = __popc(bal[r]);
    if (cnt == 0) continue;
    base[r] += cnt;
    dev::fence_acq_rel_sys();
    dev::st_release_sys(word_at(r), base[r]);
  }
  __syncthreads();
}

// Before a batch: for each rank r the batch touches, waits until `ready(r, need)` holds, where
// need = base[r] + (its tokens in the batch); a wait that expires is recorded (phase, peer r)
// and sets *failed. Called by the whole block; returns with the block synchronised.
template <typename Ready, typename Seen>
__device__ __forceinline__ void wait_batch(const dev::WaitContext& w, Phase phase,
                                           const uint64_t* base, const uint32_t* bal, int W,
                                           int32_t* failed, Ready ready, Seen seen) {
  for (int r = threadIdx.x; r < W; r += blockDim.x) {
    const int cnt = __popc(bal[r]);
    if (cnt == 0) continue;
    const uint64_t need = base[r] + cnt;
    if (!dev::bounded_wait(
            w, phase, r, int64_t(need), [&] { return ready(r, need); }, [&] { return seen(r); })) {
      *failed = 1;
    }
  }
  __syncthreads();
}

// Direct mode: waits until every rank q's word words[q] (in this rank's memory) holds `epoch`
// (bounded; a wait that expires names q). Called by the whole block; true when all arrived.
__device__ __forceinline__ bool await_words(const dev::WaitContext& w, Phase phase,
                                            const uint64_t* words, int W, uint32_t epoch) {
  __shared__ int32_t failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  for (int q = threadIdx.x; q < W; q += blockDim.x) {
    uint64_t seen = 0;
    if (!dev::bounded_wait(
            w, phase, q, int64_t(epoch),
            [&] {
              seen = dev::ld_acquire_sys(words + q);
              return seen == uint64_t(epoch);
            },
            [&] { return int64_t(seen); })) {
      failed = 1;
    }
  }
  __syncthreads();
  return failed == 0;
}

// Direct mode: one pointer for the peers (with a value beside it), then its epoch word,
// released. One thread.
__device__ __forceinline__ void publish_pointer(uint64_t* epoch_word, uint64_t* ptr_word,
                                                const void* ptr, int64_t* value_word, int64_t value,
                                                uint32_t epoch) {
  *ptr_word = reinterpret_cast<uint64_t>(ptr);
  if (value_word != nullptr) *value_word = value;
  dev::fence_acq_rel_sys();
  dev::st_release_sys(epoch_word, uint64_t(epoch));
}

// Direct mode: waits until rank r has published the pointer of `epoch` (bounded), then reads it.
__device__ __forceinline__ bool read_published(const dev::WaitContext& w, Phase phase, int r,
                                               const uint64_t* epoch_word, const uint64_t* ptr_word,
                                               uint32_t epoch, uint64_t* ptr) {
  uint64_t seen = 0;
  if (!dev::bounded_wait(
          w, phase, r, int64_t(epoch),
          [&] {
            seen = dev::ld_acquire_sys(epoch_word);
            return seen == uint64_t(epoch);
          },
          [&] { return int64_t(seen); })) {
    return false;
  }
  *ptr = dev::ld_acquire_sys(ptr_word);
  return true;
}

}  // namespace epx::ht
