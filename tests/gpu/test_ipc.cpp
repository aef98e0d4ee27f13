// One process per rank (IpcWorld): `epx launch -n W -- epx check --world-kind ipc ...` must pass
// for the low_latency backend in both layouts and for a baseline, and a job whose ranks
// disagree or where a rank never shows up must end with an error on the surviving rank within
// the bootstrap's timeout, never hang. The processes share this machine's GPU(s) (time-sliced
// on one GPU: correct, slow), so the shapes and iteration counts are small.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "epx/cuda_check.hpp"

#ifndef EPX_CLI_PATH
#error "EPX_CLI_PATH (the epx binary) must be defined by the build"
#endif

namespace epx {
namespace {

#define REQUIRE_GPU()                                                    \
  do {                                                                   \
    if (cuda_device_count() == 0) GTEST_SKIP() << "needs an NVIDIA GPU"; \
  } while (0)

using Clock = std::chrono::steady_clock;

// The epx binary: where the build put it, or (binaries copied to another machine without their
// build tree) beside the folder of this test binary, as <build>/epx is beside <build>/tests/.
const std::string& epx_cli() {
  static const std::string path = [] {
    if (::access(EPX_CLI_PATH, X_OK) == 0) return std::string(EPX_CLI_PATH);
    const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
    return (std::filesystem::path(self).parent_path().parent_path() / "epx").string();
  }();
  return path;
}

struct CommandResult {
  int status = 0;
  std::string out, err;
  double seconds = 0;
};

int exit_code(const CommandResult& r) {
  if (WIFEXITED(r.status)) return WEXITSTATUS(r.status);
  if (WIFSIGNALED(r.status)) return 128 + WTERMSIG(r.status);
  return -1;
}

// fork + execv of argv (argv[0] an absolute path) with extra environment variables; collects
// stdout and stderr; SIGKILLs the command's process group after `limit_s` seconds.
CommandResult run_command(const std::vector<std::string>& argv,
                          const std::vector<std::pair<std::string, std::string>>& env = {},
                          double limit_s = 120) {
  int out_p[2], err_p[2];
  if (::pipe2(out_p, O_CLOEXEC) != 0 || ::pipe2(err_p, O_CLOEXEC) != 0) {
    ADD_FAILURE() << "pipe2 failed";
    return {};
  }
  const auto t0 = Clock::now();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
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
  bool killed = false;
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
    if (!killed && std::chrono::duration<double>(Clock::now() - t0).count() > limit_s) {
      (void)::kill(-pid, SIGKILL);
      (void)::kill(pid, SIGKILL);
      killed = true;
    }
  }
  ::waitpid(pid, &r.status, 0);
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

// epx launch -n W -- epx check --world-kind ipc --world W <args>
std::vector<std::string> launched_check(int ranks, const std::vector<std::string>& args) {
  std::vector<std::string> argv{epx_cli(), "launch", "-n", std::to_string(ranks), "--",
                                epx_cli(), "check", "--world-kind", "ipc",
                                "--world", std::to_string(ranks)};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

void expect_pass(const CommandResult& r) {
  EXPECT_EQ(exit_code(r), 0) << r.out << r.err;
  EXPECT_NE(r.out.find("[rank 0] PASS"), std::string::npos) << r.out << r.err;
  // Only rank 0 reports.
  EXPECT_EQ(r.out.find("[rank 1] PASS"), std::string::npos) << r.out;
}

TEST(IpcCheck, TwoRanksTokenMajorQuantised) {
  REQUIRE_GPU();
  const auto r = run_command(launched_check(
      2, {"--hidden", "2048", "--experts", "16", "--topk", "4", "--tokens", "7,128", "--dtype",
          "bf16-to-fp8"}));
  expect_pass(r);
}

TEST(IpcCheck, TwoRanksGraphReplaysMixedWithEager) {
  REQUIRE_GPU();
  const auto r = run_command(launched_check(
      2, {"--hidden", "2048", "--experts", "16", "--topk", "4", "--tokens", "128,7", "--dtype",
          "bf16", "--iters", "1", "--graph", "4", "--mixed"}));
  expect_pass(r);
}

TEST(IpcCheck, FourRanksExpertMajor) {
  REQUIRE_GPU();
  const auto r = run_command(launched_check(
      4, {"--hidden", "2048", "--experts", "16", "--topk", "4", "--tokens", "0,7,128,1",
          "--dtype", "fp8", "--layout", "expert", "--scale-layout", "column", "--iters", "1",
          "--graph", "3"}));
  expect_pass(r);
}

TEST(IpcCheck, BaselineBackends) {
  REQUIRE_GPU();
  for (const char* backend : {"naive", "allgather_reducescatter"}) {
    SCOPED_TRACE(backend);
    const auto r = run_command(launched_check(
        2, {"--backend", backend, "--hidden", "2048", "--experts", "16", "--topk", "4",
            "--tokens", "7,128", "--dtype", "bf16-to-fp8"}));
    expect_pass(r);
  }
}

// Rank 1 asks for another hidden size: the start-up fingerprint refuses the job on every rank
// before anything is allocated.
TEST(IpcCheck, ConfigMismatchIsRefusedOnEveryRank) {
  REQUIRE_GPU();
  const std::string script =
      std::string("h=2048; [ \"$EPX_RANK\" = 1 ] && h=4096; exec '") + epx_cli() +
      "' check --world-kind ipc --world 2 --hidden $h --experts 16 --topk 4 --tokens 7";
  const auto r = run_command({epx_cli(), "launch", "-n", "2", "--", "/bin/sh", "-c", script},
                             {{"EPX_TIMEOUT_MS", "3000"}}, 60);
  EXPECT_EQ(exit_code(r), 2) << r.out << r.err;
  EXPECT_NE(r.err.find("hidden: rank 0 has 2048, rank 1 has 4096"), std::string::npos)
      << r.out << r.err;
  EXPECT_LT(r.seconds, 30.0) << r.out << r.err;
}

// Rank 1 exits at once (successfully, so the launcher does not stop rank 0): rank 0 must report
// the missing rank within EPX_TIMEOUT_MS plus a second (plus process start-up), not hang.
TEST(IpcCheck, MissingRankIsATimeoutNotAHang) {
  REQUIRE_GPU();
  const std::string script = std::string("[ \"$EPX_RANK\" = 1 ] && exit 0; exec '") +
                             epx_cli() +
                             "' check --world-kind ipc --world 2 --hidden 2048 --experts 16 "
                             "--topk 4 --tokens 7";
  const int timeout_ms = 2000;
  const auto r = run_command({epx_cli(), "launch", "-n", "2", "--", "/bin/sh", "-c", script},
                             {{"EPX_TIMEOUT_MS", std::to_string(timeout_ms)}}, 60);
  EXPECT_EQ(exit_code(r), 2) << r.out << r.err;
  EXPECT_NE(r.err.find("[rank 0] epx: timeout error"), std::string::npos) << r.out << r.err;
  EXPECT_NE(r.err.find("rank 1"), std::string::npos) << r.out << r.err;
  EXPECT_LT(r.seconds, timeout_ms / 1000.0 + 1.0 + 2.0) << r.out << r.err;
}

// ---- NcclWorld with one rank (one GPU is enough: NCCL takes a communicator of one) ---------------

// epx launch -n 1 -- epx check --world-kind nccl <small shape>, with `env` added.
CommandResult nccl_one_rank(const std::vector<std::pair<std::string, std::string>>& env) {
  std::vector<std::pair<std::string, std::string>> all = env;
  all.emplace_back("NCCL_NVLS_ENABLE", "0");
  return run_command({epx_cli(), "launch", "-n", "1", "--", epx_cli(), "check", "--world-kind",
                      "nccl", "--hidden", "2048", "--experts", "16", "--topk", "4", "--tokens",
                      "7", "--iters", "1"},
                     all, 120);
}

#define REQUIRE_NCCL(r)                                                                       \
  do {                                                                                        \
    if (((r).err + (r).out).find("NCCL: cannot load") != std::string::npos)                   \
      GTEST_SKIP() << "no libnccl.so.2 (set EPX_NCCL_LIBRARY): " << (r).err.substr(0, 300);  \
  } while (0)

// With symmetric memory (NCCL's defaults), the world runs and the check passes: the probe for
// symmetric memory does not refuse a communicator that has it.
TEST(NcclOneRank, ChecksWithSymmetricMemory) {
  REQUIRE_GPU();
  const auto r = nccl_one_rank({});
  REQUIRE_NCCL(r);
  EXPECT_EQ(exit_code(r), 0) << r.out << r.err;
  EXPECT_NE(r.out.find("[rank 0] PASS"), std::string::npos) << r.out << r.err;
}

// NCCL_CUMEM_ENABLE=0: NCCL has no symmetric memory for the communicator (its window would be
// memory the GPU cannot read); the world refuses up front, naming the variable, with
// UnsupportedError's exit code 3 — no illegal address, no hang.
TEST(NcclOneRank, RefusesWithoutSymmetricMemoryNamingTheVariable) {
  REQUIRE_GPU();
  const auto r = nccl_one_rank({{"NCCL_CUMEM_ENABLE", "0"}, {"EPX_TIMEOUT_MS", "5000"}});
  REQUIRE_NCCL(r);
  EXPECT_EQ(exit_code(r), 3) << r.out << r.err;
  EXPECT_NE(r.err.find("NCCL_CUMEM_ENABLE=0"), std::string::npos) << r.out << r.err;
  EXPECT_NE(r.err.find("symmetric memory"), std::string::npos) << r.out << r.err;
  EXPECT_EQ(r.err.find("illegal"), std::string::npos) << r.out << r.err;
  EXPECT_LT(r.seconds, 60.0);
}

// ---- emulated nodes: ranks of one GPU that NCCL takes for separate hosts -------------------------

// Whether a TCP port of 127.0.0.1 can be listened on now.
bool port_is_free(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

// A TCP port P such that P + 1 is free too (epx's bootstrap listens on MASTER_PORT + 1), below
// the kernel's ephemeral range: a port from that range can be taken between this choice and
// rank 0's listen by any outgoing connection of the host (NCCL's among them).
int free_master_port() {
  int low = 32768;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%d", &low) != 1) low = 32768;
    std::fclose(f);
  }
  const int first = 10000, last = std::max(first + 100, low - 2);
  std::mt19937 pick(static_cast<unsigned>(::getpid()) * 2654435761u +
                    static_cast<unsigned>(std::chrono::steady_clock::now().time_since_epoch().count()));
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int port = first + static_cast<int>(pick() % unsigned(last - first));
    if (port_is_free(port) && port_is_free(port + 1)) return port;
  }
  return 29499;
}

// `nodes` x `local` processes, each started with torchrun's variables (RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT: the node layout epx reads) and a host id
// of its own (NCCL_HOSTID: NCCL then takes every process for a host, and refuses none of them for
// sharing the GPU), each running `epx <args>`.
CommandResult emulated_nodes_run(int nodes, int local, const std::string& args,
                                 int timeout_ms = 30000) {
  const int W = nodes * local;
  const int port = free_master_port();
  // Each rank's output (stdout and stderr) goes to a file of its own, printed afterwards with a
  // "[rank i] " prefix as `epx launch` prints it.
  std::string script = "rc=0; pids=; d=$(mktemp -d); ";
  for (int r = 0; r < W; ++r) {
    script += "RANK=" + std::to_string(r) + " WORLD_SIZE=" + std::to_string(W) +
              " LOCAL_RANK=" + std::to_string(r % local) +
              " LOCAL_WORLD_SIZE=" + std::to_string(local) +
              " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) +
              " NCCL_HOSTID=epx-emulated-" + std::to_string(r) + " '" + epx_cli() + "' " + args +
              " >$d/" + std::to_string(r) + " 2>&1 & pids=\"$pids $!\"; ";
  }
  script += "for p in $pids; do wait $p || rc=1; done; for f in $(ls $d | sort -n); do "
            "sed \"s/^/[rank $f] /\" $d/$f; done; rm -rf $d; exit $rc";
  return run_command({"/bin/sh", "-c", script},
                     {{"NCCL_NVLS_ENABLE", "0"}, {"EPX_TIMEOUT_MS", std::to_string(timeout_ms)}},
                     240);
}

// `epx check --world-kind nccl` of `backend` on a small shape across emulated nodes.
CommandResult emulated_nodes_check(int nodes, int local, const std::string& backend,
                                   const std::string& extra = "", int timeout_ms = 30000) {
  return emulated_nodes_run(nodes, local,
                            "check --world-kind nccl --backend " + backend +
                                " --hidden 2048 --experts 16 --topk 4 --tokens 7 --iters 2 " +
                                extra,
                            timeout_ms);
}

// Across emulated nodes the NcclWorld serves every backend's token-major contract through the
// collective engine (NCCL's all-gather and grouped send/recv, folded in rank order): every rank's
// check against the reference passes, bit for bit, at 2 x 1, 2 x 2 and 4 x 1, eagerly and in 100
// graph replays, for every backend with bf16-to-fp8 (2 x 1, 4 x 1) and bf16 (2 x 2) rows,
// low_latency's expert-major rows too (and fp8 in with column-major scales); high_throughput
// eagerly with its counts read back (the exact combine) and in replays with worst-case output.
TEST(NcclNodes, EveryBackendPassesAcrossEmulatedNodes) {
  REQUIRE_GPU();
  struct Run {
    int nodes, local;
    std::string backend, extra;
  };
  std::vector<Run> runs;
  using Layout = std::tuple<int, int, const char*>;  // nodes, ranks a node, dtype
  for (const auto& [nodes, local, dtype] :
       {Layout{2, 1, "bf16-to-fp8"}, Layout{2, 2, "bf16"}, Layout{4, 1, "bf16-to-fp8"}}) {
    const std::string d = std::string("--dtype ") + dtype;
    for (const char* b : {"naive", "allgather_reducescatter", "low_latency"})
      runs.push_back({nodes, local, b, d + " --graph 100"});
    runs.push_back({nodes, local, "low_latency", d + " --layout expert --graph 100"});
    runs.push_back({nodes, local, "high_throughput", d});
    runs.push_back({nodes, local, "high_throughput", d + " --graph 100 --worst-case-output"});
  }
  runs.push_back({2, 1, "low_latency", "--layout expert --dtype fp8 --scale-layout column"});
  for (const auto& [nodes, local, backend, extra] : runs) {
    const auto r = emulated_nodes_check(nodes, local, backend, extra);
    REQUIRE_NCCL(r);
    const std::string what = std::to_string(nodes) + " x " + std::to_string(local) + " " +
                             backend + " " + extra + "\n" + r.out + r.err;
    EXPECT_EQ(exit_code(r), 0) << what;
    // NCCL's start-up, the check and the bounded end of every rank's world (each within
    // EPX_TIMEOUT_MS, 30 s here): never the unbounded teardown of docs/scale-out.md §6.
    EXPECT_LT(r.seconds, 90.0) << what;
    // Rank 0 reports for the job once every rank's checks are in.
    const size_t pass = r.out.find("[rank 0] PASS: ");
    EXPECT_NE(pass, std::string::npos) << what;
    if (pass != std::string::npos) {
      EXPECT_NE(r.out.find("on each of " + std::to_string(nodes * local) + " ranks", pass),
                std::string::npos)
          << what;
    }
  }
}

// 4 emulated nodes of 2 ranks at the DeepSeek-R1 shape: low_latency at 128 tokens (both layouts,
// eagerly and in 100 graph replays) and high_throughput at 4096, each against the reference.
TEST(NcclNodes, FourNodesOfTwoAtTheR1Shape) {
  REQUIRE_GPU();
  const std::string r1 = " --hidden 7168 --experts 256 --topk 8 --dtype bf16-to-fp8";
  for (const std::string& args :
       {"--backend low_latency --tokens 128 --iters 2 --graph 100" + r1,
        "--backend low_latency --layout expert --tokens 128 --iters 2 --graph 100" + r1,
        "--backend high_throughput --tokens 4096 --iters 1" + r1}) {
    const auto r = emulated_nodes_run(4, 2, "check --world-kind nccl " + args, 60000);
    REQUIRE_NCCL(r);
    EXPECT_EQ(exit_code(r), 0) << args << "\n" << r.out << r.err;
    EXPECT_NE(r.out.find("on each of 8 ranks"), std::string::npos) << args << "\n" << r.out;
  }
}

// `epx bench` runs across emulated nodes too: every backend checked against the reference and
// timed, NCCL's own collectives beside them (figures of sockets on one GPU: the path, not the
// speed).
TEST(NcclNodes, BenchRunsAcrossEmulatedNodes) {
  REQUIRE_GPU();
  const auto r = emulated_nodes_run(
      2, 2,
      "bench --world-kind nccl --backends naive,allgather_reducescatter,low_latency,"
      "high_throughput --hidden 2048 --experts 16 --topk 4 --tokens 32 --iters 50 --warmup 2");
  REQUIRE_NCCL(r);
  EXPECT_EQ(exit_code(r), 0) << r.out << r.err;
  for (const char* b : {"naive", "allgather_reducescatter", "low_latency", "high_throughput"})
    EXPECT_NE(r.out.find(b), std::string::npos) << b << "\n" << r.out << r.err;
  EXPECT_EQ(r.out.find("unavailable"), std::string::npos) << r.out << r.err;
  EXPECT_LT(r.seconds, 180.0) << r.out << r.err;
}

// A node that dies after its world and objects exist (its one rank at 2 x 1; both ranks of node
// 1 at 2 x 2): every survivor's first collective never completes, and the collective engine's
// watchdog ends it within EPX_TIMEOUT_MS of the stream reaching it: a TimeoutError (exit code 2)
// on every survivor, never a hang.
TEST(NcclNodes, AKilledNodeEndsEverySurvivorWithATimeoutError) {
  REQUIRE_GPU();
  const int timeout_ms = 3000;
  for (const auto& [nodes, local, dead] :
       {std::tuple<int, int, const char*>{2, 1, "1"}, {2, 2, "2,3"}}) {
    const auto r = emulated_nodes_check(nodes, local, "allgather_reducescatter",
                                        std::string("--fault-kill-rank ") + dead, timeout_ms);
    REQUIRE_NCCL(r);
    EXPECT_NE(exit_code(r), 0) << r.out << r.err;
    for (int survivor = 0; survivor < local; ++survivor) {
      EXPECT_NE(r.out.find("[rank " + std::to_string(survivor) + "] epx: timeout error"),
                std::string::npos)
          << "rank " << survivor << "\n" << r.out << r.err;
    }
    EXPECT_LT(r.seconds, 120.0) << r.out << r.err;  // (start-up of NCCL included)
  }
}

// Expert-major rows are low_latency's across nodes too: a baseline asking for them is refused by
// name on every rank, no hang.
TEST(NcclNodes, ExpertMajorOfABaselineIsRefusedByName) {
  REQUIRE_GPU();
  const auto r = emulated_nodes_check(2, 1, "allgather_reducescatter", "--layout expert");
  REQUIRE_NCCL(r);
  EXPECT_NE(exit_code(r), 0) << r.out << r.err;
  EXPECT_NE((r.out + r.err).find("expected token"), std::string::npos) << r.out << r.err;
}

// ---- several GPUs -----------------------------------------------------------------------------

// `epx bench` of high_throughput sized per call over every GPU: each GPU's dispatch waits on the
// host for the others' counts, so the bench enqueues each GPU from a thread of its own (from one
// thread it waited for a GPU not yet launched, and timed out).
TEST(MultiGpuCli, BenchHighThroughputOverEveryGpu) {
  const int gpus = cuda_device_count();
  if (gpus < 2) GTEST_SKIP() << "needs 2 GPUs";
  const auto r = run_command({epx_cli(), "bench", "--backends", "high_throughput", "--world",
                              std::to_string(gpus), "--gpus", std::to_string(gpus), "--hidden",
                              "2048", "--experts", std::to_string(8 * gpus), "--topk", "4",
                              "--tokens", "256", "--iters", "50", "--warmup", "2"},
                             {{"EPX_TIMEOUT_MS", "5000"}}, 180);
  EXPECT_EQ(exit_code(r), 0) << r.out << r.err;
  EXPECT_EQ((r.out + r.err).find("timing error"), std::string::npos) << r.out << r.err;
  EXPECT_EQ((r.out + r.err).find("TimeoutError"), std::string::npos) << r.out << r.err;
  EXPECT_NE(r.out.find("high_throughput"), std::string::npos) << r.out << r.err;
}

}  // namespace
}  // namespace epx
