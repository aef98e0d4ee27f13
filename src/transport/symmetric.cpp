#include "epx/symmetric.hpp"

#include <utility>

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
    bytes_ = std::exchange(o.bytes_, 0);
    rank_ = o.rank_;
    world_size_ = o.world_size_;
    device_ = o.device_;
  }
  return *this;
}

SymmetricBuffer::~SymmetricBuffer() { release(); }

void SymmetricBuffer::release() noexcept {
  if (local_ == nullptr && peers_dev_ == nullptr && !ipc_ && !external_) return;
  int prev = 0;
  (void)cudaGetDevice(&prev);
  (void)cudaSetDevice(device_);
  if (!ipc_ && !external_ && local_ != nullptr) (void)cudaFree(local_);
  if (peers_dev_ != nullptr) (void)cudaFree(peers_dev_);
  // create_ipc: unmaps the peers' buffers and releases this rank's own (it owns local_).
  ipc_.reset();
  external_.reset();  // create_nccl: deregisters the window, frees its memory
  (void)cudaSetDevice(prev);
  local_ = nullptr;
  peers_dev_ = nullptr;
}

std::vector<SymmetricBuffer> SymmetricBuffer::create_in_process(const InProcessWorld& world,
                                                                size_t bytes) {
  const int n = world.size();
  std::vector<SymmetricBuffer> bufs(n);
  std::vector<uint8_t*> bases(n);
  for (int r = 0; r < n; ++r) {
    SymmetricBuffer& b = bufs[r];
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
  EPX_CUDA_CHECK(cudaDeviceSynchronize());
  return bufs;
}

}  // namespace epx
