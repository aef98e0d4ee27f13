#pragma once
// Launch parameters of the peer-to-peer dispatch/combine kernels and their launchers (host-callable, defined in
// kernels.cu). One params struct per kernel (STYLE §7); everything trivially copyable.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "backends/peer/layout.hpp"
#include "core/device_status.hpp"
#include "epx/config.hpp"
#include "epx/symmetric.hpp"

namespace epx::peer {

struct Shape {
  int32_t world;
  int32_t rank;
  int32_t hidden;
  int32_t num_experts;
  int32_t num_local;
  int32_t topk;
  int32_t max_tokens;
  int32_t capacity;
  int32_t groups;            // hidden / 128
  int32_t expert_major;      // output layout
  int32_t scale_col_major;   // recv scale layout
  int32_t wire_row_bytes;
  int32_t every_rank;        // dispatch every valid token to every rank
  int32_t all_reduce;        // combine by all-reduce + slice
#if EPX_MEASUREMENT
  int32_t ablate;            // kAblate* bits: stages left out to time the rest (wrong results)
#endif
};

#if EPX_MEASUREMENT
// Measuring aids of a measurement build (CMake EPX_MEASUREMENT_BUILD; a release build has neither
// the switches nor their branches): EPX_ABLATE leaves one stage out so that a benchmark can
// attribute time. Results are wrong by design; never set outside measurements.
inline constexpr int32_t kAblatePayload = 1;  // dispatch writes metadata but no rows
inline constexpr int32_t kAblatePull = 2;     // combine reads no partials (y = 0)

// Parses EPX_ABLATE ("", "payload", "pull", "payload,pull"); ConfigError names the bad item.
int32_t ablate_from_env();
#endif

struct Waits {
  DeviceStatus* host_status;  // mapped host mirror
  uint64_t timeout_ns;
};

struct DispatchParams {
  SymmetricHandle sym;
  Layout layout;
  Shape shape;
  Waits waits;
  int32_t num_tokens;
  const void* x;
  const float* x_scales;
  const void* topk_ids;
  int32_t ids_int64;
  const float* topk_weights;
};

struct CombineParams {
  SymmetricHandle sym;
  Layout layout;
  Shape shape;
  Waits waits;
  const void* expert_out;  // token-major partials [cap][H] bf16 or expert outputs [E/W][cap][H]
  void* y;                 // [N][H] bf16
};

// Loads every kernel of this file on `device` (see kernels.cu: lazy loading can deadlock ranks).
void preload_kernels(int device);
void launch_dispatch(const DispatchParams& p, DispatchDtype dtype, LaunchConfig lc,
                     cudaStream_t stream);
void launch_combine(const CombineParams& p, LaunchConfig lc, cudaStream_t stream);

}  // namespace epx::peer
