#pragma once
// SymmetricBuffer: the same number of bytes of device memory on every rank, with every peer's
// base address valid in this rank's kernels. Kernels see only the device handle.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace epx {

class InProcessWorld;

struct SymmetricHandle {
  // peers[r] = base of rank r's buffer as addressable from this rank's device.
  uint8_t* const* peers;  // device array [world_size]
  uint8_t* local;         // == peers[rank]
  int rank;
  int world_size;
};

class SymmetricBuffer {
 public:
  using DeviceHandle = SymmetricHandle;

  SymmetricBuffer() = default;
  SymmetricBuffer(SymmetricBuffer&&) noexcept;
  SymmetricBuffer& operator=(SymmetricBuffer&&) noexcept;
  SymmetricBuffer(const SymmetricBuffer&) = delete;
  SymmetricBuffer& operator=(const SymmetricBuffer&) = delete;
  ~SymmetricBuffer();

  // Allocates `bytes` (zeroed) on every rank of an in-process world and builds the peer tables.
  // Collective over the whole world; returns one buffer per rank.
  static std::vector<SymmetricBuffer> create_in_process(const InProcessWorld& world, size_t bytes);

  DeviceHandle device_handle() const { return {peers_dev_, local_, rank_, world_size_}; }
  uint8_t* local() const { return local_; }
  size_t bytes() const { return bytes_; }
  int device() const { return device_; }

 private:
  void release() noexcept;

  uint8_t* local_ = nullptr;
  uint8_t** peers_dev_ = nullptr;
  size_t bytes_ = 0;
  int rank_ = 0;
  int world_size_ = 0;
  int device_ = 0;
};

}  // namespace epx
