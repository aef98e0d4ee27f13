// The MoE layer's GEMM row buckets (src/moe/row_buckets.hpp).

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "moe/row_buckets.hpp"

namespace {

using epx::moe::kMaxRowPad;
using epx::moe::padded_row_buckets;
using epx::moe::padded_rows;

TEST(RowBuckets, PaddedRowsByHand) {
  EXPECT_EQ(padded_rows(0), 0);
  EXPECT_EQ(padded_rows(1), 16);
  EXPECT_EQ(padded_rows(16), 16);
  EXPECT_EQ(padded_rows(17), 32);
  EXPECT_EQ(padded_rows(256), 256);
  EXPECT_EQ(padded_rows(257), 320);
  EXPECT_EQ(padded_rows(1024), 1024);
  EXPECT_EQ(padded_rows(1025), 1280);
}

// Every m maps to a bucket >= m, a multiple of 16 (16-byte scale columns), at most kMaxRowPad
// above m, and among padded_row_buckets(max) for every max >= m.
TEST(RowBuckets, EveryRowCountHasItsBucket) {
  const int max_rows = 5000;
  const std::vector<int> buckets = padded_row_buckets(max_rows);
  ASSERT_FALSE(buckets.empty());
  for (size_t i = 1; i < buckets.size(); ++i) EXPECT_LT(buckets[i - 1], buckets[i]);
  for (int m = 1; m <= max_rows; ++m) {
    const int p = padded_rows(m);
    ASSERT_GE(p, m);
    ASSERT_LE(p - m, kMaxRowPad) << m;
    ASSERT_EQ(p % 16, 0) << m;
    ASSERT_TRUE(std::binary_search(buckets.begin(), buckets.end(), p)) << m;
  }
  EXPECT_EQ(buckets.back(), padded_rows(max_rows));
  // 16 buckets up to 256, 12 more up to 1024, then one per 256 rows.
  EXPECT_EQ(padded_row_buckets(1024).size(), 28u);
}

}  // namespace
