#pragma once
// What the bootstrap, fingerprint and launcher tests share: ranks run as threads or as forked
// processes and what each did, the checks on that, private socket directories, the all-gather
// workload, a framework-style all-gather among threads, and running a command.
//
// Timing bounds: fault tests run with a timeout of 5 s where the fault must be *detected* (a
// dead peer, a refused rank) and require an answer within 2 s, so passing proves detection, not
// expiry; tests of expiry use 300 ms and require an answer within timeout + 1 s.

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "epx/bootstrap.hpp"
#include "epx/config.hpp"
#include "epx/error.hpp"

namespace epx {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0);

BootstrapOptions options(int rank, int size, const std::string& address, int timeout_ms = 5000);

// Checks inside ranks throw this; the harness records the message.
void require(bool ok, const std::string& what);

// What one rank did: finished, or threw (an epx::Error with its code, or something else).
struct Outcome {
  bool ok = false;
  bool epx_error = false;
  ErrorCode code = ErrorCode::kOk;
  std::string message;
  double seconds = 0;    // from the start of the run to the rank's end
  int wait_status = 0;   // processes only
};

Outcome run_rank(const std::function<void()>& body, Clock::time_point t0);

// Runs body(rank) on n threads of this process.
std::vector<Outcome> run_threads(int n, const std::function<void(int)>& body);

// Runs body(rank) in n forked processes. Each child reports its Outcome through a pipe and
// leaves with _exit (never returning into the test framework). Children still running after
// 20 s are killed, so a bug shows as a failure, not a hung suite.
std::vector<Outcome> run_processes(int n, const std::function<void(int)>& body);

::testing::AssertionResult succeeded(const Outcome& o);

// The rank threw an epx error of `code` whose message contains every one of `parts`.
::testing::AssertionResult failed_with(const Outcome& o, ErrorCode code,
                                       std::initializer_list<std::string> parts);

template <typename Fn>
::testing::AssertionResult throws_config_error(Fn&& fn,
                                               std::initializer_list<std::string> parts) {
  const Outcome o = run_rank(fn, Clock::now());
  return failed_with(o, ErrorCode::kConfig, parts);
}

// A private directory for socket files, removed afterwards.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

bool exists(const std::string& path);

// "tcp://127.0.0.1:PORT" with a port the kernel just handed out (free at the time of the call).
std::string loopback_tcp_address();

// Every rank's payload of one all-gather round: distinct per rank and round, of varying size
// (rank 1 of round 2 sends 300 KB, more than a socket buffer holds, to exercise partial I/O).
std::string payload(int rank, int round);

// The collective workload of one rank: three all-gather rounds, a barrier, an empty all-gather.
void gather_rounds(Bootstrap& b);

// Collective: every rank's pid as the rendezvous reported it at start-up equals the pid that
// rank all-gathers now (one process per rank).
void check_pids(SocketBootstrap& b);

// An all-gather among threads, standing in for a framework's (torch.distributed's) collective.
class ThreadAllGather {
 public:
  explicit ThreadAllGather(int n) : n_(n), slots_(size_t(n)) {}
  std::vector<std::string> operator()(int rank, const std::string& bytes) {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t generation = generation_;
    slots_[size_t(rank)] = bytes;
    if (++arrived_ == n_) {
      result_ = slots_;
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return result_;
    }
    cv_.wait(lock, [&] { return generation_ != generation; });
    return result_;
  }

 private:
  int n_;
  std::vector<std::string> slots_, result_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  std::mutex mutex_;
  std::condition_variable cv_;
};

// The EpConfig of a three-rank job, for fingerprints.
EpConfig job_config();

struct CommandResult {
  int status = -1;
  std::string out, err;
  double seconds = 0;
};

// Runs argv with extra environment entries, capturing stdout and stderr; killed after 20 s.
CommandResult run_command(const std::vector<std::string>& argv,
                          const std::vector<std::pair<std::string, std::string>>& env = {});

int exit_code(const CommandResult& r);  // the exit status, or -1 when killed by a signal

std::string self_exe();  // the path of this test binary

}  // namespace epx
