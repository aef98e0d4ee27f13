// The multi-process bootstrap (include/epx/bootstrap.hpp) and `epx launch`, on the CPU:
// all-gather and barrier over threads and over forked processes (1, 2, 4, 8 ranks), descriptor
// passing between processes, every start-up fault (rank out of range, used twice, world sizes
// that disagree, a second job on the address, a rank that never arrives), ranks that die or stay
// away mid-collective, socket files left behind, the start-up fingerprint, and the launcher.
//
// Timing bounds: fault tests run with a timeout of 5 s where the fault must be *detected* (a
// dead peer, a refused rank) and require an answer within 2 s, so passing proves detection, not
// expiry; tests of expiry use 300 ms and require an answer within timeout + 1 s.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "epx/bootstrap.hpp"
#include "epx/config.hpp"
#include "epx/error.hpp"
#include "epx/world.hpp"

#ifndef EPX_CLI_PATH
#error "EPX_CLI_PATH (the epx binary) must be defined by the build"
#endif

namespace epx {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

BootstrapOptions options(int rank, int size, const std::string& address, int timeout_ms = 5000) {
  BootstrapOptions o;
  o.rank = rank;
  o.world_size = size;
  o.address = address;
  o.timeout_ms = timeout_ms;
  return o;
}

// Checks inside ranks throw this; the harness records the message.
void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

// What one rank did: finished, or threw (an epx::Error with its code, or something else).
struct Outcome {
  bool ok = false;
  bool epx_error = false;
  ErrorCode code = ErrorCode::kOk;
  std::string message;
  double seconds = 0;    // from the start of the run to the rank's end
  int wait_status = 0;   // processes only
};

Outcome run_rank(const std::function<void()>& body, Clock::time_point t0) {
  Outcome o;
  try {
    body();
    o.ok = true;
  } catch (const Error& e) {
    o.epx_error = true;
    o.code = e.code();
    o.message = e.what();
  } catch (const std::exception& e) {
    o.message = e.what();
  }
  o.seconds = seconds_since(t0);
  return o;
}

// Runs body(rank) on n threads of this process.
std::vector<Outcome> run_threads(int n, const std::function<void(int)>& body) {
  std::vector<Outcome> out(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  const auto t0 = Clock::now();
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] { out[size_t(r)] = run_rank([&] { body(r); }, t0); });
  }
  for (auto& t : threads) t.join();
  return out;
}

// Runs body(rank) in n forked processes. Each child reports its Outcome through a pipe and
// leaves with _exit (never returning into the test framework). Children still running after
// 20 s are killed, so a bug shows as a failure, not a hung suite.
std::vector<Outcome> run_processes(int n, const std::function<void(int)>& body) {
  std::vector<pid_t> pids;
  std::vector<int> reads;
  const auto t0 = Clock::now();
  for (int r = 0; r < n; ++r) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) throw std::runtime_error("pipe2");
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork");
    if (pid == 0) {
      ::close(p[0]);
      const Outcome o = run_rank([&] { body(r); }, t0);
      const std::string report = std::string(o.ok ? "1" : "0") + (o.epx_error ? "1" : "0") +
                                 std::to_string(int(o.code)) + "\n" + o.message;
      size_t off = 0;
      while (off < report.size()) {
        const ssize_t w = ::write(p[1], report.data() + off, report.size() - off);
        if (w <= 0) break;
        off += size_t(w);
      }
      _exit(0);
    }
    ::close(p[1]);
    pids.push_back(pid);
    reads.push_back(p[0]);
  }
  std::vector<Outcome> out(static_cast<size_t>(n));
  std::vector<std::string> text(static_cast<size_t>(n));
  std::vector<bool> done(static_cast<size_t>(n), false);
  int remaining = n;
  while (remaining > 0) {
    std::vector<pollfd> pfds;
    std::vector<int> idx;
    for (int r = 0; r < n; ++r) {
      if (reads[size_t(r)] < 0) continue;
      pfds.push_back({reads[size_t(r)], POLLIN, 0});
      idx.push_back(r);
    }
    if (pfds.empty()) break;
    (void)::poll(pfds.data(), pfds.size(), 100);
    for (size_t i = 0; i < pfds.size(); ++i) {
      if (pfds[i].revents == 0) continue;
      const int r = idx[i];
      char buf[4096];
      const ssize_t got = ::read(reads[size_t(r)], buf, sizeof(buf));
      if (got > 0) {
        text[size_t(r)].append(buf, size_t(got));
      } else {
        ::close(reads[size_t(r)]);
        reads[size_t(r)] = -1;
        out[size_t(r)].seconds = seconds_since(t0);
      }
    }
    if (seconds_since(t0) > 20) {
      for (pid_t pid : pids) ::kill(pid, SIGKILL);
    }
  }
  for (int r = 0; r < n; ++r) {
    int status = 0;
    ::waitpid(pids[size_t(r)], &status, 0);
    Outcome& o = out[size_t(r)];
    o.wait_status = status;
    const std::string& t = text[size_t(r)];
    const size_t eol = t.find('\n');
    if (eol == std::string::npos || eol < 3) {
      o.message = "no report (the process died)";
      continue;
    }
    o.ok = t[0] == '1';
    o.epx_error = t[1] == '1';
    o.code = ErrorCode(std::atoi(t.substr(2, eol - 2).c_str()));
    o.message = t.substr(eol + 1);
  }
  return out;
}

testing::AssertionResult succeeded(const Outcome& o) {
  if (o.ok) return testing::AssertionSuccess();
  return testing::AssertionFailure() << "threw: " << o.message;
}

// The rank threw an epx error of `code` whose message contains every one of `parts`.
testing::AssertionResult failed_with(const Outcome& o, ErrorCode code,
                                     std::initializer_list<std::string> parts) {
  if (o.ok) return testing::AssertionFailure() << "did not throw";
  if (!o.epx_error) return testing::AssertionFailure() << "threw a non-epx error: " << o.message;
  if (o.code != code) {
    return testing::AssertionFailure() << "threw " << to_string(o.code) << " (wanted "
                                       << to_string(code) << "): " << o.message;
  }
  for (const std::string& p : parts) {
    if (o.message.find(p) == std::string::npos) {
      return testing::AssertionFailure() << "message \"" << o.message << "\" lacks \"" << p << "\"";
    }
  }
  return testing::AssertionSuccess() << o.message;
}

template <typename Fn>
testing::AssertionResult throws_config_error(Fn&& fn, std::initializer_list<std::string> parts) {
  const Outcome o = run_rank(fn, Clock::now());
  return failed_with(o, ErrorCode::kConfig, parts);
}

// A private directory for socket files, removed afterwards.
class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/epx-bootstrap-test-XXXXXX";
    const char* d = ::mkdtemp(tmpl);
    if (d == nullptr) throw std::runtime_error("mkdtemp");
    path_ = d;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

bool exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

// Every rank's payload of one all-gather round: distinct per rank and round, of varying size
// (rank 1 of round 2 sends 300 KB, more than a socket buffer holds, to exercise partial I/O).
std::string payload(int rank, int round) {
  std::string p = "rank " + std::to_string(rank) + " round " + std::to_string(round) + ":";
  const size_t extra = (round == 2 && rank == 1) ? 300000 : size_t(rank) * 37 * size_t(round);
  p.append(extra, char('a' + (rank + round) % 26));
  return p;
}

// The collective workload of one rank: three all-gather rounds, a barrier, an empty all-gather.
void gather_rounds(Bootstrap& b) {
  const int n = b.size();
  for (int round = 0; round < 3; ++round) {
    const std::vector<std::string> all = b.all_gather(payload(b.rank(), round));
    require(int(all.size()) == n, "all_gather returned " + std::to_string(all.size()) + " parts");
    for (int q = 0; q < n; ++q) {
      require(all[size_t(q)] == payload(q, round),
              "round " + std::to_string(round) + ": part of rank " + std::to_string(q));
    }
  }
  b.barrier();
  const std::vector<std::string> empty = b.all_gather(std::string());
  for (const std::string& e : empty) require(e.empty(), "empty all_gather");
}

// ---- options and the environment ------------------------------------------------------------

TEST(BootstrapOptions, ParsesTheEnvironment) {
  const BootstrapOptions o = BootstrapOptions::parse_env("2", "4", "@job", "250");
  EXPECT_EQ(o.rank, 2);
  EXPECT_EQ(o.world_size, 4);
  EXPECT_EQ(o.address, "@job");
  EXPECT_EQ(o.timeout_ms, 250);
  const BootstrapOptions single = BootstrapOptions::parse_env(nullptr, nullptr, nullptr, nullptr);
  EXPECT_EQ(single.rank, 0);
  EXPECT_EQ(single.world_size, 1);
  EXPECT_EQ(BootstrapOptions::parse_env("0", "2", "unix:/tmp/x.sock", nullptr).address,
            "unix:/tmp/x.sock");
}

TEST(BootstrapOptions, FromEnvReadsTheVariables) {
  ::setenv("EPX_RANK", "1", 1);
  ::setenv("EPX_WORLD_SIZE", "3", 1);
  ::setenv("EPX_BOOTSTRAP", "@from-env", 1);
  const BootstrapOptions o = BootstrapOptions::from_env();
  ::setenv("EPX_RANK", "3", 1);
  const bool refused = bool(throws_config_error([] { (void)BootstrapOptions::from_env(); },
                                                {"EPX_RANK = \"3\"", "EPX_WORLD_SIZE = 3"}));
  ::unsetenv("EPX_RANK");
  ::unsetenv("EPX_WORLD_SIZE");
  ::unsetenv("EPX_BOOTSTRAP");
  EXPECT_EQ(o.rank, 1);
  EXPECT_EQ(o.world_size, 3);
  EXPECT_EQ(o.address, "@from-env");
  EXPECT_TRUE(refused);
}

TEST(BootstrapOptions, MessagesNameVariableValueAndBound) {
  auto parse = [](const char* r, const char* w, const char* a, const char* t = nullptr) {
    return [=] { (void)BootstrapOptions::parse_env(r, w, a, t); };
  };
  EXPECT_TRUE(throws_config_error(parse("4", "4", "@x"),
                                  {"EPX_RANK = \"4\"", "[0, EPX_WORLD_SIZE = 4)"}));
  EXPECT_TRUE(throws_config_error(parse("-1", "4", "@x"), {"EPX_RANK = \"-1\""}));
  EXPECT_TRUE(throws_config_error(parse("1x", "4", "@x"), {"EPX_RANK = \"1x\""}));
  EXPECT_TRUE(throws_config_error(parse("0", "99999999999999999999999", "@x"),
                                  {"EPX_WORLD_SIZE = \"99999999999999999999999\""}));
  EXPECT_TRUE(throws_config_error(parse("0", "65", "@x"), {"EPX_WORLD_SIZE = \"65\"", "[1, 64]"}));
  EXPECT_TRUE(throws_config_error(parse("0", "0", "@x"), {"EPX_WORLD_SIZE = \"0\""}));
  EXPECT_TRUE(throws_config_error(parse("1", nullptr, "@x"),
                                  {"EPX_RANK = \"1\"", "EPX_WORLD_SIZE is not"}));
  EXPECT_TRUE(throws_config_error(parse(nullptr, "2", "@x"),
                                  {"EPX_WORLD_SIZE = \"2\"", "EPX_RANK is not"}));
  EXPECT_TRUE(throws_config_error(parse("0", "2", nullptr),
                                  {"EPX_BOOTSTRAP is not set", "EPX_WORLD_SIZE = 2"}));
  EXPECT_TRUE(throws_config_error(parse("0", "2", ""), {"EPX_BOOTSTRAP = \"\""}));
  const std::string long_path = "/tmp/" + std::string(110, 'p');
  EXPECT_TRUE(throws_config_error(parse("0", "2", long_path.c_str()),
                                  {"EPX_BOOTSTRAP", "115 bytes", "at most 107"}));
  EXPECT_TRUE(throws_config_error(parse("0", "2", "@x", "soon"), {"EPX_TIMEOUT_MS = \"soon\""}));
}

TEST(HardwareQueues, ParsesCudaDeviceMaxConnections) {
  EXPECT_EQ(hardware_queues_per_gpu(nullptr), 8);  // CUDA's default
  EXPECT_EQ(hardware_queues_per_gpu("1"), 1);
  EXPECT_EQ(hardware_queues_per_gpu("32"), 32);
  for (const char* bad : {"0", "33", "", "8x", "-4", "1000"}) {
    EXPECT_TRUE(throws_config_error([bad] { (void)hardware_queues_per_gpu(bad); },
                                    {"CUDA_DEVICE_MAX_CONNECTIONS = \"" + std::string(bad) + "\"",
                                     "1..32"}))
        << bad;
  }
}

TEST(BootstrapOptions, ValidateNamesTheField) {
  EXPECT_TRUE(throws_config_error([] { UnixSocketBootstrap b(options(4, 4, "@x")); },
                                  {"rank = 4", "[0, world_size = 4)"}));
  EXPECT_TRUE(throws_config_error([] { UnixSocketBootstrap b(options(0, 65, "@x")); },
                                  {"world_size = 65"}));
  EXPECT_TRUE(throws_config_error([] { UnixSocketBootstrap b(options(0, 2, "")); },
                                  {"address is empty"}));
  EXPECT_TRUE(throws_config_error([] { UnixSocketBootstrap b(options(0, 2, "@x", 0)); },
                                  {"timeout_ms = 0"}));
}

TEST(BootstrapOptions, UniqueAddressesDiffer) {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) seen.insert(unique_bootstrap_address());
  EXPECT_EQ(seen.size(), 100u);
  EXPECT_EQ(seen.begin()->substr(0, 5), "@epx-");
}

// ---- all-gather and barrier -------------------------------------------------------------------

class BootstrapSizes : public ::testing::TestWithParam<int> {};

TEST_P(BootstrapSizes, AllGatherOverThreads) {
  const int n = GetParam();
  const std::string address = unique_bootstrap_address();
  const auto out = run_threads(n, [&](int r) {
    UnixSocketBootstrap b(options(r, n, address));
    require(b.rank() == r && b.size() == n, "rank/size");
    gather_rounds(b);
  });
  for (int r = 0; r < n; ++r) EXPECT_TRUE(succeeded(out[size_t(r)])) << "rank " << r;
}

TEST_P(BootstrapSizes, AllGatherOverProcesses) {
  const int n = GetParam();
  const std::string address = unique_bootstrap_address();
  const auto out = run_processes(n, [&](int r) {
    UnixSocketBootstrap b(options(r, n, address));
    gather_rounds(b);
    // Every rank learnt every rank's pid at start-up.
    const std::vector<std::string> pids = b.all_gather(std::to_string(::getpid()));
    for (int q = 0; q < n; ++q) {
      require(std::to_string(b.pids()[size_t(q)]) == pids[size_t(q)],
              "pid of rank " + std::to_string(q));
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_TRUE(succeeded(out[size_t(r)])) << "rank " << r;
}

TEST_P(BootstrapSizes, DescriptorsPassBetweenProcesses) {
  const int n = GetParam();
  const std::string address = unique_bootstrap_address();
  const auto out = run_processes(n, [&](int r) {
    UnixSocketBootstrap b(options(r, n, address));
    UniqueFd mine(::memfd_create("epx-test", MFD_CLOEXEC));
    require(mine.valid(), "memfd_create");
    const std::string text = "memfd of rank " + std::to_string(r);
    require(::pwrite(mine.get(), text.data(), text.size(), 0) == ssize_t(text.size()), "pwrite");
    std::vector<UniqueFd> fds = b.all_gather_fds(mine.get());
    require(int(fds.size()) == n, "one descriptor per rank");
    for (int q = 0; q < n; ++q) {
      const int fd = fds[size_t(q)].get();
      require(fd >= 0 && fd != mine.get(), "a new descriptor");
      require((::fcntl(fd, F_GETFD) & FD_CLOEXEC) != 0, "close-on-exec");
      // (Only the text: a peer may already have written its mark further on.)
      const std::string want = "memfd of rank " + std::to_string(q);
      std::string got(want.size(), '\0');
      require(::pread(fd, got.data(), got.size(), 0) == ssize_t(got.size()) && got == want,
              "contents of rank " + std::to_string(q) + "'s memfd: " + got);
    }
    // The same file, not a copy: write into the next rank's memfd, it reads it from its own.
    const char mark = char('A' + r);
    require(::pwrite(fds[size_t((r + 1) % n)].get(), &mark, 1, 100 + r) == 1, "pwrite to peer");
    b.barrier();
    const int prev = (r + n - 1) % n;
    char seen = 0;
    require(::pread(mine.get(), &seen, 1, 100 + prev) == 1 && seen == char('A' + prev),
            "write of rank " + std::to_string(prev) + " visible in this rank's memfd");
  });
  for (int r = 0; r < n; ++r) EXPECT_TRUE(succeeded(out[size_t(r)])) << "rank " << r;
}

INSTANTIATE_TEST_SUITE_P(Ranks, BootstrapSizes, ::testing::Values(1, 2, 4, 8));

TEST(UnixSocketBootstrap, FilesystemAddressLeavesNoFile) {
  TempDir dir;
  const std::string path = dir.file("job.sock");
  const auto out = run_threads(3, [&](int r) {
    UnixSocketBootstrap b(options(r, 3, path));
    gather_rounds(b);
    require(exists(path), "the socket file exists while the job runs");
    b.barrier();  // nobody destroys its object before every rank looked
  });
  for (const auto& o : out) EXPECT_TRUE(succeeded(o));
  EXPECT_FALSE(exists(path));
}

TEST(UnixSocketBootstrap, StaleSocketFileIsReplaced) {
  TempDir dir;
  const std::string path = dir.file("stale.sock");
  {  // a socket file with nobody behind it, as a killed rank 0 leaves it
    UniqueFd s(::socket(AF_UNIX, SOCK_STREAM, 0));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strcpy(a.sun_path, path.c_str());
    ASSERT_EQ(::bind(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  }
  ASSERT_TRUE(exists(path));
  const auto out = run_threads(2, [&](int r) {
    UnixSocketBootstrap b(options(r, 2, path));
    gather_rounds(b);
  });
  for (const auto& o : out) EXPECT_TRUE(succeeded(o));
  EXPECT_FALSE(exists(path));
}

TEST(UnixSocketBootstrap, RemoveStaleSocketFile) {
  TempDir dir;
  const std::string path = dir.file("left.sock");
  {
    UniqueFd s(::socket(AF_UNIX, SOCK_STREAM, 0));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strcpy(a.sun_path, path.c_str());
    ASSERT_EQ(::bind(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  }
  EXPECT_TRUE(remove_stale_socket_file(path));
  EXPECT_FALSE(exists(path));
  EXPECT_FALSE(remove_stale_socket_file(path));
  EXPECT_FALSE(remove_stale_socket_file("@abstract-has-no-file"));
  // A live job's file stays.
  std::vector<std::unique_ptr<UnixSocketBootstrap>> job(2);
  const auto started = run_threads(2, [&](int r) {
    job[size_t(r)] = std::make_unique<UnixSocketBootstrap>(options(r, 2, path));
  });
  ASSERT_TRUE(succeeded(started[0]) && succeeded(started[1]));
  EXPECT_FALSE(remove_stale_socket_file(path));
  EXPECT_TRUE(exists(path));
  job.clear();
  EXPECT_FALSE(exists(path));
}

TEST(UnixSocketBootstrap, DifferentCollectivesAreNamed) {
  const std::string address = unique_bootstrap_address();
  const auto out = run_threads(2, [&](int r) {
    UnixSocketBootstrap b(options(r, 2, address));
    if (r == 0) {
      (void)b.all_gather("x");
    } else {
      int p[2];
      require(::pipe(p) == 0, "pipe");
      UniqueFd a(p[0]), c(p[1]);
      (void)b.all_gather_fds(a.get());
    }
  });
  for (const auto& o : out) {
    EXPECT_TRUE(failed_with(o, ErrorCode::kPeer,
                            {"rank 1", "called all_gather_fds #1 while rank 0 called all_gather #1"}));
  }
}

TEST(UnixSocketBootstrap, BadDescriptorIsAnInputError) {
  const std::string address = unique_bootstrap_address();
  UnixSocketBootstrap b(options(0, 1, address));
  const Outcome o = run_rank([&] { (void)b.all_gather_fds(-1); }, Clock::now());
  EXPECT_TRUE(failed_with(o, ErrorCode::kInput, {"fd = -1", "an open file descriptor"}));
}

// ---- start-up faults --------------------------------------------------------------------------

TEST(UnixSocketBootstrap, RankUsedTwice) {
  const std::string address = unique_bootstrap_address();
  const int ranks[3] = {0, 1, 1};
  const auto out = run_threads(3, [&](int i) { UnixSocketBootstrap b(options(ranks[i], 3, address)); });
  for (const auto& o : out) {
    EXPECT_TRUE(failed_with(o, ErrorCode::kConfig, {"rank 1 used twice", "pid"}));
    EXPECT_LT(o.seconds, 2.0) << "detected, not timed out";
  }
}

// Whether a listener accepts connections at an abstract address ("@name").
bool listening(const std::string& address) {
  UniqueFd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path + 1, address.data() + 1, address.size() - 1);
  const auto len = socklen_t(offsetof(sockaddr_un, sun_path) + address.size());
  return ::connect(s.get(), reinterpret_cast<sockaddr*>(&a), len) == 0;
}

TEST(UnixSocketBootstrap, RankZeroUsedTwice) {
  const std::string address = unique_bootstrap_address();
  Outcome first;
  std::thread t([&] {
    first = run_rank([&] { UnixSocketBootstrap b(options(0, 2, address, 3000)); }, Clock::now());
  });
  const auto t0 = Clock::now();
  while (!listening(address) && seconds_since(t0) < 2) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const Outcome second =
      run_rank([&] { UnixSocketBootstrap b(options(0, 2, address)); }, Clock::now());
  EXPECT_TRUE(failed_with(second, ErrorCode::kConfig,
                          {"already in use by a live process", "a second rank 0"}));
  EXPECT_LT(second.seconds, 1.0);
  // The first rank 0 is undisturbed: its rank 1 arrives now.
  const Outcome member =
      run_rank([&] { UnixSocketBootstrap b(options(1, 2, address)); }, Clock::now());
  t.join();
  EXPECT_TRUE(succeeded(first));
  EXPECT_TRUE(succeeded(member));
}

TEST(UnixSocketBootstrap, WorldSizesDisagree) {
  const std::string address = unique_bootstrap_address();
  const int sizes[2] = {2, 3};
  const auto out = run_threads(2, [&](int r) { UnixSocketBootstrap b(options(r, sizes[r], address)); });
  for (const auto& o : out) {
    EXPECT_TRUE(failed_with(o, ErrorCode::kConfig,
                            {"world size disagrees", "rank 0 has EPX_WORLD_SIZE = 2",
                             "rank 1 (pid", "has 3"}));
    EXPECT_LT(o.seconds, 2.0);
  }
}

TEST(UnixSocketBootstrap, SecondJobOnTheSameAddress) {
  for (const bool file : {false, true}) {
    SCOPED_TRACE(file ? "socket file" : "abstract address");
    TempDir dir;
    const std::string address = file ? dir.file("shared.sock") : unique_bootstrap_address();
    std::vector<std::unique_ptr<UnixSocketBootstrap>> job(2);
    const auto started = run_threads(2, [&](int r) {
      job[size_t(r)] = std::make_unique<UnixSocketBootstrap>(options(r, 2, address));
    });
    ASSERT_TRUE(succeeded(started[0]) && succeeded(started[1]));
    // The second job: its rank 0 finds the address taken, its rank 1 is refused by the first
    // job's rank 0; both at once, not after the timeout.
    const auto second = run_threads(2, [&](int r) { UnixSocketBootstrap b(options(r, 2, address)); });
    EXPECT_TRUE(failed_with(second[0], ErrorCode::kConfig, {"already in use by a live process"}));
    EXPECT_TRUE(failed_with(second[1], ErrorCode::kConfig,
                            {"in use by a running job of 2 ranks", "cannot join"}));
    for (const auto& o : second) EXPECT_LT(o.seconds, 2.0);
    // The first job is undisturbed.
    const auto still = run_threads(2, [&](int r) { gather_rounds(*job[size_t(r)]); });
    EXPECT_TRUE(succeeded(still[0]) && succeeded(still[1]));
    job.clear();
    if (file) {
      EXPECT_FALSE(exists(address));
    }
  }
}

TEST(UnixSocketBootstrap, RankThatNeverArrivesIsNamed) {
  TempDir dir;
  const std::string path = dir.file("late.sock");
  const int timeout_ms = 300;
  const auto out = run_threads(2, [&](int r) { UnixSocketBootstrap b(options(r, 3, path, timeout_ms)); });
  for (const auto& o : out) {
    EXPECT_TRUE(failed_with(o, ErrorCode::kTimeout,
                            {"rank 2 of 3 did not arrive within 300 ms", "arrived: ranks 0, 1"}));
    EXPECT_LT(o.seconds, timeout_ms / 1000.0 + 1.0);
  }
  EXPECT_FALSE(exists(path));
}

TEST(UnixSocketBootstrap, RankZeroThatNeverArrivesIsNamed) {
  const auto t0 = Clock::now();
  const Outcome o = run_rank(
      [] { UnixSocketBootstrap b(options(1, 2, unique_bootstrap_address(), 300)); }, t0);
  EXPECT_TRUE(failed_with(o, ErrorCode::kTimeout, {"rank 0 did not arrive within 300 ms"}));
  EXPECT_LT(o.seconds, 1.3);
}

// ---- faults after start-up --------------------------------------------------------------------

TEST(UnixSocketBootstrap, RankAbsentFromACollectiveIsNamed) {
  const std::string address = unique_bootstrap_address();
  std::atomic<int> finished{0};
  const auto out = run_threads(3, [&](int r) {
    UnixSocketBootstrap b(options(r, 3, address, 300));
    if (r == 2) {  // alive, but never calls the collective
      while (finished.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return;
    }
    const auto t0 = Clock::now();
    try {
      (void)b.all_gather("x");
    } catch (...) {
      ++finished;
      require(seconds_since(t0) < 1.3, "answered within the timeout + 1 s");
      // The object refuses further use, naming the first error.
      try {
        b.barrier();
      } catch (const StateError& e) {
        require(std::string(e.what()).find("did not call it") != std::string::npos,
                "StateError names the first error");
        throw;
      }
    }
  });
  EXPECT_TRUE(succeeded(out[2]));
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(failed_with(out[size_t(r)], ErrorCode::kState,
                            {"refuses further collectives", "all_gather #1: rank 2 did not call "
                                                            "it within 300 ms"}))
        << "rank " << r;
  }
}

TEST(UnixSocketBootstrap, RankKilledMidCollectiveIsNamed) {
  TempDir dir;
  const std::string path = dir.file("kill.sock");
  const auto out = run_processes(3, [&](int r) {
    UnixSocketBootstrap b(options(r, 3, path, 5000));
    (void)b.all_gather("first");
    if (r == 2) ::raise(SIGKILL);
    (void)b.all_gather("second");
  });
  ASSERT_TRUE(WIFSIGNALED(out[2].wait_status));
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(failed_with(out[size_t(r)], ErrorCode::kPeer,
                            {"all_gather #2", "rank 2 (pid", "disconnected"}))
        << "rank " << r;
    EXPECT_LT(out[size_t(r)].seconds, 2.0) << "detected, not timed out";
  }
  EXPECT_FALSE(exists(path));
}

TEST(UnixSocketBootstrap, RankZeroKilledMidCollectiveIsNamed) {
  TempDir dir;
  const std::string path = dir.file("kill0.sock");
  const auto out = run_processes(3, [&](int r) {
    UnixSocketBootstrap b(options(r, 3, path, 5000));
    (void)b.all_gather("first");
    if (r == 0) ::raise(SIGKILL);
    (void)b.all_gather("second");
  });
  ASSERT_TRUE(WIFSIGNALED(out[0].wait_status));
  for (int r = 1; r < 3; ++r) {
    EXPECT_TRUE(failed_with(out[size_t(r)], ErrorCode::kPeer,
                            {"all_gather #2", "rank 0 (pid", "disconnected"}))
        << "rank " << r;
    EXPECT_LT(out[size_t(r)].seconds, 2.0);
  }
  // Rank 0 could not remove its file; a survivor did.
  EXPECT_FALSE(exists(path));
}

// ---- CallbackBootstrap and the fingerprint ---------------------------------------------------

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

TEST(CallbackBootstrap, AllGatherThroughTheFrameworkFunction) {
  const int n = 4;
  ThreadAllGather gather(n);
  const auto out = run_threads(n, [&](int r) {
    CallbackBootstrap b(r, n, [&, r](const std::string& bytes) { return gather(r, bytes); });
    require(!b.can_pass_fds(), "a framework's all-gather passes no descriptors");
    gather_rounds(b);
  });
  for (const auto& o : out) EXPECT_TRUE(succeeded(o));
}

TEST(CallbackBootstrap, RefusesBadArgumentsAndResults) {
  auto echo = [](const std::string& s) { return std::vector<std::string>{s}; };
  EXPECT_TRUE(throws_config_error([&] { CallbackBootstrap b(2, 2, echo); }, {"rank = 2"}));
  EXPECT_TRUE(throws_config_error([&] { CallbackBootstrap b(0, 0, echo); }, {"size = 0"}));
  EXPECT_TRUE(throws_config_error([] { CallbackBootstrap b(0, 1, nullptr); }, {"all_gather"}));
  CallbackBootstrap wrong(0, 2, echo);
  const Outcome o = run_rank([&] { (void)wrong.all_gather("x"); }, Clock::now());
  EXPECT_TRUE(failed_with(o, ErrorCode::kPeer, {"all_gather callback result size = 1", "2"}));
  const Outcome fds = run_rank([&] { (void)wrong.all_gather_fds(0); }, Clock::now());
  EXPECT_TRUE(failed_with(fds, ErrorCode::kUnsupported, {"cannot pass file descriptors"}));
}

EpConfig job_config() {
  EpConfig c;
  c.world_size = 3;
  c.hidden = 7168;
  c.num_experts = 48;
  c.topk = 8;
  c.max_tokens_per_rank = 128;
  return c;
}

TEST(Fingerprint, CanonicalTextWithoutRank) {
  EpConfig a = job_config();
  const std::string text = fingerprint(a, Backend::kLowLatency);
  EXPECT_EQ(text.rfind(std::string("epx_version=") + library_version() + "\n", 0), 0u) << text;
  for (const char* field : {"backend=low_latency\n", "world_size=3\n", "hidden=7168\n",
                            "num_experts=48\n", "topk=8\n", "max_tokens_per_rank=128\n",
                            "dtype=bf16-to-fp8\n", "scale_layout=row\n", "layout=token\n",
                            "deterministic=true\n", "timeout_ms=10000\n"}) {
    EXPECT_NE(text.find(field), std::string::npos) << field << " in\n" << text;
  }
  EXPECT_EQ(text.find("\nrank="), std::string::npos);
  EpConfig b = a;
  b.rank = 2;
  EXPECT_EQ(fingerprint(b, Backend::kLowLatency), text);
  b.hidden = 4096;
  EXPECT_NE(fingerprint(b, Backend::kLowLatency), text);
  EXPECT_NE(fingerprint(a, Backend::kNaive), text);
  EXPECT_STREQ(library_version(), "0.1.0");
}

// Runs check_fingerprints on 3 thread ranks; `vary(rank)` gives each rank's fingerprint.
std::vector<Outcome> check_three(const std::function<std::string(int)>& vary) {
  ThreadAllGather gather(3);
  return run_threads(3, [&](int r) {
    CallbackBootstrap b(r, 3, [&, r](const std::string& bytes) { return gather(r, bytes); });
    check_fingerprints(b, vary(r));
  });
}

TEST(Fingerprint, EqualConfigsPass) {
  const auto out = check_three([](int r) {
    EpConfig c = job_config();
    c.rank = r;
    return fingerprint(c, Backend::kLowLatency);
  });
  for (const auto& o : out) EXPECT_TRUE(succeeded(o));
}

TEST(Fingerprint, MismatchNamesFieldValuesAndRanksOnEveryRank) {
  const auto hidden = check_three([](int r) {
    EpConfig c = job_config();
    c.rank = r;
    if (r == 2) c.hidden = 4096;
    return fingerprint(c, Backend::kLowLatency);
  });
  for (const auto& o : hidden) {
    EXPECT_TRUE(failed_with(o, ErrorCode::kConfig, {"hidden: rank 0 has 7168, rank 2 has 4096"}));
  }
  const auto backend = check_three([](int r) {
    return fingerprint(job_config(), r == 1 ? Backend::kNaive : Backend::kLowLatency);
  });
  for (const auto& o : backend) {
    EXPECT_TRUE(failed_with(o, ErrorCode::kConfig,
                            {"backend: rank 0 has low_latency, rank 1 has naive"}));
  }
  // Several fields differ: the first in fingerprint order is named.
  const auto several = check_three([](int r) {
    EpConfig c = job_config();
    if (r == 1) c.dtype = DispatchDtype::kBF16;
    if (r == 2) c.topk = 4;
    return fingerprint(c, Backend::kLowLatency);
  });
  for (const auto& o : several) {
    EXPECT_TRUE(failed_with(o, ErrorCode::kConfig, {"topk: rank 0 has 8, rank 2 has 4"}));
  }
  // A different library version is named before anything else.
  const auto version = check_three([](int r) {
    std::string t = fingerprint(job_config(), Backend::kLowLatency);
    if (r == 1) {
      const std::string key = std::string("epx_version=") + library_version();
      t.replace(t.find(key), key.size(), "epx_version=9.9.9");
      t.replace(t.find("hidden=7168"), 11, "hidden=1024");
    }
    return t;
  });
  for (const auto& o : version) {
    EXPECT_TRUE(failed_with(o, ErrorCode::kConfig,
                            {std::string("epx_version: rank 0 has ") + library_version() +
                             ", rank 1 has 9.9.9"}));
  }
}

TEST(Fingerprint, OverUnixSockets) {
  const std::string address = unique_bootstrap_address();
  const auto out = run_processes(2, [&](int r) {
    UnixSocketBootstrap b(options(r, 2, address));
    EpConfig c = job_config();
    c.world_size = 2;
    c.max_tokens_per_rank = r == 0 ? 128 : 256;
    check_fingerprints(b, c, Backend::kLowLatency);
  });
  for (const auto& o : out) {
    EXPECT_TRUE(failed_with(o, ErrorCode::kConfig,
                            {"max_tokens_per_rank: rank 0 has 128, rank 1 has 256"}));
  }
}

// ---- epx launch -------------------------------------------------------------------------------

struct CommandResult {
  int status = -1;
  std::string out, err;
  double seconds = 0;
};

// Runs argv with extra environment entries, capturing stdout and stderr; killed after 20 s.
CommandResult run_command(const std::vector<std::string>& argv,
                          const std::vector<std::pair<std::string, std::string>>& env = {}) {
  int out_p[2], err_p[2];
  if (::pipe2(out_p, O_CLOEXEC) != 0 || ::pipe2(err_p, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
  const auto t0 = Clock::now();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out_p[1], STDOUT_FILENO);
    ::dup2(err_p[1], STDERR_FILENO);
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    _exit(127);
  }
  ::close(out_p[1]);
  ::close(err_p[1]);
  CommandResult r;
  int fds[2] = {out_p[0], err_p[0]};
  std::string* sinks[2] = {&r.out, &r.err};
  while (fds[0] >= 0 || fds[1] >= 0) {
    pollfd p[2] = {{fds[0], POLLIN, 0}, {fds[1], POLLIN, 0}};
    (void)::poll(p, 2, 100);
    for (int i = 0; i < 2; ++i) {
      if (fds[i] < 0 || p[i].revents == 0) continue;
      char buf[4096];
      const ssize_t n = ::read(fds[i], buf, sizeof(buf));
      if (n > 0) {
        sinks[i]->append(buf, size_t(n));
      } else {
        ::close(fds[i]);
        fds[i] = -1;
      }
    }
    if (seconds_since(t0) > 20) ::kill(pid, SIGKILL);
  }
  ::waitpid(pid, &r.status, 0);
  r.seconds = seconds_since(t0);
  return r;
}

int exit_code(const CommandResult& r) { return WIFEXITED(r.status) ? WEXITSTATUS(r.status) : -1; }

std::string self_exe() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

TEST(Launch, SetsTheRankEnvironmentAndPrefixesOutput) {
  const auto r = run_command({EPX_CLI_PATH, "launch", "-n", "4", "--", "sh", "-c",
                              "echo \"rank=$EPX_RANK size=$EPX_WORLD_SIZE addr=$EPX_BOOTSTRAP\"; "
                              "echo \"to stderr $EPX_RANK\" >&2"});
  ASSERT_EQ(exit_code(r), 0) << r.err;
  std::set<std::string> addresses;
  for (int i = 0; i < 4; ++i) {
    const std::string line = "[rank " + std::to_string(i) + "] rank=" + std::to_string(i) + " size=4 addr=@epx-";
    const size_t at = r.out.find(line);
    ASSERT_NE(at, std::string::npos) << line << " in\n" << r.out;
    addresses.insert(r.out.substr(at + line.size() - 5, r.out.find('\n', at) - (at + line.size() - 5)));
    EXPECT_NE(r.err.find("[rank " + std::to_string(i) + "] to stderr " + std::to_string(i) + "\n"),
              std::string::npos)
        << r.err;
  }
  EXPECT_EQ(addresses.size(), 1u) << "every rank gets the same address";
  const auto again = run_command({EPX_CLI_PATH, "launch", "-n", "1", "--", "sh", "-c", "echo $EPX_BOOTSTRAP"});
  EXPECT_EQ(again.out.find(*addresses.begin()), std::string::npos) << "a fresh address per launch";
  const auto given = run_command({EPX_CLI_PATH, "launch", "-n", "2", "--bootstrap", "@given", "--",
                                  "sh", "-c", "echo $EPX_BOOTSTRAP"});
  EXPECT_NE(given.out.find("[rank 1] @given\n"), std::string::npos) << given.out;
}

TEST(Launch, AFailingRankStopsTheOthers) {
  const auto r = run_command(
      {EPX_CLI_PATH, "launch", "-n", "3", "--grace-ms", "500", "--", "sh", "-c",
       "if [ \"$EPX_RANK\" = 1 ]; then echo going >&2; exit 3; fi; sleep 20"});
  EXPECT_EQ(exit_code(r), 3) << r.err;
  EXPECT_LT(r.seconds, 5.0) << "the sleeping ranks were stopped";
  EXPECT_NE(r.err.find("[rank 1] going"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rank 1 failed: exited with code 3"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("FAILED: rank 1 of 3 exited with code 3 first"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rank 0 killed by signal 15 (SIGTERM) (stopped by epx launch)"),
            std::string::npos)
      << r.err;
}

TEST(Launch, ReportsSignalsAndMissingCommands) {
  const auto killed = run_command({EPX_CLI_PATH, "launch", "-n", "1", "--", "sh", "-c", "kill -9 $$"});
  EXPECT_EQ(exit_code(killed), 128 + 9);
  EXPECT_NE(killed.err.find("rank 0 failed: killed by signal 9 (SIGKILL)"), std::string::npos)
      << killed.err;
  const auto missing = run_command({EPX_CLI_PATH, "launch", "-n", "2", "--", "/nonexistent/command"});
  EXPECT_EQ(exit_code(missing), 127);
  EXPECT_NE(missing.err.find("cannot run /nonexistent/command"), std::string::npos) << missing.err;
  const auto ok = run_command({EPX_CLI_PATH, "launch", "-n", "2", "--", "true"});
  EXPECT_EQ(exit_code(ok), 0) << ok.err;
  const auto none = run_command({EPX_CLI_PATH, "launch", "-n", "0", "--", "true"});
  EXPECT_NE(exit_code(none), 0);
  EXPECT_NE(none.err.find("-n = 0"), std::string::npos) << none.err;
}

// The graph-diagnosis flags live in `epx diag graph-replay`, not in `epx check`; there they are
// refused (exit 2, naming the flag) without graph replays, before any GPU is needed.
TEST(CheckCli, GraphDiagnosisFlagsNeedAGraphRun) {
  for (const std::vector<std::string>& extra :
       {std::vector<std::string>{"--graph-conditional"}, {"--rank-threads"},
        {"--graph-execs", "2"}, {"--graph-split"}}) {
    std::vector<std::string> argv = {EPX_CLI_PATH, "diag", "graph-replay"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    const auto r = run_command(argv);
    EXPECT_EQ(exit_code(r), 2) << r.err;
    EXPECT_NE(r.err.find(extra[0] + " = given, expected only with --graph"), std::string::npos)
        << r.err;
  }
  const auto zero =
      run_command({EPX_CLI_PATH, "diag", "graph-replay", "--graph", "3", "--graph-execs", "0"});
  EXPECT_EQ(exit_code(zero), 2) << zero.err;
  EXPECT_NE(zero.err.find("--graph-execs = 0, expected in [1, 64]"), std::string::npos) << zero.err;
  for (const char* flag : {"--graph-conditional", "--rank-threads", "--graph-split", "--pool"}) {
    const auto check = run_command({EPX_CLI_PATH, "check", "--graph", "3", flag});
    EXPECT_NE(exit_code(check), 0) << flag;
    EXPECT_NE(check.err.find(flag), std::string::npos) << check.err;
  }
}

// `epx serve-bench --graph-buckets` (ascending sizes within the largest decode batch) and
// `--graph-scope` (rank or world), with --cuda-graph only; refused before any GPU is needed.
TEST(ServeCli, GraphBucketsAreChecked) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--graph-buckets", "4,2", "--cuda-graph"}, "'4,2', expected ascending batch sizes"},
      {{"--graph-buckets", "1,999", "--cuda-graph"},
       "--graph-buckets = 999, expected in [1, 128] (the smaller of --chunk-size"},
      {{"--graph-buckets", "1,x", "--cuda-graph"}, "--graph-buckets: 'x' is not an integer"},
      {{"--graph-buckets", "2,2", "--cuda-graph"}, "lists 2 twice"},
      {{"--graph-buckets", "4"}, "expected only with --cuda-graph"},
      {{"--graph-scope", "node", "--cuda-graph"}, "--graph-scope = 'node', expected rank or world"},
      {{"--graph-scope", "world"}, "--graph-scope = 'world', expected only with --cuda-graph"},
      {{"--graph-split", "layer", "--cuda-graph"}, "--graph-split = 'layer', expected expert or none"},
      {{"--graph-experts", "some", "--cuda-graph"},
       "--graph-experts = 'some', expected auto, switch or all-rows"},
      {{"--graph-experts", "switch"}, "--graph-experts = 'switch', expected only with --cuda-graph"},
      {{"--graph-split", "none"}, "--graph-split = 'none', expected only with --cuda-graph"},
      {{"--graph-split", "expert", "--graph-scope", "world", "--cuda-graph"},
       "--graph-split = 'expert', expected only with --graph-scope rank"}};
  for (const auto& [extra, message] : cases) {
    std::vector<std::string> argv = {EPX_CLI_PATH, "serve-bench"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    const auto r = run_command(argv);
    EXPECT_EQ(exit_code(r), 2) << r.err;
    EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
  }
}

// Runs inside `epx launch` (see the next test); skipped when run on its own.
TEST(LaunchedRank, BootstrapFromEnv) {
  if (std::getenv("EPX_TEST_LAUNCHED") == nullptr) GTEST_SKIP() << "runs under epx launch only";
  const BootstrapOptions o = BootstrapOptions::from_env();
  UnixSocketBootstrap b(o);
  gather_rounds(b);
  EpConfig c = job_config();
  c.world_size = b.size();
  c.rank = b.rank();
  check_fingerprints(b, c, Backend::kLowLatency);
  std::printf("launched rank %d of %d passed\n", b.rank(), b.size());
}

// Rank 0 dies after start-up; the others must name it (run under epx launch only).
TEST(LaunchedRank, RankZeroDies) {
  if (std::getenv("EPX_TEST_LAUNCHED") == nullptr) GTEST_SKIP() << "runs under epx launch only";
  UnixSocketBootstrap b(BootstrapOptions::from_env());
  b.barrier();
  if (b.rank() == 0) ::raise(SIGKILL);
  try {
    b.barrier();
  } catch (const PeerError& e) {
    std::printf("rank %d saw: %s\n", b.rank(), e.what());
    return;
  }
  FAIL() << "rank 0 died, yet the barrier completed";
}

TEST(Launch, KilledRankZeroLeavesNoSocketFile) {
  TempDir dir;
  const std::string path = dir.file("dies.sock");
  const auto r = run_command({EPX_CLI_PATH, "launch", "-n", "3", "--bootstrap", path, "--",
                              self_exe(), "--gtest_filter=LaunchedRank.RankZeroDies"},
                             {{"EPX_TEST_LAUNCHED", "1"}});
  EXPECT_EQ(exit_code(r), 128 + SIGKILL) << r.out << r.err;
  EXPECT_NE(r.err.find("rank 0 failed: killed by signal 9 (SIGKILL)"), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, 5.0);
  EXPECT_FALSE(exists(path)) << r.out << r.err;
}

TEST(Launch, IpcWorldExampleRunsOrFailsCleanly) {
#ifndef EPX_IPC_EXAMPLE_PATH
  GTEST_SKIP() << "a CUDA build has examples/ipc_ranks.cpp";
#else
  const auto r = run_command({EPX_CLI_PATH, "launch", "-n", "2", "--", EPX_IPC_EXAMPLE_PATH});
  EXPECT_LT(r.seconds, 15.0) << "no rank waits for a peer that failed";
  if (exit_code(r) == 0) {  // a machine with a GPU: both processes map each other's memory
    for (int i = 0; i < 2; ++i) {
      const std::string line = "[rank " + std::to_string(i) + "] rank " + std::to_string(i) + " of 2: OK";
      EXPECT_NE(r.out.find(line), std::string::npos) << r.out << r.err;
    }
  } else {  // no GPU: every rank says so, and the launcher reports exit code 3
    EXPECT_EQ(exit_code(r), 3) << r.out << r.err;
    EXPECT_NE(r.err.find("an IPC world needs an NVIDIA GPU"), std::string::npos) << r.err;
  }
#endif
}

TEST(Launch, RunsABootstrappedJob) {
  TempDir dir;
  const std::string path = dir.file("launch.sock");
  for (const std::string& address : {std::string(), path}) {
    std::vector<std::string> argv{EPX_CLI_PATH, "launch", "-n", "4"};
    if (!address.empty()) argv.insert(argv.end(), {"--bootstrap", address});
    argv.insert(argv.end(), {"--", self_exe(), "--gtest_filter=LaunchedRank.BootstrapFromEnv"});
    const auto r = run_command(argv, {{"EPX_TEST_LAUNCHED", "1"}});
    EXPECT_EQ(exit_code(r), 0) << r.out << r.err;
    for (int i = 0; i < 4; ++i) {
      const std::string line = "[rank " + std::to_string(i) + "] launched rank " + std::to_string(i) + " of 4 passed";
      EXPECT_NE(r.out.find(line), std::string::npos) << line << " in\n" << r.out;
    }
  }
  EXPECT_FALSE(exists(path));
}

}  // namespace
}  // namespace epx
