#pragma once
// The device status word: what a kernel records when it cannot finish (timeout, bad input, peer
// failure), arbitrated in device memory and mirrored into mapped host memory so that the host can
// read it at any time without synchronising.

#include <cstdint>

namespace epx {

enum class Phase : int32_t {
  kNone = 0,
  kDispatchRoute = 1,    // reading topk_ids
  kDispatchCounts = 2,   // waiting for the per-destination token counts of every rank
  kDispatchData = 3,     // waiting for the rows of every rank to arrive
  kCombineReady = 4,     // waiting for every rank's partials to be ready
  kGridBarrier = 5,      // waiting for the other blocks of this rank's own kernel
};
const char* to_string(Phase p);

// Same layout on host and device. `code` holds an ErrorCode value.
struct DeviceStatus {
  int32_t code;
  int32_t phase;
  int32_t rank;
  int32_t peer;      // the rank waited for, or -1
  int64_t expected;  // what the wait expected (epoch, count) / bound of a bad value
  int64_t seen;      // what it saw
  int32_t token;     // bad-input token index, or -1
  int32_t slot;      // bad-input top-k slot, or -1
  int32_t valid;     // written last (1) once the fields above are complete
  int32_t call;      // the dispatch or combine call (its epoch: 1 = the first) that recorded
                     // it, or 0 where none applies
};
static_assert(sizeof(DeviceStatus) == 48);

}  // namespace epx
