// `epx launch` (rank environment, output prefixes, failures, signals, socket files, a
// bootstrapped job of this test binary, the IPC example) and the CLI's argument checks that need
// no GPU. The tests run the built `epx` (EPX_CLI_PATH) and this binary under it.

#include <gtest/gtest.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "bootstrap_harness.hpp"
#include "epx/bootstrap.hpp"
#include "epx/config.hpp"
#include "epx/error.hpp"

#ifndef EPX_CLI_PATH
#error "EPX_CLI_PATH (the epx binary) must be defined by the build"
#endif

namespace epx {
namespace {

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
  // The first start of `epx` on a fresh machine reads its libraries from a cold disk (cuBLASLt
  // alone is 0.5 GB; seconds): start it once so that the bound below times the stop, not that.
  ASSERT_EQ(exit_code(run_command({EPX_CLI_PATH, "launch", "-n", "1", "--", "true"})), 0);
  const auto r = run_command(
      {EPX_CLI_PATH, "launch", "-n", "3", "--grace-ms", "500", "--", "sh", "-c",
       "if [ \"$EPX_RANK\" = 1 ]; then echo going >&2; exit 3; fi; sleep 60"});
  EXPECT_EQ(exit_code(r), 3) << r.err;
  EXPECT_LT(r.seconds, 30.0) << "the sleeping ranks (60 s) were stopped";
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

// A world without ranks is refused by name before anything is spread over its ranks (a single
// token count used to be expanded over --world first), in check and in the diagnosis command.
TEST(CheckCli, WorldWithoutRanksIsRefusedNamingTheFlag) {
  for (const char* world : {"0", "-3"}) {
    for (const std::vector<std::string>& cmd :
         {std::vector<std::string>{EPX_CLI_PATH, "check"},
          std::vector<std::string>{EPX_CLI_PATH, "diag", "graph-replay"}}) {
      std::vector<std::string> argv = cmd;
      argv.insert(argv.end(), {"--world", world, "--tokens", "7"});
      const auto r = run_command(argv);
      EXPECT_EQ(exit_code(r), 2) << r.err;
      EXPECT_NE(r.err.find(std::string("--world = ") + world), std::string::npos) << r.err;
    }
  }
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

// Each case: `epx serve-bench` with these flags exits 2 (before any GPU is needed) with a message
// holding the text.
void expect_serve_bench_refuses(
    const std::vector<std::pair<std::vector<std::string>, std::string>>& cases) {
  for (const auto& [extra, message] : cases) {
    std::vector<std::string> argv = {EPX_CLI_PATH, "serve-bench"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    const auto r = run_command(argv);
    EXPECT_EQ(exit_code(r), 2) << r.err;
    EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
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
  expect_serve_bench_refuses(cases);
}

// The shape flags go through the flags module's EpConfig path: messages in flag names.
TEST(ServeCli, ModelFlagsSpeakInFlagNames) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--experts", "100"}, "--experts = 100, expected a multiple of --world = 8"},
      {{"--world", "4", "--experts", "2"}, "--experts = 2, expected >= --world = 4"},
      {{"--topk", "40"}, "--topk = 40, expected in [1, min(kMaxTopk = 32, --experts = 256)]"},
      {{"--dtype", "fp4"}, "--dtype = \"fp4\", expected one of bf16, fp8, bf16-to-fp8"},
      {{"--layout", "row"}, "--layout = \"row\", expected one of token, expert"},
      {{"--hidden", "1000"}, "--hidden = 1000, expected a multiple of 512 in [512, 65536]"},
      {{"--experts", "131072"}, "--experts = 131072, expected in [1, 65536]"},
      {{"--backends", "naive,naive"}, "--backends = 'naive,naive' lists naive twice"},
      {{"--backends", "fastest"}, "--backends = \"fastest\", expected one of naive"},
      {{"--backends", "low_latency+low_latency"},
       "--backends item 'low_latency+low_latency': expected two different backends"},
      {{"--backends", "naive,low_latency+high_throughput,low_latency+high_throughput"},
       "lists low_latency+high_throughput twice"},
      {{"--backends", "low_latency+fastest"}, "--backends = \"fastest\", expected one of naive"},
      {{"--prefill-chunk", "4096"}, "--prefill-chunk = 4096, expected only with a DECODE+PREFILL"},
      {{"--backends", "low_latency+high_throughput", "--prefill-threshold", "100000"},
       "--prefill-threshold = 100000"}};
  expect_serve_bench_refuses(cases);
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
