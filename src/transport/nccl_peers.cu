// The peer table of an NCCL window: LSA pointers from NCCL's device API (header-only device
// functions; nothing links against libnccl here).

#include <nccl.h>
#include <nccl_device.h>

#include <memory>
#include <new>

#include "epx/cuda_check.hpp"
#include "transport/nccl_peers.hpp"

namespace epx::transport {
namespace {

__global__ void lsa_peer_table_kernel(ncclWindow_t win, int world_size, uint8_t** peers) {
  for (int r = threadIdx.x; r < world_size; r += blockDim.x)
    peers[r] = static_cast<uint8_t*>(ncclGetPeerPointer(win, 0, r));
}

}  // namespace

void fill_lsa_peer_table(void* window, int world_size, uint8_t** peers_dev, cudaStream_t stream) {
  lsa_peer_table_kernel<<<1, 64, 0, stream>>>(static_cast<ncclWindow_t>(window), world_size,
                                              peers_dev);
  EPX_CUDA_CHECK(cudaGetLastError());
}

void probe_device_comm(void* comm, void* create, void* destroy,
                       const std::function<void(int result, const char* call)>& finish) {
  using Create = ncclResult_t (*)(ncclComm_t, const ncclDevCommRequirements*, ncclDevComm*);
  using Destroy = ncclResult_t (*)(ncclComm_t, const ncclDevComm*);
  // The library may be a later patch than the headers, with larger structs than these: both
  // live in zeroed heap blocks with room to spare, so that its writes past our idea of
  // ncclDevComm (or its reads past ncclDevCommRequirements) land in them, never on the stack.
  struct alignas(64) Room {
    unsigned char bytes[64 * 1024];
  };
  static_assert(sizeof(ncclDevComm) <= sizeof(Room));
  static_assert(sizeof(ncclDevCommRequirements) <= sizeof(Room));
  const auto reqs_room = std::make_unique<Room>();  // value-initialised: zeros
  const auto dev_room = std::make_unique<Room>();
#ifdef NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER
  auto* reqs =
      new (reqs_room->bytes) ncclDevCommRequirements(NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER);
#else
  auto* reqs = new (reqs_room->bytes) ncclDevCommRequirements{};  // 2.28: no barriers, no GIN
#endif
  auto* dev = new (dev_room->bytes) ncclDevComm{};
  const auto c = static_cast<ncclComm_t>(comm);
  finish(int(reinterpret_cast<Create>(create)(c, reqs, dev)), "ncclDevCommCreate");
  (void)reinterpret_cast<Destroy>(destroy)(c, dev);
}

}  // namespace epx::transport
