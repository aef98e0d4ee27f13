#pragma once
// The inputs of one rank of a fault case, generated on the host, and what combine must give
// back for them. The expert stage of a fault case copies the received rows (partial = row), so
// combine returns y[n] = x[n] times the number of ranks that got token n and still take part;
// x holds values with 6 significant bits, so those sums are exact in bf16 and every output is
// checked bit for bit. No CUDA.

#include <cstdint>
#include <string>
#include <vector>

#include "fault_case.hpp"

namespace epx::fault {

struct RankInputs {
  std::vector<uint16_t> x;     // [kTokens][kHidden] bf16: +-(1 + j/32) * 2^e, j < 32, |e| <= 2
  std::vector<int32_t> ids;    // [kTokens][kTopk]: distinct experts of each token, in [0, E)
  std::vector<float> weights;  // [kTokens][kTopk]: 1/kTopk (the copy expert ignores them)
};

// Rank `rank`'s inputs, the same in every round and in every run.
RankInputs make_inputs(const FaultCase& c, int rank);

// Bit r: rank r holds one of token n's experts.
uint64_t reached_ranks(const FaultCase& c, const RankInputs& in, int n);

// (token, expert) pairs of these inputs whose expert lives on `rank`.
uint64_t pairs_on_rank(const FaultCase& c, const RankInputs& in, int rank);

// "" when y (bf16 [kTokens][kHidden]) is what combine gives when the ranks of `live` take part;
// otherwise the first difference, e.g. "y[3][17] = 0x4040, expected 0x4000 (x times 2)".
// Tokens that reach no rank of `live` are not checked (nothing is summed for them).
std::string compare_y(const FaultCase& c, const RankInputs& in, const std::vector<uint16_t>& y,
                      uint64_t live);

}  // namespace epx::fault
