#pragma once
// Launch parameters of the peer engine's dispatch and combine kernels and their launchers
// (host-callable, defined in dispatch.cu and combine.cu). One params struct per kernel (STYLE §7);
// everything trivially copyable.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

#include "backends/common/phase_clock.hpp"
#include "backends/peer/layout.hpp"
#include "core/device_status.hpp"
#include "epx/config.hpp"

namespace epx::peer {

// What every rank of a launch shares.
struct Shape {
  int32_t world;
  int32_t hidden;
  int32_t num_experts;
  int32_t num_local;
  int32_t topk;
  int32_t max_tokens;
  int32_t capacity;
  int32_t groups;            // hidden / kFp8BlockSize: fp8 scale blocks per row
  int32_t expert_major;      // output layout
  int32_t scale_col_major;   // recv scale layout
  int32_t wire_row_bytes;
  int32_t every_rank;        // dispatch every valid token to every rank
  int32_t all_reduce;        // combine by all-reduce + slice
  int32_t ordered;           // rows ordered by (source rank, source index): counts exchanged first
  int32_t mask_failed;       // EpConfig::mask_failed_ranks
  int32_t push;              // combine pushes the partials (Layout::pushed)
  int32_t round_scale;       // EpConfig::round_scale: power-of-two fp8 scales
  int32_t logfmt;            // EpConfig::combine_format: partials cross as LogFMT-10 rows
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

// The phases of each op that the phase clock (EPX_PHASE_CLOCK, backends/common/phase_clock.hpp)
// times: op 0 dispatch, op 1 combine.
enum class DispatchPhase : int { kRouted, kPlaced, kMetadata, kPayload, kSignalled, kReceived,
                                 kDone, kCount };
enum class CombinePhase : int { kPublished, kWaited, kPulled, kCount };
static_assert(kMaxPhaseOps >= 2 && int(DispatchPhase::kCount) <= kMaxPhases &&
              int(CombinePhase::kCount) <= kMaxPhases);
#endif

// One launch serves `num_ranks` ranks that share a GPU (an in-process group), each with
// gridDim.x / num_ranks consecutive blocks; a rank with a GPU of its own launches alone.
inline constexpr int kMaxLaunchRanks = 32;  // ranks per GPU (CUDA_DEVICE_MAX_CONNECTIONS <= 32)

// Which part of an op a launch runs: both halves, or one (compute may run between them). The
// send half of either op never waits for a peer, so the halves of several ranks may even be
// enqueued one after another on one stream (all sends, then all receives).
enum class Half : int32_t {
  kWhole = 0,
  kSend = 1,     // dispatch: route, send, signal; combine: publish the partials
  kReceive = 2,  // dispatch: wait, then counts / expert rows; combine: wait, then pull and sum
};

struct LaunchCommon {
  uint8_t* const* peers;  // device array [W]: every rank's buffer, valid on this GPU
  Layout layout;          // with the per-slot areas of `slot` (Layout::for_slot)
  int32_t slot;           // the buffer slot of this call's round (rounds in flight)
  Shape shape;
  uint64_t timeout_ns;
  int32_t num_ranks;  // ranks served by this launch
  Half half;
#if EPX_MEASUREMENT
  PhaseClock* clock;  // EPX_PHASE_CLOCK: the phase sums of this launch, else null
#endif
};

struct DispatchRank {
  uint8_t* local;             // this rank's buffer (== peers[rank])
  DeviceStatus* host_status;  // mapped host mirror of its status word
  int32_t rank;
  int32_t num_tokens;
  const void* x;
  const float* x_scales;
  const void* topk_ids;
  const float* topk_weights;
};

struct DispatchParams {
  LaunchCommon common;
  int32_t ids_int64;
  DispatchRank ranks[kMaxLaunchRanks];
};

struct CombineRank {
  uint8_t* local;
  DeviceStatus* host_status;
  int32_t rank;
  const void* expert_out;  // token-major partials [cap][H] bf16 or expert outputs [E/W][cap][H]
  void* y;                 // [N][H] bf16
};

struct CombineParams {
  LaunchCommon common;
  CombineRank ranks[kMaxLaunchRanks];
};

// Kernels take their params as __grid_constant__ values: trivially copyable, within the 4 KiB of
// kernel arguments every CUDA version accepts.
static_assert(std::is_trivially_copyable_v<DispatchParams> && sizeof(DispatchParams) <= 4096);
static_assert(std::is_trivially_copyable_v<CombineParams> && sizeof(CombineParams) <= 4096);

// Expert-major dispatch keeps one int32 counter per local expert in shared memory: at most the
// 48 KiB a kernel gets without opting in to more.
inline constexpr int kMaxExpertMajorLocal = 12 * 1024;
static_assert(kMaxExpertMajorLocal * sizeof(int32_t) <= 48 * 1024);

// Load the kernels of dispatch.cu / combine.cu on the current device (cudaFuncGetAttributes).
void load_dispatch_kernels();
void load_combine_kernels();
// Both, on `device`. With lazy module loading (the CUDA default), the first launch of a kernel
// loads its module and waits for the work already running on the device: if that work is
// another rank's kernel spinning on this one, the two wait for each other. Load up front.
void preload_kernels(int device);
// `lc` is one rank's shape: the grid is p.common.num_ranks times lc.num_blocks.
void launch_dispatch(const DispatchParams& p, DispatchDtype dtype, LaunchConfig lc,
                     cudaStream_t stream);
void launch_combine(const CombineParams& p, LaunchConfig lc, cudaStream_t stream);

}  // namespace epx::peer
