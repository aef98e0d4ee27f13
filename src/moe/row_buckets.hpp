#pragma once
// Row counts of the MoE layer's fp8 GEMMs. A GEMM of m rows runs at padded_rows(m) rows (the
// extra rows are zeros with scale 1), and padded_rows takes few values: multiples of 16 up to
// 256, of 64 up to 1024, of 256 beyond. So the cuBLASLt kernels a layer can ever launch are known
// when it is built, and all of them are launched once then (MoeLayer's warm-up): cuBLASLt loads a
// kernel at its first launch, and a load waits for the kernels running on the device, which in an
// in-process world are peers spinning until this rank arrives. No CUDA here (CPU-tested).

#include <vector>

namespace epx::moe {

inline constexpr int kMaxRowPad = 255;  // padded_rows(m) - m <= kMaxRowPad

constexpr int padded_rows(int m) {
  if (m <= 0) return 0;
  const int g = m <= 256 ? 16 : (m <= 1024 ? 64 : 256);
  return (m + g - 1) / g * g;
}

// Every value padded_rows(m) takes for m in [1, max_rows], ascending.
inline std::vector<int> padded_row_buckets(int max_rows) {
  std::vector<int> out;
  for (int m = 1; m <= max_rows; m = padded_rows(m) + 1) out.push_back(padded_rows(m));
  return out;
}

// Position of padded_rows(m) in padded_row_buckets(max) plus one (for any max >= m), 0 for m <= 0:
// the body of a captured expert's SWITCH node (MoeLayer under CUDA graph capture), 0 = no rows.
// Closed form of padded_rows' three ranges (16 buckets up to 256, 12 up to 1024, then every 256);
// also called in device code.
constexpr int row_bucket_index(int m) {
  if (m <= 0) return 0;
  if (m <= 256) return (m + 15) / 16;
  if (m <= 1024) return 16 + (m - 256 + 63) / 64;
  return 28 + (m - 1024 + 255) / 256;
}

// Most rows one local expert can receive in a chunk when every rank sends at most
// `tokens_per_rank` tokens (each token reaches an expert at most once), bounded by the capacity.
constexpr int max_expert_rows(int world_size, int tokens_per_rank, int capacity) {
  const long long rows = static_cast<long long>(world_size) * tokens_per_rank;
  return rows < capacity ? static_cast<int>(rows) : capacity;
}

}  // namespace epx::moe
