// The fault matrix on the CPU (tests/fault): epx_fault_rank's flags and their refusals (by the
// function and by the built binary, which must refuse before it touches a GPU), the verdict on
// what a surviving rank saw, the result line the script reads, and the host inputs and outputs.

#include <gtest/gtest.h>

#include <CLI/CLI.hpp>

#include <bit>
#include <set>
#include <string>
#include <vector>

#include "bootstrap_harness.hpp"
#include "epx/bootstrap.hpp"
#include "epx/error.hpp"
#include "fault_case.hpp"
#include "fault_inputs.hpp"
#include "reference/reference.hpp"
#if defined(EPX_FAULT_RANK_PATH)
#include "epx/cuda_check.hpp"
#endif

namespace epx::fault {
namespace {

#define EXPECT_HAS(text, part) EXPECT_NE((text).find(part), std::string::npos) << (text)

// The flags of one command line, bound as epx_fault_rank binds them.
FaultFlags parse(std::vector<std::string> args) {
  CLI::App app;
  FaultFlags f;
  add_fault_flags(app, f);
  args.insert(args.begin(), "epx_fault_rank");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  app.parse(int(argv.size()), argv.data());
  return f;
}

BootstrapOptions ipc_env(int rank, int world) {
  BootstrapOptions o;
  o.rank = rank;
  o.world_size = world;
  o.address = "@epx-fault-test";
  return o;
}

FaultCase case_of(const std::vector<std::string>& args, const BootstrapOptions& env = {}) {
  return make_fault_case(parse(args), env);
}

// The ConfigError message of a command line ("" and a failure when it is accepted).
std::string refusal(const std::vector<std::string>& args, const BootstrapOptions& env = {}) {
  try {
    case_of(args, env);
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "accepted: " << ::testing::PrintToString(args);
  return "";
}

TEST(FaultCase, FlagsMakeTheCase) {
  const FaultCase c = case_of({"--fault", "stops-calling", "--at", "between"});
  EXPECT_EQ(c.kind, WorldKind::kInProcess);
  EXPECT_EQ(c.world, 3);
  EXPECT_EQ(c.experts, 18) << "the least multiple of 3 ranks from 16";
  EXPECT_EQ(c.mode, Mode::kEager);
  EXPECT_EQ(c.at, Point::kBetween);
  EXPECT_EQ(c.faulty_rank, 1);
  EXPECT_EQ(c.fault_round, 3);
  EXPECT_EQ(c.timeout_ms, 2000);
  EXPECT_EQ(c.name(), "stops-calling@between");
  EXPECT_EQ(c.expected(), "TimeoutError|PeerError");
  EXPECT_DOUBLE_EQ(c.bound_seconds(), 3.0);
  const EpConfig cfg = c.config();
  EXPECT_EQ(cfg.hidden, 2048);
  EXPECT_EQ(cfg.topk, 4);
  EXPECT_EQ(cfg.max_tokens_per_rank, 64);
  EXPECT_EQ(cfg.dtype, DispatchDtype::kBF16);
  EXPECT_EQ(cfg.timeout_ms, 2000);
  EXPECT_FALSE(cfg.mask_failed_ranks);

  const FaultCase never = case_of({"--fault", "never-arrives", "--mode", "graph", "--mask"});
  EXPECT_EQ(never.at, Point::kNone);
  EXPECT_EQ(never.fault_round, 0) << "absent from the start";
  EXPECT_EQ(never.name(), "never-arrives");
  EXPECT_EQ(never.expected(), "masked");
  EXPECT_TRUE(never.config().mask_failed_ranks);

  const FaultCase ipc = case_of({"--world-kind", "ipc", "--fault", "killed", "--at", "in-combine",
                                 "--faulty-rank", "0", "--rounds", "0", "--timeout-ms", "500"},
                                ipc_env(1, 2));
  EXPECT_EQ(ipc.kind, WorldKind::kIpc);
  EXPECT_EQ(ipc.world, 2) << "from EPX_WORLD_SIZE";
  EXPECT_EQ(ipc.experts, 16);
  EXPECT_EQ(ipc.faulty_rank, 0);
  EXPECT_EQ(ipc.fault_round, 0);
  EXPECT_EQ(ipc.config().timeout_ms, 500);
  EXPECT_EQ(case_of({"--world-kind", "ipc", "--world", "3", "--fault", "kernel-fault", "--at",
                     "in-dispatch"},
                    ipc_env(2, 3))
                .experts,
            18);
}

TEST(FaultCase, RefusalsNameTheFlagTheValueAndTheBound) {
  EXPECT_HAS(refusal({"--fault", "killed", "--at", "between"}),
             "--fault = 'killed' with --world-kind in-process, expected --world-kind ipc");
  EXPECT_HAS(refusal({"--fault", "kernel-fault", "--at", "in-dispatch"}),
             "--fault = 'kernel-fault' with --world-kind in-process, expected --world-kind ipc");
  EXPECT_HAS(refusal({"--fault", "crash", "--at", "between"}),
             "--fault = 'crash', expected one of never-arrives, killed, stops-calling, "
             "kernel-fault");
  EXPECT_HAS(
      refusal({"--fault", "killed", "--at", "after-combine", "--world-kind", "ipc"}, ipc_env(0, 2)),
      "--at = 'after-combine', expected one of before-dispatch, in-dispatch, between, "
      "in-combine");
  EXPECT_HAS(refusal({"--fault", "stops-calling", "--at", "between", "--mode", "replay"}),
             "--mode = 'replay', expected one of eager, graph");
  EXPECT_HAS(refusal({"--fault", "stops-calling", "--at", "between", "--world-kind", "nccl"}),
             "--world-kind = 'nccl', expected one of in-process, ipc");
  EXPECT_HAS(refusal({"--fault", "stops-calling"}),
             "--at = (none), expected one of before-dispatch, in-dispatch, between, in-combine "
             "with --fault stops-calling");
  EXPECT_HAS(refusal({"--fault", "never-arrives", "--at", "between"}),
             "--at = 'between' with --fault never-arrives, expected no --at");
  EXPECT_HAS(refusal({"--fault", "never-arrives", "--rounds", "2"}),
             "--rounds = 2 with --fault never-arrives, expected no --rounds");
  EXPECT_HAS(refusal({"--fault", "stops-calling", "--at", "between", "--rounds", "-1"}),
             "--rounds = -1, expected in [0, 1000]");
  EXPECT_HAS(refusal({"--fault", "stops-calling", "--at", "between", "--faulty-rank", "3"}),
             "--faulty-rank = 3, expected a rank of the world, in [0, 3)");
  EXPECT_HAS(refusal({"--fault", "stops-calling", "--at", "between", "--world", "1",
                      "--faulty-rank", "0"}),
             "--world = 1, expected in [2, kMaxRanks = 64] (a fault needs a surviving rank)");
  EXPECT_HAS(refusal({"--fault", "stops-calling", "--at", "between", "--timeout-ms", "0"}),
             "--timeout-ms = 0, expected in [1, kMaxTimeoutMs = 86400000]");
  // ipc: the world is the launcher's
  EXPECT_HAS(
      refusal({"--world-kind", "ipc", "--fault", "killed", "--at", "between"}, ipc_env(0, 1)),
      "EPX_WORLD_SIZE = 1, expected at least 2 with --world-kind ipc");
  EXPECT_HAS(
      refusal({"--world-kind", "ipc", "--world", "4", "--fault", "killed", "--at", "between"},
              ipc_env(0, 2)),
      "--world = 4, expected EPX_WORLD_SIZE = 2");
  EXPECT_HAS(refusal({"--world-kind", "ipc", "--fault", "never-arrives", "--mask"}, ipc_env(0, 2)),
             "--mask = set with --fault never-arrives --world-kind ipc, expected another fault");
  EXPECT_HAS(
      refusal({"--world-kind", "ipc", "--fault", "killed", "--at", "between", "--faulty-rank", "2"},
              ipc_env(0, 2)),
      "--faulty-rank = 2, expected a rank of the world, in [0, 2)");
}

TEST(FaultCase, FaultIsRequired) {
  EXPECT_THROW(parse({"--at", "between"}), CLI::RequiredError);
}

// ---- verdicts
// --------------------------------------------------------------------------------------

// The message of RankStatus::raise for a peer that never came
// (src/backends/common/rank_status.cpp).
const char* kDeviceTimeout =
    "rank 0 in combine/partials-ready (call 8): waited 2000 ms for rank 1 (expected 4, saw 3); "
    "rank 1 did not take part in this call or failed (rank_status.cpp:61)";

TEST(FaultVerdict, NamesRankAndPhase) {
  EXPECT_TRUE(names_rank(kDeviceTimeout, 1));
  EXPECT_TRUE(names_rank(kDeviceTimeout, 0));
  EXPECT_FALSE(names_rank(kDeviceTimeout, 2));
  EXPECT_FALSE(names_rank("waited for rank 12", 1)) << "rank 12 is not rank 1";
  EXPECT_TRUE(names_rank("waited for rank 1", 1));
  EXPECT_EQ(named_phase(kDeviceTimeout), "combine/partials-ready");
  EXPECT_EQ(named_phase("rank 2 in dispatch/data-arrival: waited"), "dispatch/data-arrival");
  EXPECT_EQ(named_phase("rank 2 in grid-barrier: the blocks"), "grid-barrier");
  EXPECT_EQ(named_phase("bootstrap @x: all_gather #3: rank 1 (pid 7) disconnected"), "collective");
  EXPECT_EQ(named_phase("rank 1 is slow"), "");
  EXPECT_EQ(named_phase("the dispatch/ failed"), "") << "an op without a phase";
}

// The bootstrap's own message for a rank that never arrives, as the survivors of a
// never-arrives case in an ipc world get it.
TEST(FaultVerdict, ARealBootstrapTimeoutNamesTheRankAndStartUp) {
  std::string message;
  try {
    UnixSocketBootstrap rank0(options(0, 2, unique_bootstrap_address(), 200));
    ADD_FAILURE() << "rank 1 never came, yet the rendezvous completed";
  } catch (const TimeoutError& e) {
    message = e.what();
  }
  EXPECT_TRUE(names_rank(message, 1)) << message;
  EXPECT_EQ(named_phase(message), "start-up") << message;
}

FaultCase in_process_case() {
  return case_of({"--fault", "stops-calling", "--at", "between"});
}

Observation timed_out_survivor() {
  Observation o;
  o.rank = 0;
  o.seen = "TimeoutError";
  o.error = kDeviceTimeout;
  o.error_round = 3;
  o.seconds = 2.05;
  o.alive = true;
  o.recreated = "ok";
  return o;
}

TEST(FaultVerdict, ASurvivorThatMetItsErrorInTimePasses) {
  const Verdict v = judge(in_process_case(), timed_out_survivor());
  EXPECT_TRUE(v.pass) << v.why;
  EXPECT_EQ(v.why, "");
  Observation peer = timed_out_survivor();
  peer.seen = "PeerError";
  peer.error_round = 4;  // the round after the fault (a rank that stopped in-combine)
  EXPECT_TRUE(judge(in_process_case(), peer).pass);
}

TEST(FaultVerdict, EveryDeviationFailsWithItsReason) {
  const FaultCase c = in_process_case();
  auto why = [&c](auto change) {
    Observation o = timed_out_survivor();
    change(o);
    const Verdict v = judge(c, o);
    EXPECT_FALSE(v.pass);
    return v.why;
  };
  EXPECT_HAS(why([](Observation& o) { o.seconds = 3.2; }),
             "took 3.200 s, expected at most 3.000 s (timeout_ms + 1 s)");
  EXPECT_HAS(why([](Observation& o) { o.seconds = -1; }), "no time measured");
  EXPECT_HAS(why([](Observation& o) { o.seen = "StateError"; }),
             "saw StateError, expected TimeoutError or PeerError");
  EXPECT_HAS(why([](Observation& o) {
               o.seen = "nothing";
               o.error.clear();
             }),
             "saw nothing, expected TimeoutError or PeerError");
  EXPECT_HAS(why([](Observation& o) { o.seen = "hang"; }), "saw hang");
  EXPECT_HAS(
      why([](Observation& o) { o.error = "rank 0 in combine/partials-ready: waited for rank 2"; }),
      "the error does not name rank 1");
  EXPECT_HAS(why([](Observation& o) { o.error = "rank 1 did something"; }),
             "the error names no phase");
  EXPECT_HAS(why([](Observation& o) { o.error_round = 2; }),
             "the error came in round 2, before the fault round 3");
  EXPECT_HAS(why([](Observation& o) { o.alive = false; }),
             "the survivor's CUDA context did not work afterwards");
  EXPECT_HAS(why([](Observation& o) { o.recreated = "failed: rank 2: y[0][0] = 0x0"; }),
             "recreated = failed: rank 2: y[0][0] = 0x0, expected ok");
  EXPECT_HAS(why([](Observation& o) { o.wrong_output = "round 1: y[3][4] = 0x4000"; }),
             "round 1: y[3][4] = 0x4000");
  // Several reasons at once are all given.
  EXPECT_HAS(why([](Observation& o) {
               o.alive = false;
               o.seconds = 9;
             }),
             "; ");

  // ipc survivors are not recreated (it needs every process).
  const FaultCase ipc =
      case_of({"--world-kind", "ipc", "--fault", "killed", "--at", "between"}, ipc_env(0, 2));
  Observation o = timed_out_survivor();
  o.recreated = "n/a";
  EXPECT_TRUE(judge(ipc, o).pass) << judge(ipc, o).why;
  o.recreated = "ok";
  EXPECT_HAS(judge(ipc, o).why, "recreated = ok, expected n/a");
}

TEST(FaultVerdict, CreationErrorsCountOnlyForARankThatNeverArrives) {
  const FaultCase never =
      case_of({"--world-kind", "ipc", "--fault", "never-arrives"}, ipc_env(0, 2));
  Observation o = timed_out_survivor();
  o.error =
      "bootstrap @x: rank 1 of 2 did not arrive within 2000 ms (EPX_TIMEOUT_MS); arrived: rank 0";
  o.error_round = -1;
  o.recreated = "n/a";
  EXPECT_TRUE(judge(never, o).pass) << judge(never, o).why;
  const FaultCase killed = case_of(
      {"--world-kind", "ipc", "--fault", "killed", "--at", "before-dispatch"}, ipc_env(0, 2));
  EXPECT_HAS(judge(killed, o).why, "the error came in round -1, before the fault round 3");
}

TEST(FaultVerdict, MaskedSurvivorsMustGoOnAndReportTheRank) {
  const FaultCase c = case_of({"--fault", "stops-calling", "--at", "before-dispatch", "--mask"});
  Observation o;
  o.seen = "masked";
  o.seconds = 2.1;
  o.alive = true;
  o.masked = 0x2;
  o.dropped = 90;
  o.dropped_min = 90;
  o.dropped_max = 120;
  EXPECT_TRUE(judge(c, o).pass) << judge(c, o).why;
  auto why = [&](auto change) {
    Observation m = o;
    change(m);
    const Verdict v = judge(c, m);
    EXPECT_FALSE(v.pass);
    return v.why;
  };
  EXPECT_HAS(why([](Observation& m) { m.masked = 0x4; }), "masked_ranks = 0x4, expected 0x2");
  EXPECT_HAS(why([](Observation& m) { m.dropped = 89; }),
             "dropped_pairs = 89, expected in [90, 120]");
  EXPECT_HAS(why([](Observation& m) {
               m.seen = "TimeoutError";
               m.error = kDeviceTimeout;
             }),
             "saw TimeoutError (rank 0 in combine");
  EXPECT_HAS(why([](Observation& m) { m.seen = "nothing"; }),
             "expected the survivors to mask rank 1");
  EXPECT_HAS(why([](Observation& m) { m.recreated = "ok"; }), "recreated = ok, expected n/a");
  EXPECT_HAS(why([](Observation& m) { m.seconds = 3.5; }), "took 3.500 s");
}

TEST(FaultVerdict, TheResultLineHoldsEveryFieldOnOneLine) {
  const FaultCase c =
      case_of({"--fault", "stops-calling", "--at", "in-combine", "--mode", "graph"});
  Observation o = timed_out_survivor();
  o.rank = 2;
  o.error = "a \"quoted\"\nmessage in dispatch/data-arrival for rank 1";
  o.recreated = "failed: rank 0: y[0][0] = 0x0";
  const std::string line = result_line(c, o, judge(c, o));
  EXPECT_EQ(line.find('\n'), std::string::npos) << line;
  EXPECT_EQ(line.rfind("fault-result rank=2 world=in-process ranks=3 mode=graph "
                       "case=stops-calling@in-combine faulty=1 mask=0 "
                       "expected=TimeoutError|PeerError seen=TimeoutError "
                       "phase=dispatch/data-arrival round=3 seconds=2.050 bound=3.000 alive=1 "
                       "recreated=failed masked=0x0 dropped=0 verdict=fail why=\"recreated = "
                       "failed: rank 0: y[0][0] = 0x0, expected ok\" error=\"a 'quoted' message",
                       0),
            0u)
      << line;
  size_t quotes = 0;
  for (char ch : line) quotes += ch == '"' ? 1 : 0;
  EXPECT_EQ(quotes, 4u) << "why and error, each quoted once: " << line;
  const std::string injected = injected_line(c, 1, "stopped \"here\"");
  EXPECT_EQ(injected,
            "fault-injected rank=1 world=in-process ranks=3 mode=graph "
            "case=stops-calling@in-combine faulty=1 mask=0 round=3 detail=\"stopped 'here'\"");
}

// ---- inputs and outputs
// ------------------------------------------------------------------------------

TEST(FaultInputs, DistinctExpertsAndExactValues) {
  const FaultCase c = in_process_case();
  for (int rank = 0; rank < c.world; ++rank) {
    const RankInputs in = make_inputs(c, rank);
    ASSERT_EQ(in.x.size(), size_t(kTokens) * kHidden);
    ASSERT_EQ(in.ids.size(), size_t(kTokens) * kTopk);
    for (int n = 0; n < kTokens; ++n) {
      std::set<int> experts;
      for (int k = 0; k < kTopk; ++k) {
        const int e = in.ids[size_t(n) * kTopk + k];
        EXPECT_GE(e, 0);
        EXPECT_LT(e, c.experts);
        experts.insert(e);
      }
      EXPECT_EQ(experts.size(), size_t(kTopk)) << "token " << n << " of rank " << rank;
    }
    for (uint16_t v : in.x) {
      // 6 significant bits: 3 x and 4 x are exact in bf16
      const float f = ref::bf16_to_float(v);
      ASSERT_EQ(ref::bf16_to_float(ref::bf16_from_float(3 * f)), 3 * f) << f;
    }
  }
  EXPECT_NE(make_inputs(c, 0).ids, make_inputs(c, 1).ids) << "ranks differ";
  EXPECT_EQ(make_inputs(c, 1).x, make_inputs(c, 1).x) << "the same inputs every time";
}

TEST(FaultInputs, ExpectedOutputCountsTheLiveRanksATokenReached) {
  const FaultCase c = in_process_case();  // 3 ranks, 18 experts: 6 per rank
  RankInputs in = make_inputs(c, 0);
  // Token 0 on experts of ranks 0 and 2, token 1 on rank 1 only.
  for (int k = 0; k < kTopk; ++k) {
    in.ids[size_t(k)] = k < 2 ? k : 12 + k;
    in.ids[size_t(kTopk + k)] = 6 + k;
  }
  EXPECT_EQ(reached_ranks(c, in, 0), 0b101u);
  EXPECT_EQ(reached_ranks(c, in, 1), 0b010u);
  uint64_t total = 0;
  for (int r = 0; r < c.world; ++r) total += pairs_on_rank(c, in, r);
  EXPECT_EQ(total, uint64_t(kTokens) * kTopk);

  auto y_for = [&](uint64_t live) {
    std::vector<uint16_t> y(in.x.size(), 0xffff);
    for (int n = 0; n < kTokens; ++n) {
      const int times = std::popcount(reached_ranks(c, in, n) & live);
      if (times == 0) continue;
      for (int h = 0; h < kHidden; ++h) {
        const size_t i = size_t(n) * kHidden + size_t(h);
        y[i] = ref::bf16_from_float(float(times) * ref::bf16_to_float(in.x[i]));
      }
    }
    return y;
  };
  std::vector<uint16_t> y = y_for(0b111);
  EXPECT_EQ(compare_y(c, in, y, 0b111), "");
  y[5] ^= 1;  // token 0, h 5: one bit off
  EXPECT_HAS(compare_y(c, in, y, 0b111), "y[0][5] = ");
  EXPECT_HAS(compare_y(c, in, y, 0b111), "(x times 2)");
  // Rank 1 masked: token 1 reaches no live rank and is not checked; token 0 still counts 2.
  std::vector<uint16_t> masked = y_for(0b101);
  EXPECT_EQ(compare_y(c, in, masked, 0b101), "");
  EXPECT_NE(compare_y(c, in, masked, 0b111), "") << "the masked rank's share is missing";
  EXPECT_HAS(compare_y(c, in, std::vector<uint16_t>(3), 0b111), "y has 3 values");
}

// ---- the binary
// ----------------------------------------------------------------------------------

#if defined(EPX_FAULT_RANK_PATH)
TEST(FaultRankCli, RefusesBadFlagsBeforeTouchingAGpu) {
  struct Case {
    std::vector<std::string> args;
    std::vector<std::pair<std::string, std::string>> env;
    std::string message;
  };
  const std::vector<Case> cases{
      {{"--fault", "killed", "--at", "in-dispatch"},
       {},
       "--fault = 'killed' with --world-kind in-process, expected --world-kind ipc"},
      {{"--fault", "kernel-fault", "--at", "between"},
       {},
       "--fault = 'kernel-fault' with --world-kind in-process, expected --world-kind ipc"},
      {{"--fault", "hang", "--at", "between"}, {}, "--fault = 'hang', expected one of"},
      {{"--fault", "stops-calling", "--at", "during"}, {}, "--at = 'during', expected one of"},
      {{"--fault", "stops-calling"}, {}, "--at = (none), expected one of"},
      {{"--world-kind", "ipc", "--fault", "killed", "--at", "between"},
       {},
       "EPX_WORLD_SIZE = 1, expected at least 2"},
      {{"--world-kind", "ipc", "--world", "4", "--fault", "killed", "--at", "between"},
       {{"EPX_RANK", "0"}, {"EPX_WORLD_SIZE", "2"}, {"EPX_BOOTSTRAP", "@epx-fault-cli"}},
       "--world = 4, expected EPX_WORLD_SIZE = 2"},
      {{"--world-kind", "ipc", "--fault", "killed", "--at", "between"},
       {{"EPX_RANK", "2"}, {"EPX_WORLD_SIZE", "2"}, {"EPX_BOOTSTRAP", "@epx-fault-cli"}},
       "EPX_RANK = \"2\""},
  };
  for (const Case& k : cases) {
    std::vector<std::string> argv{EPX_FAULT_RANK_PATH};
    argv.insert(argv.end(), k.args.begin(), k.args.end());
    const CommandResult r = run_command(argv, k.env);
    SCOPED_TRACE(::testing::PrintToString(k.args));
    EXPECT_EQ(exit_code(r), 2) << r.out << r.err;
    EXPECT_HAS(r.err, "epx_fault_rank: config error: " + k.message);
    EXPECT_EQ(r.out.find("fault-result"), std::string::npos) << r.out;
  }
  // CLI11's own refusals keep its exit codes.
  EXPECT_NE(exit_code(run_command({EPX_FAULT_RANK_PATH, "--at", "between"})), 0);
  EXPECT_NE(exit_code(run_command({EPX_FAULT_RANK_PATH, "--fault", "killed", "--rounds", "x"})), 0);
}

TEST(FaultRankCli, AValidCaseWithoutAGpuSaysSo) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a GPU is visible: the case would run";
  const CommandResult r =
      run_command({EPX_FAULT_RANK_PATH, "--fault", "stops-calling", "--at", "between"});
  EXPECT_EQ(exit_code(r), 3) << r.out << r.err;
  EXPECT_HAS(r.err, "NVIDIA GPU");
}
#endif

}  // namespace
}  // namespace epx::fault
