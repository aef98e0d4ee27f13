// The start-up fingerprint (include/epx/bootstrap.hpp): its canonical text, and
// check_fingerprints over a framework's all-gather and over Unix sockets, naming the first field
// that differs and the ranks' values on every rank.

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "bootstrap_harness.hpp"
#include "epx/bootstrap.hpp"
#include "epx/config.hpp"
#include "epx/error.hpp"

namespace epx {
namespace {

TEST(Fingerprint, CanonicalTextWithoutRank) {
  EpConfig a = job_config();
  const std::string text = fingerprint(a, Backend::kLowLatency);
  EXPECT_EQ(text.rfind(std::string("epx_version=") + library_version() + "\n", 0), 0u) << text;
  for (const char* field : {"backend=low_latency\n", "world_size=3\n", "hidden=7168\n",
                            "num_experts=48\n", "topk=8\n", "max_tokens_per_rank=128\n",
                            "dtype=bf16-to-fp8\n", "scale_layout=row\n", "round_scale=false\n",
                            "layout=token\n",
                            "deterministic=false\n", "rounds_in_flight=1\n", "mask_failed_ranks=false\n",
                            "worst_case_output=false\n", "combine=auto\n",
                            "combine_format=bf16\n", "combine_order=rank\n", "timeout_ms=10000\n"}) {
    EXPECT_NE(text.find(field), std::string::npos) << field << " in\n" << text;
  }
  EXPECT_EQ(text.find("\nrank="), std::string::npos);
  EpConfig b = a;
  b.rank = 2;
  EXPECT_EQ(fingerprint(b, Backend::kLowLatency), text);
  b.hidden = 4096;
  EXPECT_NE(fingerprint(b, Backend::kLowLatency), text);
  EpConfig c = a;
  c.round_scale = true;
  EXPECT_NE(fingerprint(c, Backend::kLowLatency), text);
  c = a;
  c.worst_case_output = true;  // (high_throughput's sizing: across nodes, its protocol)
  EXPECT_NE(fingerprint(c, Backend::kHighThroughput), fingerprint(a, Backend::kHighThroughput));
  EpConfig d = a;
  d.combine_format = CombineFormat::kLogFMT;
  EXPECT_NE(fingerprint(d, Backend::kLowLatency), text);
  EXPECT_NE(fingerprint(d, Backend::kLowLatency).find("combine_format=logfmt\n"), std::string::npos);
  d = a;
  d.combine_order = CombineOrder::kHighestSlot;
  EXPECT_NE(fingerprint(d, Backend::kHighThroughput).find("combine_order=highest_slot\n"),
            std::string::npos);
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

// A text that repeats a key (a peer's, from another build) is compared on every value of the key,
// not on the first only (found by tests/fuzz/fuzz_env).
TEST(Fingerprint, ARepeatedKeyCannotHideADifference) {
  const std::string base = fingerprint(job_config(), Backend::kLowLatency);
  const auto out =
      check_three([&](int r) { return base + (r == 1 ? "hidden=2\n" : "hidden=1\n"); });
  for (const auto& o : out) {
    EXPECT_TRUE(
        failed_with(o, ErrorCode::kConfig, {"hidden: rank 0 has [7168, 1], rank 1 has [7168, 2]"}));
  }
  const auto same = check_three([&](int) { return base + "hidden=1\n"; });
  for (const auto& o : same) EXPECT_TRUE(succeeded(o));
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

}  // namespace
}  // namespace epx
