#pragma once
// A block's (token, expert) pair counts, summed in shared memory before they are added at each
// expert's rank. Every pair adding 1 at its rank directly puts all pairs of a destination on one
// line of counters ([E/W] int32 at that rank), where L2 serialises them: at 4096 tokens per rank,
// 8 ranks, top-8, a line took 32768 adds per call. Summed per block, a line takes at most one add
// per (block, expert). A block with fewer pairs than experts (decode sizes) adds them directly:
// summing would cost it a pass over every expert for no fewer adds. Shared by every engine's
// dispatch; included by .cu files only.

#include <cstdint>

#include "core/sync_device.cuh"

namespace epx::dev {

// Experts a block sums in shared memory (4 KiB); with more, pairs go to their ranks one by one.
inline constexpr int kMaxBlockExperts = 1024;

// The block's sums, in `sums` (shared, [kMaxBlockExperts]) when `num_experts` fits and the block
// has more pairs than experts, else each pair is added at its rank as it comes. counter(e) =
// expert e's counter at its rank. Every member block-uniform.
struct ExpertPairs {
  int32_t* sums;
  int num_experts;
  int max_pairs;  // the block's (token, expert) pairs at most: its tokens x top-k

  __device__ __forceinline__ bool summed() const {
    return num_experts <= kMaxBlockExperts && max_pairs > num_experts;
  }

  // Zeroes the sums. Every thread of the block; a __syncthreads must follow before add().
  __device__ __forceinline__ void clear() const {
    if (!summed()) return;
    for (int e = int(threadIdx.x); e < num_experts; e += int(blockDim.x)) sums[e] = 0;
  }

  // One pair of expert e.
  template <typename Counter>
  __device__ __forceinline__ void add(int e, const Counter& counter) const {
    if (summed()) {
      atomicAdd(&sums[e], 1);
    } else {
      red_add_relaxed_sys(counter(e), 1);
    }
  }

  // Adds each expert's sum at its rank. Every thread of the block, after a __syncthreads that
  // follows the last add().
  template <typename Counter>
  __device__ __forceinline__ void flush(const Counter& counter) const {
    if (!summed()) return;
    for (int e = int(threadIdx.x); e < num_experts; e += int(blockDim.x)) {
      const int32_t v = sums[e];
      if (v != 0) red_add_relaxed_sys(counter(e), v);
    }
  }
};

}  // namespace epx::dev
