// The multi-process bootstrap (include/epx/bootstrap.hpp) on the CPU: options and their
// environment, all-gather and barrier over threads and over forked processes (1, 2, 4, 8 ranks),
// descriptor passing between processes, socket files (left behind, stale, removed), every
// start-up fault (rank out of range, used twice, world sizes that disagree, a second job on the
// address, a rank that never arrives), ranks that die or stay away mid-collective, and
// CallbackBootstrap. Timing bounds: bootstrap_harness.hpp.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "bootstrap_harness.hpp"
#include "epx/bootstrap.hpp"
#include "epx/config.hpp"
#include "epx/error.hpp"

namespace epx {
namespace {

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
    check_pids(b);  // every rank learnt every rank's pid at start-up
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

// ---- CallbackBootstrap ------------------------------------------------------------------------

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

}  // namespace
}  // namespace epx
