#include "epx/symmetric.hpp"

#include <algorithm>
#include <utility>

#include "core/device_guard.hpp"
#include "epx/cuda_check.hpp"
#include "epx/world.hpp"

namespace epx {

SymmetricBuffer::SymmetricBuffer(SymmetricBuffer&& o) noexcept { *this = std::move(o); }

SymmetricBuffer& SymmetricBuffer::operator=(SymmetricBuffer&& o) noexcept {
  if (this != &o) {
    release();
    local_ = std::exchange(o.local_, nullptr);
    peers_dev_ = std::exchange(o.peers_dev_, nullptr);
    ipc_ = std::move(o.ipc_);
    external_ = std::move(o.external_);
    group_devices_ = std::move(o.group_devices_);
    bytes_ = std::exchange(o.bytes_, 0);
    rank_ = o.rank_;
    world_size_ = o.world_size_;
    device_ = o.device_;
  }
  return *this;
}

SymmetricBuffer::~SymmetricBuffer() { release(); }

void SymmetricBuffer::synchronize_devices() const noexcept {
  DeviceGuard guard;
  auto wait = [](int d) {
    if (cudaSetDevice(d) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
      (void)cudaGetLastError();  // a failed device is the caller's error to raise, not ours
  };
  if (group_devices_) {
    for (int d : *group_devices_) wait(d);
  } else if (local_ != nullptr || peers_dev_ != nullptr) {
    wait(device_);
  }
}

void SymmetricBuffer::release() noexcept {
  if (local_ == nullptr && peers_dev_ == nullptr && !ipc_ && !external_) return;
  // The peers' kernels (other GPUs of an in-process world) may still read this memory, e.g.
  // after a timeout made this rank give up: every GPU that can reach it finishes first.
  synchronize_devices();
  DeviceGuard guard;
  if (cudaSetDevice(device_) != cudaSuccess) (void)cudaGetLastError();
  if (!ipc_ && !external_ && local_ != nullptr) (void)cudaFree(local_);
  if (peers_dev_ != nullptr) (void)cudaFree(peers_dev_);
  // create_ipc: unmaps the peers' buffers and releases this rank's own (it owns local_).
  ipc_.reset();
  external_.reset();  // create_nccl: deregisters the window, frees its memory
  group_devices_.reset();
  local_ = nullptr;
  peers_dev_ = nullptr;
}

std::vector<SymmetricBuffer> SymmetricBuffer::create_in_process(const InProcessWorld& world,
                                                                size_t bytes) {
  const int n = world.size();
  DeviceGuard guard;
  // The world's distinct GPUs: every one of them may read any rank's buffer.
  auto devices = std::make_shared<std::vector<int>>();
  for (int r = 0; r < n; ++r) {
    const int d = world.device_of(r);
    if (std::find(devices->begin(), devices->end(), d) == devices->end()) devices->push_back(d);
  }
  std::vector<SymmetricBuffer> bufs(n);
  std::vector<uint8_t*> bases(n);
  for (int r = 0; r < n; ++r) {
    SymmetricBuffer& b = bufs[r];
    b.group_devices_ = devices;
    b.rank_ = r;
    b.world_size_ = n;
    b.device_ = world.device_of(r);
    b.bytes_ = bytes;
    EPX_CUDA_CHECK(cudaSetDevice(b.device_));
    EPX_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.local_), bytes));
    EPX_CUDA_CHECK(cudaMemset(b.local_, 0, bytes));
    EPX_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.peers_dev_), sizeof(uint8_t*) * n));
    bases[r] = b.local_;
  }
  // In one process with peer access enabled, a device pointer is valid on every device.
  for (int r = 0; r < n; ++r) {
    EPX_CUDA_CHECK(cudaSetDevice(bufs[r].device_));
    EPX_CUDA_CHECK(cudaMemcpy(bufs[r].peers_dev_, bases.data(), sizeof(uint8_t*) * n,
                              cudaMemcpyHostToDevice));
  }
  // A pageable copy may return before it lands, and the zeroing above is asynchronous: every
  // device the tables and buffers live on finishes before any rank's kernel (on a stream of its
  // own) can read them.
  for (int d : *devices) {
    EPX_CUDA_CHECK(cudaSetDevice(d));
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
  }
  return bufs;
}

}  // namespace epx
