#pragma once
// The deterministic "expert" used by checks: bit-identical on the device to
// ref::identity_partials (token-major) and ref::identity_expert_outputs (expert-major), so
// dispatch -> expert -> combine can run inside a CUDA graph and still be checked exactly.

#include <cuda_runtime_api.h>

#include "epx/all2all.hpp"

namespace epx::testing {

// Token-major: partials[j] = bf16(sum over local k of fmaf(w_k, value(row j), acc)).
// Expert-major: out[e][i] = bf16(value(expert row i of e)). `out` is [capacity, H] or
// [E/W, capacity, H] bf16. Reads the row count(s) from the device, so it is graph-safe.
// Loads the kernel now: a first launch while ranks' kernels spin could wait on them forever.
void preload_identity_expert();
void launch_identity_expert(const EpConfig& cfg, const DispatchResult& d, void* out,
                            cudaStream_t stream);

// Under capture of `stream`: the identity expert inside a conditional SWITCH node, as the MoE
// layer's captured expert stage runs its GEMMs (body 1 when the dispatch received rows, body 0
// empty; the condition is set on the device from recv_count). `side` records the body (it runs
// nothing). StateError when `stream` is not capturing.
void capture_identity_expert_switch(const EpConfig& cfg, const DispatchResult& d, void* out,
                                    cudaStream_t stream, cudaStream_t side);

}  // namespace epx::testing
