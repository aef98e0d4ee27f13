#pragma once
// Shared by `epx bench`, `epx tune` and `epx serve-bench`: the flags (flags.hpp), the byte volumes of DESIGN §8 (no
// CUDA), and, in CUDA builds, the timing method of DESIGN §8.
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

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "epx/config.hpp"
#include "flags.hpp"
#include "reference/reference.hpp"

#if EPX_HAVE_CUDA
#include <cuda_runtime_api.h>

#include <functional>

#include "epx/all2all.hpp"
#include "epx/cuda_check.hpp"
#endif

namespace epx {
class Bootstrap;
class InProcessWorld;
}

namespace epx::cli {

// ---- figures (no CUDA) -------------------------------------------------------------------------

// Bytes of token payload of one op over all ranks (DESIGN §8), from the host routing:
//  crossing  : rows that go between distinct ranks after per-rank dedup;
//  algorithm : the same rows plus those a rank sends to itself;
//  floor     : fewest bytes the op moves through HBM on one GPU (each input row read once, each
//              output row written once). The low_latency dedup volume, used for every backend.
struct OpBytes {
  int64_t crossing = 0;
  int64_t algorithm = 0;
  int64_t floor = 0;
};
struct Volumes {
  int64_t tokens = 0;         // over all ranks
  int64_t rows_crossing = 0;  // (token, destination rank != source) pairs
  int64_t rows_self = 0;      // (token, its own rank) pairs
  int64_t wire_row_bytes = 0;  // dispatched row: payload + fp8 scales
  OpBytes dispatch;
  OpBytes combine;
};
Volumes compute_volumes(const EpConfig& cfg, const std::vector<ref::Routing>& routings);

struct Stats {
  int samples = 0;
  double median_us = 0;
  double p90_us = 0;  // nearest-rank 90th percentile
  double min_us = 0;
  double mean_us = 0;
};
Stats summarize(std::vector<double> us);

// GB/s (1e9 bytes per second) of `bytes` moved in `us` microseconds, divided by `ranks`.
double gbps(int64_t bytes, double us, int ranks = 1);

// Compile-time `git describe --always --dirty` of the source tree ("unknown" without git).
const char* git_commit();
std::string host_name();
std::string utc_timestamp();

// Progress line on stdout, flushed at once (long runs).
void progress(const std::string& line);

// ---- GPU side ----------------------------------------------------------------------------------
#if EPX_HAVE_CUDA

struct GpuInfo {
  std::string name;
  int sm_count = 0;
  int gpu_count = 0;
  int runtime_version = 0;
  int driver_version = 0;
};
// The "machine" object of the bench and serve-bench JSON.
nlohmann::json machine_json(const GpuInfo& gpu);
GpuInfo gpu_info(int device);

// Device-to-device copy bandwidth: median of `repeats` copies of `bytes`, counting each byte
// read and written (2 x bytes per copy).
struct CopyBandwidth {
  size_t bytes = 0;
  int repeats = 0;
  double median_us = 0;
  double gbps = 0;
};
CopyBandwidth measure_copy_bandwidth(int device, size_t bytes, int repeats);

// Random inputs of every rank for one token count, on the device, uploaded once; y is the
// combine output. Only the routing stays on the host (for the byte volumes). The inputs depend
// only on (cfg, tokens, routing, seed), so every world gets the same ones.
class DeviceInputs {
 public:
  // Every rank of an in-process world, each on its own GPU.
  DeviceInputs(const InProcessWorld& world, const EpConfig& cfg, int tokens,
               ref::RoutingKind routing, uint64_t seed);
  // One process of an IPC world: only rank `rank`'s inputs, on `device`; every rank's routing is
  // still drawn (routings() covers the world). input(r) and y(r) are valid for r == rank only.
  DeviceInputs(int rank, int device, const EpConfig& cfg, int tokens, ref::RoutingKind routing,
               uint64_t seed);
  ~DeviceInputs();
  DeviceInputs(const DeviceInputs&) = delete;
  DeviceInputs& operator=(const DeviceInputs&) = delete;

  int tokens() const { return tokens_; }
  DispatchInput input(int rank) const;
  void* y(int rank) const { return ranks_[rank].y; }
  const std::vector<ref::Routing>& routings() const { return routings_; }

 private:
  // devices[r] = the GPU of rank r, or -1 when rank r lives in another process.
  void init(const std::vector<int>& devices, const EpConfig& cfg, ref::RoutingKind routing,
            uint64_t seed);
  void release() noexcept;
  struct Rank {
    void* x = nullptr;          // [T, H] bf16 or fp8
    float* scales = nullptr;    // [T, H/128] (fp8 input only)
    int32_t* ids = nullptr;     // [T, K]
    float* weights = nullptr;   // [T, K]
    void* y = nullptr;          // [T, H] bf16
  };
  int tokens_ = 0;
  bool fp8_input_ = false;
  std::vector<Rank> ranks_;
  std::vector<ref::Routing> routings_;
};

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
  int size() const { return int(streams_.size()); }
  // Enqueues on the main stream: fork -> op(r, stream_r) on every rank -> join. No allocation
  // or synchronous CUDA call happens between the first and the last rank's op.
  void run(const std::function<void(int, cudaStream_t)>& op);
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

enum class TimingMode { kGraph, kEager };
const char* to_string(TimingMode m);

struct RoundSamples {
  std::vector<double> dispatch_us;
  std::vector<double> combine_us;
};

using Group = std::vector<std::unique_ptr<All2All>>;

// `warmup` untimed then `iters` timed dispatch+combine rounds of every rank, with the method
// described at the top of this file. The expert stage is skipped: combine reads whatever its
// buffer holds. Throws what the backend throws (the group is then unusable); the streams are
// drained before the exception leaves.
RoundSamples time_rounds(Group& group, const DeviceInputs& inputs, ForkJoin& fj, TimingMode mode,
                         int warmup, int iters);

// One process of an IPC world: `warmup` untimed then `iters` timed dispatch+combine rounds of
// this rank's object on `stream`, with events on that stream (a, dispatch, b, combine, c) and, in
// graph mode, one graph per op captured on it. Every round begins with an all-gather on the
// bootstrap after the previous round has finished on the device: the barrier that makes the ranks
// start each round together (its skew, tens of microseconds between processes, is part of what
// a rank waits for), and the way an error on any rank ends the loop on every rank at the same
// round. Returns "" and fills `out`, or returns the first failing rank's error ("rank r: ...").
// Errors of the bootstrap itself propagate: the job cannot go on.
std::string time_rank_rounds(All2All& a2a, const DispatchInput& input, void* y,
                             cudaStream_t stream, Bootstrap& boot, TimingMode mode, int warmup,
                             int iters, RoundSamples& out);
// The same rounds for any pair of ops enqueued on `stream` (NCCL's collectives, the yardstick);
// `synchronize` waits for the stream and raises what went wrong.
std::string time_op_rounds(const std::function<void()>& dispatch,
                           const std::function<void()>& combine,
                           const std::function<void()>& synchronize, cudaStream_t stream,
                           Bootstrap& boot, TimingMode mode, int warmup, int iters,
                           RoundSamples& out);

#endif  // EPX_HAVE_CUDA

}  // namespace epx::cli
