// The high_throughput backend's memory (DESIGN §9: at most 256 MiB per rank at any token count):
// its rings and per-round state are fixed by the launch shape, only an 8-byte destination mask
// per token grows with max_tokens_per_rank; the received rows' areas follow the rows of a call
// (or, with worst_case_output, world x max tokens rows). Host arithmetic only (no GPU).
#include <gtest/gtest.h>

#include "epx/all2all.hpp"

namespace epx {
namespace {

EpConfig r1(int max_tokens, DispatchDtype dtype) {
  EpConfig c;
  c.world_size = 8;
  c.hidden = 7168;
  c.num_experts = 256;
  c.topk = 8;
  c.max_tokens_per_rank = max_tokens;
  c.dtype = dtype;
  return c;
}

constexpr size_t kMiB = size_t(1) << 20;

TEST(HighThroughputMemory, AtMost256MiBAtAnyTokenCount) {
  for (DispatchDtype d : {DispatchDtype::kBF16ToFP8, DispatchDtype::kFP8, DispatchDtype::kBF16}) {
    const size_t small = buffer_bytes(Backend::kHighThroughput, r1(128, d));
    for (int tokens : {1024, 4096, 16384, kMaxTokensPerRank}) {
      const size_t bytes = buffer_bytes(Backend::kHighThroughput, r1(tokens, d));
      EXPECT_LE(bytes, 256 * kMiB) << tokens << " tokens, " << to_string(d);
      // Only the per-token destination masks grow (8 bytes a token, plus alignment).
      EXPECT_LE(bytes - small, size_t(tokens - 128) * 8 + 256) << tokens;
    }
  }
  // low_latency's receive areas, for comparison, grow with every token.
  EXPECT_GT(buffer_bytes(Backend::kLowLatency, r1(16384, DispatchDtype::kBF16ToFP8)), 1024 * kMiB);
}

TEST(HighThroughputMemory, WorstCaseHoldsEveryRow) {
  EpConfig c = r1(4096, DispatchDtype::kBF16ToFP8);
  const size_t sized = buffer_bytes(Backend::kHighThroughput, c);
  c.worst_case_output = true;
  const size_t worst = buffer_bytes(Backend::kHighThroughput, c);
  // fp8 row + bf16 partial per row of world x max tokens
  EXPECT_GE(worst - sized, size_t(c.capacity()) * size_t(c.hidden) * 3);
}

}  // namespace
}  // namespace epx
