#pragma once
// CUDA graph capture for the check harness, the measuring commands and the GPU tests: one way to
// end a capture into an executable graph, and one way to leave a capture that an exception
// interrupted.

#include <functional>

#include "epx/cuda_check.hpp"

namespace epx::testing {

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

// Ends a capture that an exception interrupted, so that `stream` is usable again: the graph, if
// any, is dropped and the error it left is cleared. Never throws.
inline void abandon_capture(cudaStream_t stream) noexcept {
  cudaGraph_t dropped = nullptr;
  if (cudaStreamEndCapture(stream, &dropped) == cudaSuccess && dropped) (void)cudaGraphDestroy(dropped);
  (void)cudaGetLastError();
}

// Captures what `body` enqueues on `stream` (and on streams forked from it, thread-local capture
// mode) into an executable graph. When `body` throws, the capture is abandoned and the exception
// goes on.
inline cudaGraphExec_t capture_graph(cudaStream_t stream, const std::function<void()>& body) {
  EPX_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    body();
  } catch (...) {
    abandon_capture(stream);
    throw;
  }
  return end_capture_and_instantiate(stream);
}

}  // namespace epx::testing
