#pragma once
// Device-side synchronisation helpers with the memory order named at the call site, bounded
// waits, and the status-word recorder. Included by .cu files only.

#include <cstdint>

#include "core/device_status.hpp"
#include "core/sync_device_types.hpp"

namespace epx::dev {

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ int32_t ld_acquire_sys(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ int32_t ld_relaxed_sys(const int32_t* p) {
  int32_t v;
  asm volatile("ld.relaxed.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(int32_t* p, int32_t v) {
  asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ int32_t atomic_add_release_sys(int32_t* p, int32_t v) {
  int32_t old;
  asm volatile("atom.add.release.sys.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
// Relaxed system-scope add that returns the old value (a slot reservation in a peer's buffer).
__device__ __forceinline__ int32_t atomic_add_relaxed_sys(int32_t* p, int32_t v) {
  int32_t old;
  asm volatile("atom.add.relaxed.sys.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// Relaxed system-scope add without a result (a count in a peer's buffer, ordered by a later
// release).
__device__ __forceinline__ void red_add_relaxed_sys(int32_t* p, int32_t v) {
  asm volatile("red.relaxed.sys.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ int32_t atomic_add_acq_rel_gpu(int32_t* p, int32_t v) {
  int32_t old;
  asm volatile("atom.add.acq_rel.gpu.global.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Everything a bounded wait needs: the rank's status word (device-arbitrated, host-mirrored),
// the deadline, and who is waiting.
struct WaitContext {
  DeviceStatus* status;       // device memory: code arbitrated with atomicCAS
  DeviceStatus* host_status;  // mapped host memory: the mirror the host reads (a HostMirror's)
  uint64_t timeout_ns;
  int32_t rank;
  uint32_t call = 0;          // the op's call number (epoch), once the kernel knows it
  unsigned long long* masked = nullptr;  // masking on: the rank's mask word (device), else null
};

// First error wins; later ones are dropped. Safe to call from any thread.
__device__ inline void record_error(const WaitContext& ctx, StatusCode code, Phase phase,
                                    int32_t peer, int64_t expected, int64_t seen,
                                    int32_t token = -1, int32_t slot = -1) {
  if (atomicCAS(&ctx.status->code, int32_t(StatusCode::kNone), int32_t(code)) !=
      int32_t(StatusCode::kNone)) {
    return;
  }
  const DeviceStatus s{.code = int32_t(code),
                       .phase = int32_t(phase),
                       .rank = ctx.rank,
                       .peer = peer,
                       .expected = expected,
                       .seen = seen,
                       .token = token,
                       .slot = slot,
                       .valid = 1,
                       .call = int32_t(ctx.call)};
  ctx.status->phase = s.phase;
  ctx.status->rank = s.rank;
  ctx.status->peer = s.peer;
  ctx.status->expected = s.expected;
  ctx.status->seen = s.seen;
  ctx.status->token = s.token;
  ctx.status->slot = s.slot;
  ctx.status->call = s.call;
  if (ctx.host_status != nullptr) {
    volatile DeviceStatus* h = ctx.host_status;  // plain mirror writes; `valid` is released last
    h->code = s.code;
    h->phase = s.phase;
    h->rank = s.rank;
    h->peer = s.peer;
    h->expected = s.expected;
    h->seen = s.seen;
    h->token = s.token;
    h->slot = s.slot;
    h->call = s.call;
    __threadfence_system();
    st_release_sys(&ctx.host_status->valid, 1);
  }
}

// True once this rank recorded an error that ends calls (a timeout: the peers' state is unknown).
// Bad input does not: the call completes without the bad tokens, so no peer waits in vain, and
// the host refuses further eager calls once it has raised the error.
__device__ __forceinline__ bool aborted(const WaitContext& ctx) {
  const StatusCode code{ld_relaxed_sys(&ctx.status->code)};
  return code != StatusCode::kNone && code != StatusCode::kInput;
}

// aborted(), one answer for the whole block: every thread of the block calls it (a kernel's
// entry). Threads that read the status word a moment apart may see it change (a block of this
// rank records a timeout); a thread that returned alone would leave the others at the block's
// next barrier.
__device__ __forceinline__ bool block_aborted(const WaitContext& ctx) {
  return __syncthreads_or(aborted(ctx) ? 1 : 0) != 0;
}

// Ranks this rank has masked (0 when masking is off).
__device__ __forceinline__ uint64_t masked_ranks(const WaitContext& ctx) {
  return ctx.masked == nullptr ? 0 : *reinterpret_cast<volatile unsigned long long*>(ctx.masked);
}

// Masks `peer`: the device word, then the host mirror (rewritten until it holds the device
// word, so that concurrent maskings of different peers all reach it).
__device__ inline void mask_peer(const WaitContext& ctx, int32_t peer) {
  atomicOr(ctx.masked, 1ull << peer);
  if (ctx.host_status == nullptr) return;
  volatile unsigned long long* host = &reinterpret_cast<HostMirror*>(ctx.host_status)->masked;
  for (uint64_t v = masked_ranks(ctx); *host != v; v = masked_ranks(ctx)) {
    *host = v;
    __threadfence_system();
  }
}

enum class PeerWait { kArrived, kMasked, kFailed };

// Spins until pred() holds: kArrived. When the deadline passes: with masking on and a peer to
// blame, masks it (kMasked: the caller goes on without it); else records a timeout (unless
// another error was already recorded) and returns kFailed, as when this rank has already failed.
// A peer masked before the wait is not waited for (kMasked).
template <typename Pred, typename Seen>
__device__ inline PeerWait peer_wait(const WaitContext& ctx, Phase phase, int32_t peer,
                                     int64_t expected, Pred pred, Seen seen) {
  const bool may_mask = ctx.masked != nullptr && peer >= 0 && peer != ctx.rank;
  if (may_mask && ((masked_ranks(ctx) >> peer) & 1)) return PeerWait::kMasked;
  if (pred()) return PeerWait::kArrived;
  const uint64_t start = globaltimer_ns();
  for (uint32_t iter = 1;; ++iter) {
    if (pred()) return PeerWait::kArrived;
    // Back off a little: spinning ranks share the memory system with the ranks still working.
    if (iter > 16) __nanosleep(64);
    if ((iter & 255u) == 0) {
      if (aborted(ctx)) return PeerWait::kFailed;
      if (globaltimer_ns() - start > ctx.timeout_ns) {
        if (may_mask) {
          mask_peer(ctx, peer);
          return PeerWait::kMasked;
        }
        record_error(ctx, StatusCode::kTimeout, phase, peer, expected, seen());
        return PeerWait::kFailed;
      }
    }
  }
}

// peer_wait that never masks: true when pred() came to hold.
template <typename Pred, typename Seen>
__device__ inline bool bounded_wait(WaitContext ctx, Phase phase, int32_t peer, int64_t expected,
                                    Pred pred, Seen seen) {
  ctx.masked = nullptr;
  return peer_wait(ctx, phase, peer, expected, pred, seen) == PeerWait::kArrived;
}

// Barrier over the `num_blocks` blocks of one rank in a kernel (all resident by construction; a
// launch may serve several ranks, each with its own word). Works across launches with different
// grid sizes: `count` returns to 0 at each generation.
__device__ inline bool grid_barrier(GridBarrierWord* bar, int num_blocks, const WaitContext& ctx) {
  __shared__ int32_t ok;
  __syncthreads();
  if (threadIdx.x == 0) {
    const int32_t gen = ld_acquire_sys(&bar->generation);
    __threadfence();
    if (atomic_add_acq_rel_gpu(&bar->count, 1) == num_blocks - 1) {
      bar->count = 0;
      st_release_sys(&bar->generation, gen + 1);
      ok = 1;
    } else {
      ok = bounded_wait(ctx, Phase::kGridBarrier, ctx.rank, gen + 1,
                        [&] { return ld_acquire_sys(&bar->generation) != gen; },
                        [&] { return static_cast<int64_t>(ld_acquire_sys(&bar->generation)); });
    }
  }
  __syncthreads();
  return ok != 0;
}

// Last-block-out ticket over the `num_blocks` blocks of one rank: returns true in exactly one
// block (the last to arrive), after which every block's earlier writes are visible to it.
// Resets itself.
__device__ inline bool last_block(int32_t* ticket, int num_blocks) {
  __shared__ int32_t last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomic_add_acq_rel_gpu(ticket, 1) == num_blocks - 1;
    if (last) *ticket = 0;
  }
  __syncthreads();
  return last != 0;
}

// Epoch `seen` is `want` or later (wrap-around safe: epochs are compared within 2^31 calls).
__device__ __forceinline__ bool epoch_reached(uint32_t seen, uint32_t want) {
  return int32_t(seen - want) >= 0;
}

__device__ __forceinline__ uint32_t lanemask_lt() {
  uint32_t m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

}  // namespace epx::dev
