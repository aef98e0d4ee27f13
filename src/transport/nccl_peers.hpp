#pragma once
// Device side of NcclWorld's symmetric memory (src/transport/nccl_peers.cu).

#include <cuda_runtime_api.h>

#include <cstdint>

namespace epx::transport {

// peers_dev[r] = rank r's base of the NCCL window `window` (an ncclWindow_t) as this rank's
// kernels address it (its LSA pointer), for r < world_size. Enqueued on `stream`.
void fill_lsa_peer_table(void* window, int world_size, uint8_t** peers_dev, cudaStream_t stream);

}  // namespace epx::transport
