#include <string>

#include "backends/low_latency/low_latency.hpp"
#include "epx/all2all.hpp"
#include "epx/error.hpp"

namespace epx {

std::vector<std::unique_ptr<All2All>> make_all2all_group(Backend backend, EpConfig cfg,
                                                         const InProcessWorld& world,
                                                         LaunchConfigs launch) {
  switch (backend) {
    case Backend::kLowLatency:
      return ll::make_in_process_group(cfg, world, launch);
    case Backend::kNaive:
    case Backend::kAllgatherReduceScatter:
      break;
  }
  EPX_THROW(UnsupportedError, std::string("backend '") + to_string(backend) +
                                  "' is not part of this build yet; available: low_latency");
}

}  // namespace epx
