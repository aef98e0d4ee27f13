#pragma once
// The host side of one rank's device status, shared by every backend's All2All: the mapped host
// mirror the kernels write (status word, masking), the first error raised from it, the refusal of
// later calls, and the host checks of device pointers.

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/device_status.hpp"
#include "epx/config.hpp"

namespace epx {

class RankStatus {
 public:
  RankStatus(const EpConfig& cfg, int device);
  ~RankStatus();
  RankStatus(const RankStatus&) = delete;
  RankStatus& operator=(const RankStatus&) = delete;

  // The mirror as kernels address it (mapped host memory: &HostMirror::status).
  DeviceStatus* device_mirror() const { return mirror_dev_; }
  uint64_t masked() const;
  uint64_t dropped() const;
  void clear_masked();

  // StateError once an error was raised: the object must be recreated.
  void check_usable() const;
  // Throws the error the device recorded, once (later calls: check_usable's StateError).
  void poll();
  // As poll(), but only for errors that end calls (timeouts, peers); bad input stays recorded for
  // the next poll() (its call still completes on every rank).
  void poll_fatal();
  // InputError unless `p` is a non-null device pointer on this rank's GPU aligned to `align`.
  void check_ptr(const void* p, const char* name, size_t align) const;
  // Records an error found on the host (a watchdog) as a kernel would: the next poll() raises
  // it. Ignored when an error is recorded already (the first wins).
  void record_from_host(StatusCode code, Phase phase, int64_t expected, int64_t seen);

 private:
  [[noreturn]] void raise(const DeviceStatus& s) const;

  EpConfig cfg_;
  int device_;
  DeviceStatus* mirror_ = nullptr;      // a HostMirror
  DeviceStatus* mirror_dev_ = nullptr;  // its device address
  bool failed_ = false;
  std::string first_error_;
};

}  // namespace epx
