#pragma once
// The device status word: what a kernel records when it cannot finish (timeout, bad input, peer
// failure), arbitrated in device memory and mirrored into mapped host memory so that the host can
// read it at any time without synchronising. Included by host (.cpp) and device (.cu) code.

#include <cstddef>
#include <cstdint>
#include <optional>

namespace epx {

// What a kernel records in DeviceStatus::code. Numbered as the host's ErrorCode (epx/error.hpp;
// device_status.cpp checks that they agree), so that a recorded code reads the same on both sides.
enum class StatusCode : int32_t {
  kNone = 0,     // nothing recorded
  kInput = 2,    // bad input (an expert id): the token was not sent, the call completed
  kTimeout = 3,  // a bounded wait expired: the peers' state is unknown, later calls stop at once
  kPeer = 4,     // a peer disagreed (its round went to another buffer slot): later calls stop
};

enum class Phase : int32_t {
  kNone = 0,
  kDispatchRoute = 1,    // reading topk_ids
  kDispatchCounts = 2,   // waiting for the per-destination token counts of every rank
  kDispatchData = 3,     // waiting for the rows of every rank to arrive
  kCombineReady = 4,     // waiting for every rank's partials to be ready
  kGridBarrier = 5,      // waiting for the other blocks of this rank's own kernel
  kRingSpace = 6,        // high_throughput: waiting for a peer to read a ring this rank writes
};
const char* to_string(Phase p);

// Same layout on host and device.
struct DeviceStatus {
  int32_t code;      // a StatusCode (an int32 so that the device can arbitrate it with atomicCAS)
  int32_t phase;     // a Phase
  int32_t rank;
  int32_t peer;      // the rank waited for, or -1
  int64_t expected;  // what the wait expected (epoch, count) / bound of a bad value
  int64_t seen;      // what it saw
  int32_t token;     // bad-input token index, or -1
  int32_t slot;      // bad-input top-k slot, or -1
  int32_t valid;     // written last (released, 1) once the fields above are complete
  int32_t call;      // the dispatch or combine call (its epoch: 1 = the first) that recorded
                     // it, or 0 where none applies
};
static_assert(sizeof(DeviceStatus) == 48);
static_assert(sizeof(StatusCode) == sizeof(DeviceStatus::code));
// The host reads the mirror's words atomically: each must sit on its natural alignment.
static_assert(offsetof(DeviceStatus, expected) % alignof(int64_t) == 0);
static_assert(offsetof(DeviceStatus, valid) % alignof(int32_t) == 0);

// Mapped host memory of one rank: the status mirror, then what masking (EpConfig::
// mask_failed_ranks) has done, so that the host reads both without synchronising. A kernel gets
// &mirror.status and finds the rest behind it.
struct HostMirror {
  DeviceStatus status;
  unsigned long long masked;   // bit r: this rank masked rank r
  unsigned long long dropped;  // (token, expert) pairs dispatch dropped for masked ranks
};
static_assert(offsetof(HostMirror, status) == 0);

// Host side: the status recorded in the mapped host mirror, once a kernel has completed it
// (an acquire load of `valid`, then the fields it publishes); nullopt while nothing is recorded.
std::optional<DeviceStatus> recorded_status(DeviceStatus& mirror);

}  // namespace epx
