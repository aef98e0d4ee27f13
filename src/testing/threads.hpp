#pragma once
// One host thread per rank or per GPU, for calls that wait on the host for their peers: a
// high_throughput dispatch sized per call synchronises its stream until every peer's counts have
// arrived, so the ranks (or GPUs, with one launch per GPU) of one process must be called from
// threads of their own — in turn from one thread, the first waits for a peer not yet launched.
// Shared by the correctness harness and the measuring commands.

#include <cuda_runtime_api.h>

#include <cstdio>
#include <exception>
#include <functional>
#include <future>
#include <vector>

#include "epx/cuda_check.hpp"

namespace epx::testing {

// fn(i) for every i in [0, n), all at once, each on a thread of its own with CUDA device
// device_of(i) current. Returns when every call has returned; then rethrows the exception of
// the lowest i that threw, if any.
inline void run_on_threads(int n, const std::function<int(int)>& device_of,
                           const std::function<void(int)>& fn) {
  std::vector<std::future<void>> done;
  done.reserve(size_t(n));
  for (int i = 0; i < n; ++i) {
    done.push_back(std::async(std::launch::async, [&, i] {
      EPX_CUDA_CHECK(cudaSetDevice(device_of(i)));
      fn(i);
    }));
  }
  std::exception_ptr first;
  for (int i = 0; i < n; ++i) {
    try {
      done[size_t(i)].get();
    } catch (const std::exception& e) {
      // The first failure is rethrown; a later rank's own error (often the cause of an earlier
      // rank's timeout) is printed, not lost.
      if (!first) {
        first = std::current_exception();
      } else {
        std::fprintf(stderr, "run_on_threads: thread %d failed too: %s\n", i, e.what());
      }
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace epx::testing
