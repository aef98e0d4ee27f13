// One process per rank, as inference engines run: every rank maps every other rank's buffer
// (IpcWorld + SymmetricBuffer::create_ipc, or NcclWorld + SymmetricBuffer::create_nccl) and
// writes one value into each of them; each rank then checks what its peers wrote into its own
// buffer. IpcWorld ranks may share one GPU; NcclWorld ranks need one GPU each (rank r takes GPU
// r % the visible GPUs).
//
//   build/epx launch -n 4 -- build/example_ipc_ranks            # cuMem + POSIX descriptors
//   build/epx launch -n 2 -- build/example_ipc_ranks cuda-ipc   # CUDA IPC handles
//   build/epx launch -n 8 -- build/example_ipc_ranks nccl       # NCCL windows, LSA pointers
//
// Exit codes: 0 every value arrived, 1 a value is wrong, 2 an epx error, 3 no GPU.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "epx/bootstrap.hpp"
#include "epx/error.hpp"
#include "epx/symmetric.hpp"
#include "epx/world.hpp"

namespace {

// Writes into every peer's buffer, then checks its own; 0 when every value arrived.
int exchange(epx::Bootstrap& boot, const epx::SymmetricBuffer& buf, const char* how,
             int ranks_on_gpu) {
  const int rank = boot.rank(), n = boot.size();
  // The peer table lives on the device (kernels read it); copy it here to write with cudaMemcpy.
  std::vector<uint8_t*> peers(size_t(n), nullptr);
  cudaMemcpy(peers.data(), buf.device_handle().peers, sizeof(uint8_t*) * n, cudaMemcpyDeviceToHost);
  // Rank r puts 1000 * (r + 1) + d into int32 slot r of rank d's buffer.
  for (int d = 0; d < n; ++d) {
    const int32_t v = 1000 * (rank + 1) + d;
    cudaMemcpy(peers[size_t(d)] + sizeof(int32_t) * rank, &v, sizeof(v), cudaMemcpyHostToDevice);
  }
  if (cudaDeviceSynchronize() != cudaSuccess) return 2;
  boot.barrier();  // every rank's writes are done

  std::vector<int32_t> got(size_t(n), 0);
  cudaMemcpy(got.data(), buf.local(), sizeof(int32_t) * n, cudaMemcpyDeviceToHost);
  int wrong = 0;
  for (int q = 0; q < n; ++q) {
    if (got[size_t(q)] != 1000 * (q + 1) + rank) {
      std::printf("rank %d: slot %d holds %d, expected %d\n", rank, q, got[size_t(q)],
                  1000 * (q + 1) + rank);
      ++wrong;
    }
  }
  std::printf("rank %d of %d: %s (%s, %d rank(s) on this GPU)\n", rank, n,
              wrong == 0 ? "OK" : "FAILED", how, ranks_on_gpu);
  boot.barrier();  // nobody releases its buffer while a peer may still write
  return wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) try {
  const char* mode = argc > 1 ? argv[1] : "";
  if (std::strcmp(mode, "nccl") == 0) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      std::fprintf(stderr, "no GPU visible\n");
      return 3;
    }
    const epx::BootstrapOptions opts = epx::BootstrapOptions::from_env();
    cudaSetDevice(opts.rank % count);
    epx::NcclWorld world(std::make_unique<epx::UnixSocketBootstrap>(opts));
    epx::SymmetricBuffer buf = epx::SymmetricBuffer::create_nccl(world, 1 << 20);
    return exchange(world.bootstrap(), buf, "NCCL window", world.ranks_on_device());
  }
  const bool cuda_ipc = std::strcmp(mode, "cuda-ipc") == 0;
  epx::IpcWorld world =
      epx::IpcWorld::from_env(-1, cuda_ipc ? epx::IpcHandles::kCudaIpc : epx::IpcHandles::kAuto);
  epx::SymmetricBuffer buf = epx::SymmetricBuffer::create_ipc(world, 1 << 20);
  const std::string how = std::string(epx::to_string(world.handles())) + " handles";
  return exchange(world.bootstrap(), buf, how.c_str(), world.ranks_on_device());
} catch (const epx::UnsupportedError& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 3;
} catch (const epx::Error& e) {
  std::fprintf(stderr, "%s error: %s\n", epx::to_string(e.code()), e.what());
  return 2;
}
