// The captured MoE expert stage's SWITCH body index (src/moe/row_buckets.hpp): body i runs the
// GEMMs at padded_row_buckets(max)[i - 1] rows, so the index a kernel computes from a row count
// must name exactly padded_rows(count).

#include <gtest/gtest.h>

#include <vector>

#include "moe/row_buckets.hpp"

namespace {

using epx::moe::max_expert_rows;
using epx::moe::padded_row_buckets;
using epx::moe::padded_rows;
using epx::moe::row_bucket_index;

TEST(RowBucketIndex, ZeroRowsIsTheEmptyBody) {
  EXPECT_EQ(row_bucket_index(0), 0);
  EXPECT_EQ(row_bucket_index(-3), 0);
}

TEST(RowBucketIndex, NamesThePaddedRowsBucket) {
  const int max_rows = 6000;
  const std::vector<int> buckets = padded_row_buckets(max_rows);
  for (int m = 1; m <= max_rows; ++m) {
    const int i = row_bucket_index(m);
    ASSERT_GE(i, 1) << "m " << m;
    ASSERT_LE(size_t(i), buckets.size()) << "m " << m;
    ASSERT_EQ(buckets[size_t(i) - 1], padded_rows(m)) << "m " << m;
  }
}

// A smaller list (the buckets of a chunk's bound) is a prefix of a larger one, so the index of
// any count up to the bound stays inside the smaller list: a SWITCH node with
// padded_row_buckets(bound).size() + 1 bodies covers every count <= bound.
TEST(RowBucketIndex, StaysInsideTheBoundsBuckets) {
  for (int bound : {1, 15, 16, 17, 32, 100, 256, 257, 1000, 1024, 1025, 4096}) {
    const std::vector<int> buckets = padded_row_buckets(bound);
    for (int m = 1; m <= bound; ++m) {
      ASSERT_LE(size_t(row_bucket_index(m)), buckets.size()) << "bound " << bound << " m " << m;
    }
    EXPECT_EQ(size_t(row_bucket_index(bound)), buckets.size()) << "bound " << bound;
  }
}

TEST(RowBucketIndex, ByHand) {
  EXPECT_EQ(row_bucket_index(1), 1);      // 16
  EXPECT_EQ(row_bucket_index(256), 16);   // 256
  EXPECT_EQ(row_bucket_index(257), 17);   // 320
  EXPECT_EQ(row_bucket_index(1024), 28);  // 1024
  EXPECT_EQ(row_bucket_index(1025), 29);  // 1280
}

TEST(MaxExpertRows, WorldTimesTokensCappedByCapacity) {
  EXPECT_EQ(max_expert_rows(8, 4, 1024), 32);
  EXPECT_EQ(max_expert_rows(8, 128, 1024), 1024);
  EXPECT_EQ(max_expert_rows(8, 0, 1024), 0);
  EXPECT_EQ(max_expert_rows(2, 200, 64), 64);
}

}  // namespace
