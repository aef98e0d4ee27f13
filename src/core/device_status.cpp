#include "core/device_status.hpp"

#include <atomic>

#include "epx/error.hpp"

namespace epx {

static_assert(int32_t(StatusCode::kInput) == int32_t(ErrorCode::kInput));
static_assert(int32_t(StatusCode::kTimeout) == int32_t(ErrorCode::kTimeout));
static_assert(int32_t(StatusCode::kPeer) == int32_t(ErrorCode::kPeer));

const char* to_string(Phase p) {
  switch (p) {
    case Phase::kNone: return "none";
    case Phase::kDispatchRoute: return "dispatch/route";
    case Phase::kDispatchCounts: return "dispatch/count-exchange";
    case Phase::kDispatchData: return "dispatch/data-arrival";
    case Phase::kCombineReady: return "combine/partials-ready";
    case Phase::kGridBarrier: return "grid-barrier";
    case Phase::kRingSpace: return "ring-space";
  }
  return "unknown";
}

std::optional<DeviceStatus> recorded_status(DeviceStatus& mirror) {
  if (std::atomic_ref<int32_t>(mirror.valid).load(std::memory_order_acquire) == 0) {
    return std::nullopt;
  }
  // The kernel writes every field before it releases `valid` and never writes them again (the
  // first error wins), so after the acquire above they are complete and stable.
  return mirror;
}

}  // namespace epx
