#pragma once
// Internal CUDA helpers on top of the public EPX_CUDA_CHECK (epx/cuda_check.hpp).

#include "epx/cuda_check.hpp"

namespace epx {
// Ends the capture on `stream` and instantiates the graph it recorded (the graph itself is
// destroyed either way); CudaError when either step fails.
inline cudaGraphExec_t end_capture_and_instantiate(cudaStream_t stream) {
  cudaGraph_t graph = nullptr;
  EPX_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
  (void)cudaGraphDestroy(graph);
  EPX_CUDA_CHECK(err);
  return exec;
}
}  // namespace epx
