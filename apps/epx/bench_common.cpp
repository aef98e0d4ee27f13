// The GPU side of what the measuring commands share (CUDA builds): the copy bandwidth and the
// timing method of DESIGN §8 (bench_common.hpp).
#include "bench_common.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "epx/bootstrap.hpp"
#include "epx/error.hpp"
#include "epx/world.hpp"
#include "testing/graph_capture.hpp"
#include "testing/threads.hpp"

namespace epx::cli {

namespace {

// Events that free themselves.
class EventSet {
 public:
  EventSet(size_t n, unsigned flags) : events_(n, nullptr) {
    for (auto& e : events_) EPX_CUDA_CHECK(cudaEventCreateWithFlags(&e, flags));
  }
  ~EventSet() {
    for (auto e : events_)
      if (e) (void)cudaEventDestroy(e);
  }
  EventSet(const EventSet&) = delete;
  EventSet& operator=(const EventSet&) = delete;
  cudaEvent_t operator[](size_t i) const { return events_[i]; }

 private:
  std::vector<cudaEvent_t> events_;
};

float elapsed_us(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  EPX_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  return ms * 1000.0f;
}

struct GraphExec {
  cudaGraphExec_t exec = nullptr;
  GraphExec() = default;
  GraphExec(const GraphExec&) = delete;
  GraphExec& operator=(const GraphExec&) = delete;
  ~GraphExec() {
    if (exec) (void)cudaGraphExecDestroy(exec);
  }
};

// Captures `body` (which enqueues on `stream` and on streams forked from it) into `out`.
void capture(cudaStream_t stream, const std::function<void()>& body, GraphExec& out) {
  out.exec = testing::capture_graph(stream, body);
}

}  // namespace

CopyBandwidth measure_copy_bandwidth(int device, size_t bytes, int repeats) {
  EPX_CUDA_CHECK(cudaSetDevice(device));
  void* src = nullptr;
  void* dst = nullptr;
  cudaStream_t stream = nullptr;
  struct Cleanup {
    void*& src;
    void*& dst;
    cudaStream_t& stream;
    ~Cleanup() {
      if (stream) (void)cudaStreamSynchronize(stream);
      if (src) (void)cudaFree(src);
      if (dst) (void)cudaFree(dst);
      if (stream) (void)cudaStreamDestroy(stream);
    }
  } cleanup{src, dst, stream};
  EPX_CUDA_CHECK(cudaMalloc(&src, bytes));
  EPX_CUDA_CHECK(cudaMalloc(&dst, bytes));
  EPX_CUDA_CHECK(cudaMemset(src, 0x5a, bytes));
  EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  constexpr int kWarmup = 3;
  EventSet ev(2 * size_t(repeats), cudaEventDefault);
  for (int i = 0; i < kWarmup; ++i)
    EPX_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
  for (int i = 0; i < repeats; ++i) {
    EPX_CUDA_CHECK(cudaEventRecord(ev[2 * i], stream));
    EPX_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
    EPX_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], stream));
  }
  EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> us;
  for (int i = 0; i < repeats; ++i) us.push_back(elapsed_us(ev[2 * i], ev[2 * i + 1]));
  CopyBandwidth bw;
  bw.bytes = bytes;
  bw.repeats = repeats;
  bw.median_us = summarize(us).median_us;
  bw.gbps = gbps(int64_t(2 * bytes), bw.median_us);
  return bw;
}

ForkJoin::ForkJoin(const InProcessWorld& world)
    : main_device_(world.device_of(0)),
      streams_(world.size(), nullptr),
      joins_(world.size(), nullptr) {
  try {
    EPX_CUDA_CHECK(cudaSetDevice(main_device_));
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&main_, cudaStreamNonBlocking));
    EPX_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
    for (int r = 0; r < world.size(); ++r) {
      devices_.push_back(world.device_of(r));
      EPX_CUDA_CHECK(cudaSetDevice(devices_[r]));
      EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&streams_[r], cudaStreamNonBlocking));
      EPX_CUDA_CHECK(cudaEventCreateWithFlags(&joins_[r], cudaEventDisableTiming));
    }
  } catch (...) {
    release();
    throw;
  }
}

ForkJoin::~ForkJoin() {
  release();
}

void ForkJoin::release() noexcept {
  drain();
  for (cudaEvent_t& e : joins_) {
    if (e) (void)cudaEventDestroy(e);
    e = nullptr;
  }
  for (cudaStream_t& s : streams_) {
    if (s) (void)cudaStreamDestroy(s);
    s = nullptr;
  }
  if (fork_) (void)cudaEventDestroy(fork_);
  if (main_) (void)cudaStreamDestroy(main_);
  fork_ = nullptr;
  main_ = nullptr;
}

void ForkJoin::run(const std::function<void(int, cudaStream_t)>& op, bool thread_per_rank) {
  const int W = size();
  EPX_CUDA_CHECK(cudaEventRecord(fork_, main_));
  for (int r = 0; r < W; ++r) EPX_CUDA_CHECK(cudaStreamWaitEvent(streams_[r], fork_, 0));
  if (thread_per_rank) {
    // (the current device is per thread: this thread's stays as it is)
    testing::run_on_threads(
        W, [&](int r) { return devices_[size_t(r)]; }, [&](int r) { op(r, streams_[r]); });
  } else {
    for (int r = 0; r < W; ++r) op(r, streams_[r]);
  }
  for (int r = 0; r < W; ++r) {
    EPX_CUDA_CHECK(cudaEventRecord(joins_[r], streams_[r]));
    EPX_CUDA_CHECK(cudaStreamWaitEvent(main_, joins_[r], 0));
  }
}

void ForkJoin::drain() noexcept {
  for (cudaStream_t s : streams_)
    if (s) (void)cudaStreamSynchronize(s);
  if (main_) (void)cudaStreamSynchronize(main_);
}

double time_fork_join_floor(ForkJoin& fj, int warmup, int iters) {
  std::vector<void*> bufs(fj.size(), nullptr);
  GraphExec graph;
  std::vector<double> us;
  try {
    for (int r = 0; r < fj.size(); ++r) {
      EPX_CUDA_CHECK(cudaStreamSynchronize(fj.rank(r)));
      EPX_CUDA_CHECK(cudaMalloc(&bufs[r], 16));
    }
    capture(
        fj.main(),
        [&] {
          fj.run(
              [&](int r, cudaStream_t s) { EPX_CUDA_CHECK(cudaMemsetAsync(bufs[r], 0, 16, s)); });
        },
        graph);
    EPX_CUDA_CHECK(cudaSetDevice(fj.main_device()));
    EventSet e(2 * size_t(iters), cudaEventDefault);
    for (int i = 0; i < warmup + iters; ++i) {
      const int t = i - warmup;
      if (t >= 0) EPX_CUDA_CHECK(cudaEventRecord(e[2 * t], fj.main()));
      EPX_CUDA_CHECK(cudaGraphLaunch(graph.exec, fj.main()));
      if (t >= 0) EPX_CUDA_CHECK(cudaEventRecord(e[2 * t + 1], fj.main()));
    }
    EPX_CUDA_CHECK(cudaStreamSynchronize(fj.main()));
    for (int t = 0; t < iters; ++t) us.push_back(elapsed_us(e[2 * t], e[2 * t + 1]));
  } catch (...) {
    fj.drain();
    for (void* b : bufs) (void)cudaFree(b);
    throw;
  }
  for (void* b : bufs) (void)cudaFree(b);
  return summarize(us).median_us;
}

RoundSamples time_rounds(Group& group, const DeviceInputs& inputs, ForkJoin& fj, TimingMode mode,
                         LaunchMode launch, int warmup, int iters) {
  const int W = int(group.size());
  EPX_CHECK(W == fj.size(), InputError, "group size", W,
            "the world size " + std::to_string(fj.size()));
  // One launch per GPU: the ranks of each GPU with their arguments, launched from the stream
  // of the GPU's first rank (or the main stream, when there is one GPU).
  struct GpuRanks {
    int first = -1;
    std::vector<All2All*> ranks;
    std::vector<DispatchInput> inputs;
    std::vector<const void*> outs;
    std::vector<void*> ys;
  };
  std::vector<GpuRanks> gpus;
  for (int r = 0; r < W; ++r) {
    const int dev = fj.device_of(r);
    auto it = std::find_if(gpus.begin(), gpus.end(),
                           [&](const GpuRanks& g) { return fj.device_of(g.first) == dev; });
    if (it == gpus.end()) it = gpus.insert(gpus.end(), GpuRanks{.first = r});
    it->ranks.push_back(group[r].get());
    it->inputs.push_back(inputs.input(r));
    it->outs.push_back(nullptr);  // combine_all takes each round's combine buffer
    it->ys.push_back(inputs.y(r));
  }
  // A dispatch that reads its round's row count back waits on the host for every peer's
  // counts: with several GPUs, each GPU's launch from a thread of its own.
  const bool host_waits =
      W > 0 && reads_counts_on_host(group[0]->backend(), group[0]->config());
  auto per_gpu = [&](const std::function<void(GpuRanks&, cudaStream_t)>& op) {
    if (gpus.size() == 1) {
      op(gpus[0], fj.main());
      return;
    }
    fj.run(
        [&](int r, cudaStream_t s) {
          for (GpuRanks& g : gpus)
            if (g.first == r) op(g, s);
        },
        host_waits);
  };
  auto dispatch_all = [&] {
    if (launch == LaunchMode::kOnePerGpu) {
      per_gpu([](GpuRanks& g, cudaStream_t s) { (void)dispatch_group(g.ranks, g.inputs, s); });
      return;
    }
    fj.run([&](int r, cudaStream_t s) { (void)group[r]->dispatch(inputs.input(r), s); });
  };
  auto combine_all = [&] {
    if (launch == LaunchMode::kOnePerGpu) {
      per_gpu([](GpuRanks& g, cudaStream_t s) {
        // The round's combine buffer (high_throughput may move it when a round needs more rows).
        for (size_t i = 0; i < g.ranks.size(); ++i) g.outs[i] = g.ranks[i]->combine_buffer();
        combine_group(g.ranks, g.outs, g.ys, s);
      });
      return;
    }
    fj.run([&](int r, cudaStream_t s) {
      group[r]->combine(group[r]->combine_buffer(), inputs.y(r), s);
    });
  };
  RoundSamples out;
  // Declared outside the try block so that they are destroyed only after the drain below.
  GraphExec dispatch_graph, combine_graph;
  std::unique_ptr<EventSet> ev;
  try {
    if (mode == TimingMode::kGraph) {
      // Captured in call order (dispatch, then combine), as every backend expects on the host.
      capture(fj.main(), dispatch_all, dispatch_graph);
      capture(fj.main(), combine_all, combine_graph);
    }
    EPX_CUDA_CHECK(cudaSetDevice(fj.main_device()));  // events live on the main stream's GPU
    ev = std::make_unique<EventSet>(3 * size_t(iters), cudaEventDefault);
    const EventSet& e = *ev;
    for (int i = 0; i < warmup + iters; ++i) {
      const int t = i - warmup;
      if (t >= 0) EPX_CUDA_CHECK(cudaEventRecord(e[3 * t], fj.main()));
      if (mode == TimingMode::kGraph) {
        EPX_CUDA_CHECK(cudaGraphLaunch(dispatch_graph.exec, fj.main()));
      } else {
        dispatch_all();
      }
      if (t >= 0) EPX_CUDA_CHECK(cudaEventRecord(e[3 * t + 1], fj.main()));
      if (mode == TimingMode::kGraph) {
        EPX_CUDA_CHECK(cudaGraphLaunch(combine_graph.exec, fj.main()));
      } else {
        combine_all();
      }
      if (t >= 0) EPX_CUDA_CHECK(cudaEventRecord(e[3 * t + 2], fj.main()));
    }
    EPX_CUDA_CHECK(cudaStreamSynchronize(fj.main()));
    for (int r = 0; r < W; ++r) group[r]->synchronize(fj.rank(r));  // raises device errors
    for (int t = 0; t < iters; ++t) {
      out.dispatch_us.push_back(elapsed_us(e[3 * t], e[3 * t + 1]));
      out.combine_us.push_back(elapsed_us(e[3 * t + 1], e[3 * t + 2]));
    }
  } catch (...) {
    fj.drain();
    throw;
  }
  return out;
}

std::string time_op_rounds(const std::function<void()>& dispatch,
                           const std::function<void()>& combine,
                           const std::function<void()>& synchronize, cudaStream_t stream,
                           Bootstrap& boot, TimingMode mode, int warmup, int iters,
                           RoundSamples& out) {
  const bool graph = mode == TimingMode::kGraph;
  GraphExec dispatch_graph, combine_graph;
  std::unique_ptr<EventSet> ev;
  std::string error;  // this rank's first error
  auto attempt = [&](const std::function<void()>& body) {
    try {
      body();
    } catch (const Error& e) {
      error = e.what();
      (void)cudaStreamSynchronize(stream);
      (void)cudaGetLastError();
    }
  };
  attempt([&] {
    ev = std::make_unique<EventSet>(3 * size_t(iters), cudaEventDefault);
    if (graph) {  // captured in call order, as every backend expects on the host
      capture(stream, dispatch, dispatch_graph);
      capture(stream, combine, combine_graph);
    }
  });
  for (int i = 0;; ++i) {
    const std::vector<std::string> all = boot.all_gather(error);  // the round's barrier
    for (size_t r = 0; r < all.size(); ++r)
      if (!all[r].empty()) return fmt::format("rank {}: {}", r, all[r]);
    if (i == warmup + iters) break;
    const int t = i - warmup;
    attempt([&] {
      const EventSet& e = *ev;
      if (t >= 0) EPX_CUDA_CHECK(cudaEventRecord(e[3 * t], stream));
      if (graph) {
        EPX_CUDA_CHECK(cudaGraphLaunch(dispatch_graph.exec, stream));
      } else {
        dispatch();
      }
      if (t >= 0) EPX_CUDA_CHECK(cudaEventRecord(e[3 * t + 1], stream));
      if (graph) {
        EPX_CUDA_CHECK(cudaGraphLaunch(combine_graph.exec, stream));
      } else {
        combine();
      }
      if (t >= 0) EPX_CUDA_CHECK(cudaEventRecord(e[3 * t + 2], stream));
      synchronize();  // raises device errors (a peer that never came: TimeoutError)
    });
  }
  // now every rank finished every round without an error
  out = {};
  for (int t = 0; t < iters; ++t) {
    out.dispatch_us.push_back(elapsed_us((*ev)[3 * t], (*ev)[3 * t + 1]));
    out.combine_us.push_back(elapsed_us((*ev)[3 * t + 1], (*ev)[3 * t + 2]));
  }
  return {};
}

std::string time_rank_rounds(All2All& a2a, const DispatchInput& input, void* y, cudaStream_t stream,
                             Bootstrap& boot, TimingMode mode, int warmup, int iters,
                             RoundSamples& out) {
  return time_op_rounds([&] { (void)a2a.dispatch(input, stream); },
                        [&] { a2a.combine(a2a.combine_buffer(), y, stream); },
                        [&] { a2a.synchronize(stream); }, stream, boot, mode, warmup, iters, out);
}

}  // namespace epx::cli
