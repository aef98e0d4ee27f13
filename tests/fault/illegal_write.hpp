#pragma once
// The kernel fault of the fault matrix: one thread writes to an address that no allocation
// holds, so the launching process's CUDA context fails with an illegal-address error (and
// stays failed), as a crashing expert kernel would leave it.

#include <cuda_runtime_api.h>

namespace epx::fault {

// Loads the kernel now: a first launch while this rank's own kernels spin would wait for them
// (lazy module loading).
void preload_illegal_write();
// Enqueues the faulting kernel on `stream`; returns what the launch itself reported.
cudaError_t launch_illegal_write(cudaStream_t stream);

}  // namespace epx::fault
