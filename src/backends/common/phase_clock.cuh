#pragma once
// The device side of the phase clock (phase_clock.hpp), shared by every engine's kernels: the
// sums, and the marks EPX_PHASE_MARK / EPX_PHASE_MARK_SYNC that each kernel places at the end of
// its phases. A release build expands the marks to nothing. The marks call phase_mark(common,
// ...), which each engine defines for its launch parameters (they hold `clock`, a PhaseClock*,
// null unless EPX_PHASE_CLOCK is set) and its phase enums: peer's takes the block's start from a
// register, high_throughput's from shared memory (phase_block_start). Included by .cu files only.

#include <cstdint>

#include "backends/common/phase_clock.hpp"
#include "core/sync_device.cuh"

#if EPX_MEASUREMENT
namespace epx {

// Adds `ns` to phase `phase` of op `op`, and one block to its count. One thread.
__device__ __forceinline__ void phase_add(PhaseClock* clock, int op, int phase, uint64_t ns) {
  atomicAdd(&clock->sum[op][phase], ns);
  atomicAdd(&clock->count[op][phase], 1ull);
}

// Thread 0 of the block keeps `start`, the block's start, as op's start of this block in the
// latest launch.
__device__ __forceinline__ void phase_started(PhaseClock* clock, int op, uint64_t start) {
  if (clock == nullptr || threadIdx.x != 0 || blockIdx.x >= unsigned(kMaxClockBlocks)) return;
  clock->block_start[op][blockIdx.x] = start;
}

// Thread 0 of the block adds the time since `start` to the phase's sum; call it where the whole
// block has finished the phase (after a __syncthreads).
__device__ __forceinline__ void phase_since(PhaseClock* clock, int op, int phase, uint64_t start) {
  if (clock == nullptr || threadIdx.x != 0) return;
  phase_add(clock, op, phase, dev::globaltimer_ns() - start);
}

// The block's start (globaltimer ns) in shared memory, for kernels with no register to spare for
// it: thread 0, which alone marks, sets it at the block's start and reads it at each mark.
__device__ __forceinline__ uint64_t& phase_block_start() {
  __shared__ uint64_t start;
  return start;
}

}  // namespace epx

// The arguments after `common` are those of the engine's phase_mark after it: the phase, and the
// block's start where the engine keeps it in a register.
#define EPX_PHASE_MARK(common, ...) phase_mark(common, __VA_ARGS__)
// The same where the block is not synchronised yet (the sync exists in measurement builds only).
#define EPX_PHASE_MARK_SYNC(common, ...)            \
  do {                                              \
    if ((common).clock != nullptr) __syncthreads(); \
    phase_mark(common, __VA_ARGS__);                \
  } while (0)
#else
#define EPX_PHASE_MARK(...) ((void)0)
#define EPX_PHASE_MARK_SYNC(...) ((void)0)
#endif
