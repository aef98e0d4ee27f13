// epx_fault_rank: runs one case of the reliability fault matrix (scripts/fault_matrix.sh) and
// prints one `fault-result` line per surviving rank (fault_case.hpp says what each field means
// and when a case passes).
//
//   epx_fault_rank --fault stops-calling --at between                     # 3 in-process ranks
//   epx launch -n 2 --bootstrap /tmp/f.sock -- epx_fault_rank --world-kind ipc --fault killed
//       --at in-dispatch --mode graph
//
// Bad flags are refused (exit 2, "<flag> = <value>, expected <bound>") before any GPU is
// touched. Exit codes: 0 in-process: every survivor passed; ipc: this rank ran to its end (a
// survivor's verdict is in its line; the faulty rank failed as planned), 1 a survivor's verdict
// is fail (in-process) or something else went wrong, 2 bad flags, 3 no GPU, 4 the watchdog ended
// a run that outlived every bound.
//
// Under `epx launch` a rank that dies makes the launcher stop the others at once, before they
// could meet their error; so the rank to be killed runs as a child of its process, which waits
// for it, reports how it ended, and exits 0 when that was the planned SIGKILL.

#include <fmt/format.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "epx/bootstrap.hpp"
#include "epx/cuda_check.hpp"
#include "epx/error.hpp"
#include "fault_case.hpp"
#include "fault_run.hpp"

namespace {

using namespace epx;
using namespace epx::fault;

// The last resort against a hang of the driver itself: every wait it makes is bounded, and this
// bounds their sum. Ends the process (exit 4) with what it was doing.
class Watchdog {
 public:
  Watchdog(double seconds, int rank) : thread_([this, seconds, rank] { watch(seconds, rank); }) {}
  ~Watchdog() {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  void watch(double seconds, int rank) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (cv_.wait_for(lock, std::chrono::duration<double>(seconds), [this] { return done_; })) {
      return;
    }
    fmt::print(stderr,
               "epx_fault_rank: watchdog: {} still running after {:.0f} s ({}); ending the "
               "process: this case failed\n",
               rank < 0 ? std::string("the in-process world") : fmt::format("rank {}", rank),
               seconds, stage());
    std::fflush(nullptr);
    std::_Exit(4);
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

// Start-up (CUDA, the world, graphs) plus, per round that may wait, one timeout and a second.
double watchdog_seconds(const FaultCase& c) {
  return 30.0 + (kRoundsAfterFault + 2) * c.bound_seconds() + 0.05 * c.fault_round;
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return fmt::format("killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  }
  return fmt::format("ended with wait status {:#x}", status);
}

// The process of a rank to be killed: forks; the child returns (false) and runs the rank; the
// parent waits for it (bounded), reports how it ended and sets the exit code (true).
bool supervise_killed_rank(const FaultCase& c, int rank, int& exit_code) {
  std::fflush(nullptr);
  const pid_t parent = ::getpid();
  const pid_t child = ::fork();
  if (child < 0) {
    EPX_THROW(StateError, fmt::format("fork of the rank to be killed: {}", std::strerror(errno)));
  }
  if (child == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) std::_Exit(1);  // the parent ended before prctl took effect
    return false;
  }
  const double limit_s = watchdog_seconds(c) + 5.0;
  const auto t0 = std::chrono::steady_clock::now();
  int status = 0;
  for (;;) {
    const pid_t done = ::waitpid(child, &status, WNOHANG);
    if (done == child) break;
    if (done < 0 && errno != EINTR) {
      fmt::print(stderr, "epx_fault_rank: waitpid of rank {} (pid {}): {}\n", rank, long(child),
                 std::strerror(errno));
      exit_code = 1;
      return true;
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > limit_s) {
      fmt::print(stderr,
                 "epx_fault_rank: watchdog: rank {} (pid {}) still running after {:.0f} s; "
                 "killing it: this case failed\n",
                 rank, long(child), limit_s);
      (void)::kill(child, SIGKILL);
      (void)::waitpid(child, &status, 0);
      exit_code = 4;
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const bool planned = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
  fmt::print("fault-ended rank={} pid={} status=\"{}\" planned={}\n", rank, long(child),
             describe_status(status), planned ? 1 : 0);
  std::fflush(stdout);
  exit_code =
      planned ? 0 : (WIFEXITED(status) && WEXITSTATUS(status) != 0 ? WEXITSTATUS(status) : 1);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  // In-process ranks that share a GPU need a hardware work queue each (read once, by the first
  // CUDA call).
  ::setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  CLI::App app{"epx_fault_rank: one case of the reliability fault matrix"};
  FaultFlags flags;
  add_fault_flags(app, flags);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  FaultCase c;
  BootstrapOptions env;
  try {
    if (flags.world_kind == "ipc") env = BootstrapOptions::from_env();
    c = make_fault_case(flags, env);
  } catch (const Error& e) {
    fmt::print(stderr, "epx_fault_rank: {} error: {}\n", to_string(e.code()), e.what());
    return 2;
  }
  const int rank = c.kind == WorldKind::kIpc ? env.rank : -1;
  try {
    if (rank == c.faulty_rank && c.fault == Fault::kKilled) {
      int exit_code = 0;
      if (supervise_killed_rank(c, rank, exit_code)) return exit_code;
    }
    require_gpu("epx_fault_rank");
    const Watchdog watchdog(watchdog_seconds(c), rank);
    return c.kind == WorldKind::kInProcess ? run_in_process(c) : run_ipc(c, env);
  } catch (const UnsupportedError& e) {
    fmt::print(stderr, "epx_fault_rank: {}\n", e.what());
    return 3;
  } catch (const Error& e) {
    fmt::print(stderr, "epx_fault_rank: {} error ({}): {}\n", to_string(e.code()), stage(),
               e.what());
    return 1;
  }
}
