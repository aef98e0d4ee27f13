#include "core/device_status.hpp"

namespace epx {

const char* to_string(Phase p) {
  switch (p) {
    case Phase::kNone: return "none";
    case Phase::kDispatchRoute: return "dispatch/route";
    case Phase::kDispatchCounts: return "dispatch/count-exchange";
    case Phase::kDispatchData: return "dispatch/data-arrival";
    case Phase::kCombineReady: return "combine/partials-ready";
    case Phase::kGridBarrier: return "grid-barrier";
  }
  return "unknown";
}

}  // namespace epx
