// allgather_reducescatter: dispatch all-gathers every token (with ids and weights) to every
// rank; combine is a reduce-scatter: each rank pulls its own tokens' rows from every rank and sums
// them in rank order. The yardstick of vLLM's allgather_reducescatter all2all backend.
#include "backends/allgather_reducescatter/allgather_reducescatter.hpp"

namespace epx::allgather_reducescatter {

namespace {
const peer::Algorithm kAlgorithm{Backend::kAllgatherReduceScatter, /*every_rank=*/true, /*all_reduce=*/false};
}  // namespace

const peer::Algorithm& algorithm() { return kAlgorithm; }

}  // namespace epx::allgather_reducescatter
