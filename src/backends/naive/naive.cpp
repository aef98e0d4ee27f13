// naive: every rank broadcasts every token (with ids and weights) to every rank; combine is an
// all-reduce of all rows' partials (reduce-scatter + all-gather over the peers' buffers), after
// which each rank takes its own tokens' rows. The yardstick of vLLM's naive all2all backend.
#include "backends/naive/naive.hpp"

namespace epx::naive {

namespace {
const peer::Algorithm kAlgorithm{Backend::kNaive, /*every_rank=*/true, /*all_reduce=*/true};
}  // namespace

const peer::Algorithm& algorithm() { return kAlgorithm; }

}  // namespace epx::naive
