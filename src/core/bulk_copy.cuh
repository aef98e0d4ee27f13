#pragma once
// Bulk copies from shared to global memory (cp.async.bulk, sm_90): the copy runs in the async
// proxy, so the generic writes that fill the source are fenced for it (fence_proxy_async) before
// the barrier that precedes the copy, and the copied rows are fenced back (fence_proxy_async
// after bulk_wait_all) before a generic release publishes them. Each thread commits and waits for
// its own groups. Included by .cu files only.

#include <cstdint>

namespace epx::dev {

// `bytes` (a multiple of 16) from shared `src` to global `dst`, both 16-byte aligned, into the
// thread's open bulk group.
__device__ __forceinline__ void bulk_copy_to_global(void* dst, const void* src, uint32_t bytes) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(src));
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(s),
               "r"(bytes)
               : "memory");
}

// Closes the thread's open bulk group (an empty group is allowed).
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Until at most kPending of the thread's most recent groups have still to read their sources.
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

// Until every group of the thread is complete (its writes done).
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// Orders the thread's generic accesses (all state spaces) with its async-proxy operations.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async;" ::: "memory");
}

}  // namespace epx::dev
