#include "fault_run.hpp"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "epx/all2all.hpp"
#include "epx/cuda_check.hpp"
#include "epx/error.hpp"
#include "epx/world.hpp"
#include "fault_inputs.hpp"
#include "illegal_write.hpp"
#include "testing/graph_capture.hpp"

namespace epx::fault {
namespace {

using Clock = std::chrono::steady_clock;

std::atomic<const char*> g_stage{"starting"};

// Beyond timeout_ms, how long a stream may stay busy before the driver calls it a hang (the
// kernels return at their timeout; processes that share a GPU are time-sliced).
constexpr int kHangSlackMs = 5000;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void print_line(const std::string& line) {
  std::fputs((line + "\n").c_str(), stdout);
  std::fflush(stdout);
}

// A stream that stayed busy past its bound: the device wait it holds is not bounded.
class StreamHang : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Waits for `stream` at most `limit_ms`; returns what it completed with (cudaSuccess or the
// error of its work), or cudaErrorNotReady when it was still busy at the bound.
cudaError_t wait_stream(cudaStream_t stream, int limit_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(limit_ms);
  for (;;) {
    const cudaError_t e = cudaStreamQuery(stream);
    if (e != cudaErrorNotReady) return e;
    if (Clock::now() >= deadline) return e;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

std::string error_class(const std::exception& e) {
  if (dynamic_cast<const StreamHang*>(&e) != nullptr) return "hang";
  const auto* epx_error = dynamic_cast<const Error*>(&e);
  if (epx_error == nullptr) return "exception";
  switch (epx_error->code()) {
    case ErrorCode::kConfig:
      return "ConfigError";
    case ErrorCode::kInput:
      return "InputError";
    case ErrorCode::kTimeout:
      return "TimeoutError";
    case ErrorCode::kPeer:
      return "PeerError";
    case ErrorCode::kCuda:
      return "CudaError";
    case ErrorCode::kState:
      return "StateError";
    case ErrorCode::kUnsupported:
      return "UnsupportedError";
    default:
      return "Error";
  }
}

void record(Observation& o, const std::exception& e, int round, double seconds) {
  o.seen = error_class(e);
  o.error = e.what();
  o.error_round = round;
  o.seconds = seconds;
}

// A few bytes set on a stream of its own: whether this process's CUDA context still works.
// The memory is allocated up front (cudaFree may wait for every kernel of the device).
class AliveProbe {
 public:
  AliveProbe() {
    EPX_CUDA_CHECK(cudaMalloc(&bytes_, kBytes));
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~AliveProbe() {
    (void)cudaStreamDestroy(stream_);
    (void)cudaFree(bytes_);
  }
  AliveProbe(const AliveProbe&) = delete;
  AliveProbe& operator=(const AliveProbe&) = delete;

  bool works(int limit_ms) const {
    return cudaMemsetAsync(bytes_, 0x5a, kBytes, stream_) == cudaSuccess &&
           wait_stream(stream_, limit_ms) == cudaSuccess;
  }

 private:
  static constexpr size_t kBytes = 4096;
  void* bytes_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

// One rank's All2All with its inputs, output, stream and (graph mode) its two graphs: the round's
// dispatch with the expert stage, and its combine.
class RankRunner {
 public:
  RankRunner(const FaultCase& c, int rank, std::unique_ptr<All2All> a2a)
      : c_(c), rank_(rank), a2a_(std::move(a2a)), in_(make_inputs(c, rank)) {
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    x_ = upload(in_.x);
    ids_ = upload(in_.ids);
    weights_ = upload(in_.weights);
    EPX_CUDA_CHECK(cudaMalloc(&y_, in_.x.size() * sizeof(uint16_t)));
  }
  ~RankRunner() {
    if (dispatch_graph_ != nullptr) (void)cudaGraphExecDestroy(dispatch_graph_);
    if (combine_graph_ != nullptr) (void)cudaGraphExecDestroy(combine_graph_);
    (void)cudaStreamDestroy(stream_);
    a2a_.reset();
    for (void* p : {x_, ids_, weights_, y_}) (void)cudaFree(p);
  }
  RankRunner(const RankRunner&) = delete;
  RankRunner& operator=(const RankRunner&) = delete;

  int rank() const { return rank_; }
  All2All& a2a() { return *a2a_; }
  cudaStream_t stream() const { return stream_; }
  const RankInputs& inputs() const { return in_; }

  // Graph mode: records the round once; enqueue_* replay it from then on.
  void capture() {
    dispatch_graph_ = testing::capture_graph(stream_, [this] { dispatch_calls(); });
    combine_graph_ = testing::capture_graph(stream_, [this] { combine_calls(); });
  }

  void enqueue_dispatch() {
    if (dispatch_graph_ != nullptr) {
      EPX_CUDA_CHECK(cudaGraphLaunch(dispatch_graph_, stream_));
    } else {
      dispatch_calls();
    }
  }
  void enqueue_combine() {
    if (combine_graph_ != nullptr) {
      EPX_CUDA_CHECK(cudaGraphLaunch(combine_graph_, stream_));
    } else {
      combine_calls();
    }
  }

  // The end of a round: the stream drained (bounded: StreamHang past it), then
  // All2All::synchronize, which raises what the device recorded.
  void finish_round() {
    if (wait_stream(stream_, c_.timeout_ms + kHangSlackMs) == cudaErrorNotReady) {
      throw StreamHang(
          fmt::format("rank {}: its stream was still busy {} ms after the round's "
                      "last call (timeout_ms {} + {} ms): a wait is not bounded",
                      rank_, c_.timeout_ms + kHangSlackMs, c_.timeout_ms, kHangSlackMs));
    }
    a2a_->synchronize(stream_);
  }

  // "" when y holds what combine gives with the ranks of `live` taking part.
  std::string check_output(uint64_t live) {
    std::vector<uint16_t> y(in_.x.size());
    EPX_CUDA_CHECK(cudaMemcpyAsync(y.data(), y_, y.size() * sizeof(uint16_t),
                                   cudaMemcpyDeviceToHost, stream_));
    const cudaError_t e = wait_stream(stream_, c_.timeout_ms + kHangSlackMs);
    if (e != cudaSuccess) return fmt::format("reading y back: {}", cudaGetErrorString(e));
    return compare_y(c_, in_, y, live);
  }

 private:
  template <typename T>
  void* upload(const std::vector<T>& h) {
    void* d = nullptr;
    EPX_CUDA_CHECK(cudaMalloc(&d, h.size() * sizeof(T)));
    EPX_CUDA_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
  }

  // y set to NaN first, so that a round whose combine did not write it cannot pass on the last
  // round's values; the expert stage copies the received rows (partial = row).
  void dispatch_calls() {
    EPX_CUDA_CHECK(cudaMemsetAsync(y_, 0xff, in_.x.size() * sizeof(uint16_t), stream_));
    const DispatchInput input{.num_tokens = kTokens,
                              .x = x_,
                              .topk_ids = ids_,
                              .ids_type = IdType::kInt32,
                              .topk_weights = static_cast<const float*>(weights_)};
    const DispatchResult d = a2a_->dispatch(input, stream_);
    EPX_CUDA_CHECK(cudaMemcpyAsync(d.combine_buffer, d.recv_x,
                                   size_t(d.capacity) * kHidden * sizeof(uint16_t),
                                   cudaMemcpyDeviceToDevice, stream_));
    combine_buffer_ = d.combine_buffer;
  }
  void combine_calls() { a2a_->combine(combine_buffer_, y_, stream_); }

  const FaultCase& c_;
  int rank_;
  std::unique_ptr<All2All> a2a_;
  RankInputs in_;
  cudaStream_t stream_ = nullptr;
  void* x_ = nullptr;
  void* ids_ = nullptr;
  void* weights_ = nullptr;
  void* y_ = nullptr;
  void* combine_buffer_ = nullptr;
  cudaGraphExec_t dispatch_graph_ = nullptr;
  cudaGraphExec_t combine_graph_ = nullptr;
};

uint64_t all_ranks(int world) {
  return world == 64 ? ~uint64_t(0) : (uint64_t(1) << world) - 1;
}

const char* point_text(Point p) {
  switch (p) {
    case Point::kBeforeDispatch:
      return "before its dispatch";
    case Point::kInDispatch:
      return "right after enqueueing its dispatch";
    case Point::kBetween:
      return "after its dispatch completed, before its combine";
    case Point::kInCombine:
      return "right after enqueueing its combine";
    case Point::kNone:
      break;
  }
  return "from the start";
}

// What a surviving rank tracks over the rounds.
struct Survivor {
  Observation o;
  bool failed = false;        // it met an error (then it makes no further call)
  bool mask_seen = false;     // masked_ranks() showed the faulty rank
  int rounds_after_mask = 0;  // rounds that began with the faulty rank masked
};

// After a round of survivor `s` that completed: its output, and what masking did.
void after_round(const FaultCase& c, RankRunner& r, Survivor& s, int round, uint64_t masked_before,
                 Clock::time_point fault_t0) {
  const uint64_t faulty_bit = uint64_t(1) << c.faulty_rank;
  const bool masked_at_start = (masked_before & faulty_bit) != 0;
  if (round < c.fault_round || masked_at_start) {
    const uint64_t live = all_ranks(c.world) & ~(masked_at_start ? faulty_bit : 0);
    const std::string wrong = r.check_output(live);
    if (!wrong.empty() && s.o.wrong_output.empty()) {
      s.o.wrong_output = fmt::format("round {}: {}", round, wrong);
    }
  }
  if (masked_at_start) ++s.rounds_after_mask;
  if (round >= c.fault_round && !s.mask_seen && (r.a2a().masked_ranks() & faulty_bit) != 0) {
    s.mask_seen = true;
    s.o.seconds = seconds_since(fault_t0);
  }
}

// The observation of a survivor once its rounds are over (seen, mask figures, liveness).
void conclude(const FaultCase& c, RankRunner* r, Survivor& s, const AliveProbe& probe) {
  if (c.mask && !s.failed && s.mask_seen) s.o.seen = "masked";
  if (r != nullptr) {
    s.o.masked = r->a2a().masked_ranks();
    s.o.dropped = r->a2a().dropped_pairs();
    const uint64_t pairs = pairs_on_rank(c, r->inputs(), c.faulty_rank);
    s.o.dropped_min = uint64_t(s.rounds_after_mask) * pairs;
    s.o.dropped_max = uint64_t(s.rounds_after_mask + 1) * pairs;
  }
  s.o.alive = probe.works(c.timeout_ms + kHangSlackMs);
}

bool report(const FaultCase& c, const Observation& o) {
  const Verdict v = judge(c, o);
  print_line(result_line(c, o, v));
  return v.pass;
}

// ---- in-process
// ----------------------------------------------------------------------------------

using Runners = std::vector<std::unique_ptr<RankRunner>>;

Runners make_runners(const FaultCase& c, const InProcessWorld& world) {
  auto group = make_all2all_group(Backend::kLowLatency, c.config(), world);
  Runners runners;
  for (int r = 0; r < c.world; ++r) {
    runners.push_back(std::make_unique<RankRunner>(c, r, std::move(group[size_t(r)])));
  }
  return runners;
}

// Drains every rank's stream (bounded); "" when all drained, else which did not.
std::string drain_all(const FaultCase& c, Runners& runners) {
  for (auto& r : runners) {
    if (wait_stream(r->stream(), c.timeout_ms + kHangSlackMs) == cudaErrorNotReady) {
      return fmt::format("the stream of rank {} was still busy after {} ms", r->rank(),
                         c.timeout_ms + kHangSlackMs);
    }
  }
  return "";
}

// A fresh group of every rank (the faulty one behaving), one healthy round, every output checked.
std::string recreate_and_run(const FaultCase& c, const InProcessWorld& world, Runners& runners) {
  set_stage("recreating the group");
  try {
    runners.clear();
    runners = make_runners(c, world);
    if (c.mode == Mode::kGraph) {
      for (auto& r : runners) r->capture();
    }
    set_stage("the healthy round of the recreated group");
    for (auto& r : runners) r->enqueue_dispatch();
    for (auto& r : runners) r->enqueue_combine();
    for (auto& r : runners) r->finish_round();
    for (auto& r : runners) {
      const std::string wrong = r->check_output(all_ranks(c.world));
      if (!wrong.empty()) return fmt::format("failed: rank {}: {}", r->rank(), wrong);
    }
  } catch (const std::exception& e) {
    return fmt::format("failed: {}: {}", error_class(e), e.what());
  }
  return "ok";
}

}  // namespace

void set_stage(const char* s) {
  g_stage.store(s);
}
const char* stage() {
  return g_stage.load();
}

int run_in_process(const FaultCase& c) {
  set_stage("creating the in-process world");
  const AliveProbe probe;
  const InProcessWorld world(c.world);
  Runners runners = make_runners(c, world);
  const int F = c.faulty_rank;
  bool faulty_stopped = c.fault == Fault::kNeverArrives;  // it never calls at all
  if (c.mode == Mode::kGraph) {
    set_stage("capturing the graphs");
    for (auto& r : runners) {
      if (r->rank() != F || !faulty_stopped) r->capture();
    }
  }
  if (faulty_stopped) {
    print_line(injected_line(c, F, "never calls: its All2All exists but makes no call"));
  }
  std::vector<Survivor> survivors(size_t(c.world));
  for (int r = 0; r < c.world; ++r) survivors[size_t(r)].o.rank = r;
  std::string faulty_problem;  // the faulty rank failed in a round before its fault
  bool hung = false;
  auto stop_faulty = [&](int round) {
    faulty_stopped = true;
    print_line(injected_line(
        c, F, fmt::format("stopped calling {} of round {}", point_text(c.at), round)));
  };
  auto faulty_call = [&](const char* what, auto&& call) {
    try {
      call();
    } catch (const std::exception& e) {
      faulty_stopped = true;
      if (faulty_problem.empty()) {
        faulty_problem = fmt::format("the faulty rank's {} failed before its fault: {}: {}", what,
                                     error_class(e), e.what());
      }
    }
  };

  Clock::time_point fault_t0 = Clock::now();
  const int last_round = c.fault_round + kRoundsAfterFault;
  for (int round = 0; round <= last_round; ++round) {
    set_stage("a round");
    const auto t0 = Clock::now();
    if (round == c.fault_round) fault_t0 = t0;
    const bool fault_now = round == c.fault_round;
    auto since = [&] {
      return round >= c.fault_round ? seconds_since(fault_t0) : seconds_since(t0);
    };
    auto survivor_call = [&](int r, auto&& call) {
      Survivor& s = survivors[size_t(r)];
      if (s.failed) return;
      try {
        call();
      } catch (const std::exception& e) {
        record(s.o, e, round, since());
        s.failed = true;
        hung |= s.o.seen == "hang";
      }
    };
    std::vector<uint64_t> masked_before(size_t(c.world), 0);
    for (auto& r : runners) masked_before[size_t(r->rank())] = r->a2a().masked_ranks();

    for (auto& r : runners) {
      if (r->rank() != F) {
        survivor_call(r->rank(), [&] { r->enqueue_dispatch(); });
      } else if (!faulty_stopped) {
        if (fault_now && c.at == Point::kBeforeDispatch) {
          stop_faulty(round);
          continue;
        }
        faulty_call("dispatch", [&] { r->enqueue_dispatch(); });
        if (fault_now && c.at == Point::kInDispatch) stop_faulty(round);
      }
    }
    if (fault_now && !faulty_stopped && c.at == Point::kBetween) {
      // Every rank's dispatch is enqueued, so the faulty rank's can complete.
      faulty_call("dispatch", [&] { runners[size_t(F)]->finish_round(); });
      if (!faulty_stopped) stop_faulty(round);
    }
    for (auto& r : runners) {
      if (r->rank() != F) {
        survivor_call(r->rank(), [&] { r->enqueue_combine(); });
      } else if (!faulty_stopped) {
        faulty_call("combine", [&] { r->enqueue_combine(); });
        if (fault_now && c.at == Point::kInCombine) stop_faulty(round);
      }
    }
    for (auto& r : runners) {
      if (r->rank() == F) continue;
      Survivor& s = survivors[size_t(r->rank())];
      survivor_call(r->rank(), [&] { r->finish_round(); });
      if (!s.failed) after_round(c, *r, s, round, masked_before[size_t(r->rank())], fault_t0);
    }
    if (!faulty_stopped) {  // a healthy round of the faulty rank
      faulty_call("round", [&] { runners[size_t(F)]->finish_round(); });
      if (!faulty_stopped) {
        const std::string wrong = runners[size_t(F)]->check_output(all_ranks(c.world));
        if (!wrong.empty() && faulty_problem.empty()) {
          faulty_problem = fmt::format("the faulty rank's output in round {}: {}", round, wrong);
        }
      }
    }
    if (hung) break;
    bool every_survivor_failed = true;
    for (int r = 0; r < c.world; ++r) {
      if (r != F && !survivors[size_t(r)].failed) every_survivor_failed = false;
    }
    if (every_survivor_failed) break;
  }

  set_stage("concluding");
  for (int r = 0; r < c.world; ++r) {
    if (r == F) continue;
    Survivor& s = survivors[size_t(r)];
    conclude(c, hung ? nullptr : runners[size_t(r)].get(), s, probe);
    if (!faulty_problem.empty() && s.o.wrong_output.empty()) s.o.wrong_output = faulty_problem;
  }
  std::string recreated = "n/a";
  if (hung) {
    recreated = "failed: a stream did not drain";
  } else if (!c.mask) {
    const std::string busy = drain_all(c, runners);
    recreated = busy.empty() ? recreate_and_run(c, world, runners) : "failed: " + busy;
    hung = !busy.empty();
  }
  bool pass = true;
  for (int r = 0; r < c.world; ++r) {
    if (r == F) continue;
    Observation& o = survivors[size_t(r)].o;
    o.recreated = recreated;
    pass &= report(c, o);
  }
  if (hung) {
    // A stream still holds a wait that never ends: tearing the group down would wait for it.
    std::fflush(nullptr);
    std::_Exit(1);
  }
  return pass ? 0 : 1;
}

// ---- ipc
// -------------------------------------------------------------------------------------------

namespace {

// Stays alive without a call until every peer process has ended (a job's launcher would stop
// this one then); the watchdog bounds it.
void wait_for_peers(const std::vector<long>& pids, int rank) {
  set_stage("a stopped rank waiting for its peers to end");
  for (;;) {
    bool any = false;
    for (size_t r = 0; r < pids.size(); ++r) {
      if (int(r) == rank || pids[r] <= 0) continue;
      if (::kill(pid_t(pids[r]), 0) == 0 || errno != ESRCH) any = true;
    }
    if (!any) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// The faulty rank's fault round: the calls up to its point, then the fault. Returns the process's
// exit code where the fault lets it return.
int fail_at_point(const FaultCase& c, RankRunner& r, const std::vector<long>& pids) {
  set_stage("the faulty rank's fault round");
  if (c.at != Point::kBeforeDispatch) r.enqueue_dispatch();
  if (c.at == Point::kBetween) r.finish_round();
  if (c.at == Point::kInCombine) r.enqueue_combine();
  const std::string where = fmt::format("{} of round {}", point_text(c.at), c.fault_round);
  switch (c.fault) {
    case Fault::kKilled:
      print_line(injected_line(c, r.rank(),
                               fmt::format("pid {} raises SIGKILL {}", long(::getpid()), where)));
      ::raise(SIGKILL);
      return 1;  // not reached
    case Fault::kStopsCalling:
      print_line(injected_line(c, r.rank(),
                               "stopped calling " + where +
                                   "; alive until its "
                                   "peers end"));
      wait_for_peers(pids, r.rank());
      return 0;
    case Fault::kKernelFault: {
      print_line(injected_line(c, r.rank(), "writes to an illegal address " + where));
      const cudaError_t launched = launch_illegal_write(r.stream());
      const cudaError_t ended =
          launched != cudaSuccess ? launched : wait_stream(r.stream(), c.timeout_ms + kHangSlackMs);
      print_line(fmt::format("fault-effect rank={} cuda={} (\"{}\")", r.rank(),
                             cudaGetErrorName(ended), cudaGetErrorString(ended)));
      // The context is lost: leave without the destructors, which would call into it.
      std::fflush(nullptr);
      std::_Exit(ended == cudaSuccess || ended == cudaErrorNotReady ? 1 : 0);
    }
    case Fault::kNeverArrives:
      break;
  }
  return 1;
}

}  // namespace

int run_ipc(const FaultCase& c, const BootstrapOptions& env_in) {
  BootstrapOptions env = env_in;
  env.timeout_ms = c.timeout_ms;
  const int rank = env.rank;
  const bool faulty = rank == c.faulty_rank;
  const int device = rank % cuda_device_count();
  set_stage("starting CUDA");
  EPX_CUDA_CHECK(cudaSetDevice(device));
  EPX_CUDA_CHECK(cudaFree(nullptr));  // the context now, not inside the timed part
  if (faulty && c.fault == Fault::kKernelFault) preload_illegal_write();
  if (faulty && c.fault == Fault::kNeverArrives) {
    const int sleep_ms = c.timeout_ms + 1000;
    print_line(injected_line(c, rank,
                             fmt::format("never joins the world; sleeps {} ms, then "
                                         "exits 0",
                                         sleep_ms)));
    std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
    return 0;
  }
  const AliveProbe probe;
  Survivor s;
  s.o.rank = rank;
  std::vector<long> pids;
  std::unique_ptr<IpcWorld> world;
  std::unique_ptr<RankRunner> runner;
  set_stage("creating the world and the All2All");
  const auto created_t0 = Clock::now();
  try {
    auto boot = std::make_unique<UnixSocketBootstrap>(env);
    pids = boot->pids();
    world = std::make_unique<IpcWorld>(std::move(boot), device);
    runner = std::make_unique<RankRunner>(c, rank,
                                          make_all2all(Backend::kLowLatency, c.config(), *world));
    if (c.mode == Mode::kGraph) runner->capture();
  } catch (const std::exception& e) {
    if (faulty) {
      print_line(fmt::format("fault-setup rank={} error=\"{}\"", rank, e.what()));
      return 1;
    }
    record(s.o, e, -1, seconds_since(created_t0));
    s.failed = true;
  }

  Clock::time_point fault_t0 = Clock::now();
  const int last_round = c.fault_round + kRoundsAfterFault;
  for (int round = 0; round <= last_round && !s.failed; ++round) {
    set_stage("a round");
    const auto t0 = Clock::now();
    if (round == c.fault_round) fault_t0 = t0;
    if (faulty && round == c.fault_round) {
      try {
        return fail_at_point(c, *runner, pids);
      } catch (const std::exception& e) {
        print_line(
            fmt::format("fault-setup rank={} error=\"{}: {}\"", rank, error_class(e), e.what()));
        return 1;
      }
    }
    const uint64_t masked_before = runner->a2a().masked_ranks();
    try {
      runner->enqueue_dispatch();
      runner->enqueue_combine();
      runner->finish_round();
    } catch (const std::exception& e) {
      if (faulty) {
        print_line(fmt::format("fault-setup rank={} error=\"round {}: {}: {}\"", rank, round,
                               error_class(e), e.what()));
        return 1;
      }
      record(s.o, e, round, round >= c.fault_round ? seconds_since(fault_t0) : seconds_since(t0));
      s.failed = true;
      break;
    }
    if (faulty) {
      const std::string wrong = runner->check_output(all_ranks(c.world));
      if (!wrong.empty()) {
        print_line(fmt::format("fault-setup rank={} error=\"round {}: {}\"", rank, round, wrong));
        return 1;
      }
      continue;
    }
    after_round(c, *runner, s, round, masked_before, fault_t0);
  }

  set_stage("concluding");
  const bool hung = s.o.seen == "hang";
  conclude(c, hung ? nullptr : runner.get(), s, probe);
  (void)report(c, s.o);
  if (hung) {
    std::fflush(nullptr);
    std::_Exit(1);
  }
  // The peers are gone or failed: no closing barrier; the kernels of this rank have returned.
  return 0;
}

}  // namespace epx::fault
