// The byte volumes of `epx bench` (apps/epx/figures.hpp): dispatch's rows, and combine's partials
// as they cross, bf16 or LogFMT rows.

#include <gtest/gtest.h>

#include <vector>

#include "core/logfmt.hpp"
#include "epx/config.hpp"
#include "figures.hpp"
#include "reference/reference.hpp"

namespace epx::cli {
namespace {

// Two ranks, experts 0..1 on rank 0 and 2..3 on rank 1, top-2: token 0 of rank 0 stays home,
// token 1 goes to both ranks; rank 1's only token goes to rank 0.
std::vector<ref::Routing> two_rank_routing() {
  ref::Routing r0;
  r0.num_tokens = 2;
  r0.topk = 2;
  r0.ids = {0, 1, 1, 2};
  r0.weights = {0.5f, 0.5f, 0.5f, 0.5f};
  ref::Routing r1;
  r1.num_tokens = 1;
  r1.topk = 2;
  r1.ids = {0, -1};
  r1.weights = {1.0f, 0.0f};
  return {r0, r1};
}

EpConfig two_rank_config() {
  EpConfig c;
  c.world_size = 2;
  c.hidden = 7168;
  c.num_experts = 4;
  c.topk = 2;
  c.max_tokens_per_rank = 2;
  c.dtype = DispatchDtype::kBF16;
  return c;
}

TEST(BenchFigures, CombineCountsTheRowsAsTheyCross) {
  EpConfig c = two_rank_config();
  const Volumes bf16 = compute_volumes(c, two_rank_routing());
  EXPECT_EQ(bf16.tokens, 3);
  EXPECT_EQ(bf16.rows_self, 2);      // rank 0's two tokens at home
  EXPECT_EQ(bf16.rows_crossing, 2);  // token 1 to rank 1, rank 1's token to rank 0
  EXPECT_EQ(bf16.combine_row_bytes, 2 * 7168);
  EXPECT_EQ(bf16.combine.crossing, 2 * 2 * 7168);
  EXPECT_EQ(bf16.combine.algorithm, 4 * 2 * 7168);

  c.combine_format = CombineFormat::kLogFMT;
  const Volumes lf = compute_volumes(c, two_rank_routing());
  EXPECT_EQ(lf.combine_row_bytes, logfmt::row_bytes(7168));
  EXPECT_EQ(lf.combine_row_bytes, 9184);  // 41 * 7168 / 32
  EXPECT_EQ(lf.combine.crossing, 2 * 9184);
  EXPECT_EQ(lf.combine.algorithm, 4 * 9184);
  // HBM holds bf16 partials and output either way; dispatch does not change.
  EXPECT_EQ(lf.combine.floor, bf16.combine.floor);
  EXPECT_EQ(lf.dispatch.crossing, bf16.dispatch.crossing);
  EXPECT_EQ(lf.wire_row_bytes, bf16.wire_row_bytes);
}

}  // namespace
}  // namespace epx::cli
