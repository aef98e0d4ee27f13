// low_latency: each token goes once to each rank that holds one of its experts (deduplicated
// per rank), written straight into the peer's receive area; combine pulls the partials of the
// ranks that got the token and sums them in rank order.
#include "backends/low_latency/low_latency.hpp"

namespace epx::low_latency {

namespace {
const peer::Algorithm kAlgorithm{Backend::kLowLatency, /*every_rank=*/false, /*all_reduce=*/false};
}  // namespace

const peer::Algorithm& algorithm() { return kAlgorithm; }

}  // namespace epx::low_latency
