#pragma once
// What the all-to-all measuring commands (bench, tune) share: the flags (flags.hpp), the
// figures and stamps of a report (figures.hpp, report.hpp), and, in CUDA builds, the inputs on
// the device (device_inputs.hpp), the copy bandwidth and the timing method of DESIGN §8.
//
// Timing method: a main stream forks to one non-blocking stream per rank (event recorded on the
// main stream, every rank stream waits on it), each rank's op is enqueued on its own stream, and
// the main stream joins them again (an event per rank stream, the main stream waits on all).
// Graph mode captures that fork/join once per op (all ranks' dispatches in one graph, all ranks'
// combines in another) and replays it; eager mode enqueues the same pattern every round. Per
// round, on the main stream: event a, dispatch, event b, combine, event c; dispatch time = b - a,
// combine time = c - b. Rounds are enqueued back to back and the host synchronises once at the
// end, so the host stays ahead of the GPU in graph mode; eager figures include the host's
// launch cost of W ranks' calls, which is what eager mode costs an engine.

#include "figures.hpp"
#include "flags.hpp"
#include "report.hpp"

#include <cstddef>

namespace epx::cli {

// Device-to-device copy bandwidth: median of `repeats` copies of `bytes`, counting each byte
// read and written (2 x bytes per copy).
struct CopyBandwidth {
  size_t bytes = 0;
  int repeats = 0;
  double median_us = 0;
  double gbps = 0;
};

}  // namespace epx::cli

namespace epx::cli {

// The timing modes of `epx bench` (named in its flags and reports, CUDA build or not).
enum class TimingMode { kGraph, kEager };
inline const char* to_string(TimingMode m) { return m == TimingMode::kGraph ? "graph" : "eager"; }

// How the ranks of an in-process world launch their ops: the ranks of each GPU in one kernel
// (dispatch_group / combine_group: what a rank with a GPU of its own pays), or every rank its
// own kernel on its own stream, forked and joined (the cost of fanning out W launches).
enum class LaunchMode { kOnePerGpu, kPerRank };
inline const char* to_string(LaunchMode m) {
  return m == LaunchMode::kOnePerGpu ? "one_per_gpu" : "per_rank";
}

}  // namespace epx::cli

#if EPX_HAVE_CUDA
#include <cuda_runtime_api.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "device_inputs.hpp"
#include "epx/all2all.hpp"
#include "epx/cuda_check.hpp"

namespace epx {
class Bootstrap;
class InProcessWorld;
}  // namespace epx

namespace epx::cli {

// The copy bandwidth of `device` (CopyBandwidth).
CopyBandwidth measure_copy_bandwidth(int device, size_t bytes, int repeats);

// The main stream, one non-blocking stream per rank, and the fork/join events between them.
class ForkJoin {
 public:
  explicit ForkJoin(const InProcessWorld& world);
  ~ForkJoin();
  ForkJoin(const ForkJoin&) = delete;
  ForkJoin& operator=(const ForkJoin&) = delete;

  cudaStream_t main() const { return main_; }
  int main_device() const { return main_device_; }
  cudaStream_t rank(int r) const { return streams_[r]; }
  int device_of(int r) const { return devices_[r]; }
  int size() const { return int(streams_.size()); }
  // Enqueues on the main stream: fork -> op(r, stream_r) on every rank -> join. No allocation
  // or synchronous CUDA call happens between the first and the last rank's op. With
  // `thread_per_rank` every op(r) runs at once on a host thread of its own (rank r's GPU
  // current): for ops that wait on the host for their peers (high_throughput sized per call),
  // which from one thread would wait for a peer whose op is not yet enqueued.
  void run(const std::function<void(int, cudaStream_t)>& op, bool thread_per_rank = false);
  // Waits for every stream, ignoring errors (used after a failure, before freeing memory).
  void drain() noexcept;

 private:
  void release() noexcept;
  int main_device_ = 0;
  cudaStream_t main_ = nullptr;
  cudaEvent_t fork_ = nullptr;
  std::vector<int> devices_;
  std::vector<cudaStream_t> streams_;
  std::vector<cudaEvent_t> joins_;
};

// The harness's own floor: the median time of the same fork/join, captured as a graph, with a
// 16-byte memset per rank in place of the op. What an op costs above it is the op's.
double time_fork_join_floor(ForkJoin& fj, int warmup, int iters);



struct RoundSamples {
  std::vector<double> dispatch_us;
  std::vector<double> combine_us;
};

using Group = std::vector<std::unique_ptr<All2All>>;

// `warmup` untimed then `iters` timed dispatch+combine rounds of every rank, with the method
// described at the top of this file (kPerRank), or with one launch per GPU per op (kOnePerGpu:
// on the main stream when every rank shares its GPU, else forked to each GPU's first rank
// stream; when a dispatch waits on the host for its peers — high_throughput sized per call —
// each GPU's launches are enqueued from a host thread of their own). The expert stage is skipped: combine reads whatever its buffer holds. Throws what the
// backend throws (the group is then unusable); the streams are drained before the exception
// leaves.
RoundSamples time_rounds(Group& group, const DeviceInputs& inputs, ForkJoin& fj, TimingMode mode,
                         LaunchMode launch, int warmup, int iters);

// One process of an IPC world: `warmup` untimed then `iters` timed dispatch+combine rounds of
// this rank's object on `stream`, with events on that stream (a, dispatch, b, combine, c) and, in
// graph mode, one graph per op captured on it. Every round begins with an all-gather on the
// bootstrap after the previous round has finished on the device: the barrier that makes the ranks
// start each round together (its skew, tens of microseconds between processes, is part of what
// a rank waits for), and the way an error on any rank ends the loop on every rank at the same
// round. Returns "" and fills `out`, or returns the first failing rank's error ("rank r: ...").
// Errors of the bootstrap itself propagate: the job cannot go on.
std::string time_rank_rounds(All2All& a2a, const DispatchInput& input, void* y, cudaStream_t stream,
                             Bootstrap& boot, TimingMode mode, int warmup, int iters,
                             RoundSamples& out);
// The same rounds for any pair of ops enqueued on `stream` (NCCL's collectives, the yardstick);
// `synchronize` waits for the stream and raises what went wrong.
std::string time_op_rounds(const std::function<void()>& dispatch,
                           const std::function<void()>& combine,
                           const std::function<void()>& synchronize, cudaStream_t stream,
                           Bootstrap& boot, TimingMode mode, int warmup, int iters,
                           RoundSamples& out);

}  // namespace epx::cli
#endif  // EPX_HAVE_CUDA
