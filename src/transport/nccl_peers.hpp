#pragma once
// Device side of NcclWorld's symmetric memory (src/transport/nccl_peers.cu).

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>

namespace epx::transport {

// peers_dev[r] = rank r's base of the NCCL window `window` (an ncclWindow_t) as this rank's
// kernels address it (its LSA pointer), for r < world_size. Enqueued on `stream`.
void fill_lsa_peer_table(void* window, int world_size, uint8_t** peers_dev, cudaStream_t stream);

// Creates a device communicator with no requirements on `comm` (an ncclComm_t), hands
// ncclDevCommCreate's result to `finish` (which waits for a non-blocking communicator and throws
// on an error), and destroys it again. NCCL refuses a device communicator, whatever the
// requirements, when the communicator has no symmetric memory support (cuMem off, or no direct
// P2P between its ranks) — while ncclCommWindowRegister may still succeed. `create` and `destroy`
// are ncclDevCommCreate and ncclDevCommDestroy, resolved at run time from the NCCL these
// headers describe. Collective over the communicator.
void probe_device_comm(void* comm, void* create, void* destroy,
                       const std::function<void(int result, const char* call)>& finish);

}  // namespace epx::transport
