#pragma once
// SymmetricBuffer: the same number of bytes of device memory on every rank, with every peer's
// base address valid in this rank's kernels. Kernels see only the device handle.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace epx {

class InProcessWorld;
class IpcWorld;
class NcclWorld;

namespace detail {
// What create_ipc() mapped, imported or opened for one buffer (defined in src/transport/ipc.cpp).
struct IpcMappings;
struct IpcMappingsDeleter {
  void operator()(IpcMappings* m) const noexcept;
};
}  // namespace detail

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

  // One process per rank: allocates `bytes` (zeroed; cuMem rounds the allocation up to its
  // granularity) on this rank's GPU, maps every peer's buffer into this process and builds the
  // peer table. Collective over the world: every rank calls it with the same `bytes`, and it
  // returns on every rank once every rank's table is complete.
  // Memory travels as world.handles() says: cuMem allocations exported as POSIX descriptors and
  // passed over the bootstrap's Unix sockets (kPosixFd), or CUDA IPC handles exchanged as bytes
  // (kCudaIpc). A failure on any rank (allocation, export, import, mapping) throws on every
  // rank — the failing rank its own CudaError, the others a PeerError naming it — and releases
  // everything this rank had mapped, imported or opened. InputError when bytes == 0 or the ranks
  // ask for different sizes (naming both).
  // Destruction is local: it releases this rank's mappings of its peers and its own allocation.
  // With kPosixFd a peer that still maps this rank's memory keeps it alive; with kCudaIpc the
  // exporting rank must outlive its peers' use of its buffer (destroy after a barrier).
  static SymmetricBuffer create_ipc(IpcWorld& world, size_t bytes);

  // One process per rank through NCCL (NcclWorld): ncclMemAlloc + ncclCommWindowRegister
  // (collective over the communicator), and the peer table from the window's LSA pointers, so the
  // kernels stay the same. Zeroed, and returned on every rank after a barrier. Needs every rank
  // in the communicator's LSA team (one node over NVLink; UnsupportedError otherwise). The buffer
  // must be destroyed before its world (it deregisters the window on the world's communicator).
  static SymmetricBuffer create_nccl(NcclWorld& world, size_t bytes);

  // Waits for every GPU whose kernels may use this buffer: in an in-process world, every GPU
  // of the world (a peer may still read it, e.g. after a timeout made this rank give up); in a
  // process world, this rank's own (the peers' processes are theirs to wait for: destroy after
  // a barrier). Errors of the devices are left for the caller's next CUDA call. The destructor
  // calls it before freeing anything. The caller's current device is kept.
  void synchronize_devices() const noexcept;

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
  // Set by create_ipc only: owns local_ and the peers' mappings (create_in_process: empty, and
  // local_ is a cudaMalloc of this object).
  std::unique_ptr<detail::IpcMappings, detail::IpcMappingsDeleter> ipc_;
  // Set by create_nccl only: releases the NCCL window and its memory (which is local_).
  std::shared_ptr<void> external_;
  // Set by create_in_process only: the world's distinct GPUs, shared by its buffers.
  std::shared_ptr<const std::vector<int>> group_devices_;
};

}  // namespace epx
