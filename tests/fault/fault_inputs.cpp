#include "fault_inputs.hpp"

#include <fmt/format.h>

#include <bit>
#include <cmath>

#include "reference/reference.hpp"

namespace epx::fault {
namespace {

// splitmix64: a fixed stream per seed, the same on every machine.
struct Stream {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  int below(int n) { return int(next() % uint64_t(n)); }
};

}  // namespace

RankInputs make_inputs(const FaultCase& c, int rank) {
  Stream rng{0xfa017ull * 1000003ull + uint64_t(rank)};
  RankInputs in;
  in.x.resize(size_t(kTokens) * kHidden);
  for (uint16_t& v : in.x) {
    const float mantissa = 1.0f + float(rng.below(32)) / 32.0f;
    const float value = std::ldexp(mantissa, rng.below(5) - 2) * (rng.below(2) ? -1.0f : 1.0f);
    v = ref::bf16_from_float(value);
  }
  in.ids.resize(size_t(kTokens) * kTopk);
  for (int n = 0; n < kTokens; ++n) {
    int32_t* row = &in.ids[size_t(n) * kTopk];
    for (int k = 0; k < kTopk; ++k) {
      bool repeated = true;
      while (repeated) {
        row[k] = rng.below(c.experts);
        repeated = false;
        for (int j = 0; j < k; ++j) repeated |= row[j] == row[k];
      }
    }
  }
  in.weights.assign(size_t(kTokens) * kTopk, 1.0f / kTopk);
  return in;
}

uint64_t reached_ranks(const FaultCase& c, const RankInputs& in, int n) {
  const int per_rank = c.experts / c.world;
  uint64_t bits = 0;
  for (int k = 0; k < kTopk; ++k) bits |= uint64_t(1) << (in.ids[size_t(n) * kTopk + k] / per_rank);
  return bits;
}

uint64_t pairs_on_rank(const FaultCase& c, const RankInputs& in, int rank) {
  const int per_rank = c.experts / c.world;
  uint64_t pairs = 0;
  for (int32_t id : in.ids) pairs += id / per_rank == rank ? 1 : 0;
  return pairs;
}

std::string compare_y(const FaultCase& c, const RankInputs& in, const std::vector<uint16_t>& y,
                      uint64_t live) {
  if (y.size() != in.x.size()) {
    return fmt::format("y has {} values, expected {}", y.size(), in.x.size());
  }
  for (int n = 0; n < kTokens; ++n) {
    const int times = std::popcount(reached_ranks(c, in, n) & live);
    if (times == 0) continue;
    for (int h = 0; h < kHidden; ++h) {
      const size_t i = size_t(n) * kHidden + size_t(h);
      const uint16_t want = ref::bf16_from_float(float(times) * ref::bf16_to_float(in.x[i]));
      if (y[i] != want) {
        return fmt::format("y[{}][{}] = {:#06x}, expected {:#06x} (x times {})", n, h, y[i], want,
                           times);
      }
    }
  }
  return "";
}

}  // namespace epx::fault
