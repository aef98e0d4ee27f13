// Deterministic routing, token counts and activations for tests and benchmarks.
//
// Only std::mt19937_64 is used from <random>: its output sequence is fixed by the standard,
// whereas the std:: distributions differ between standard libraries. The small helpers below
// turn its words into numbers the same way everywhere.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "epx/error.hpp"
#include "reference/reference.hpp"

namespace epx::ref {
namespace {

class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}

  // Uniform in [0, n); the modulo bias (n / 2^64) is far below anything a test can see.
  int below(int n) { return static_cast<int>(engine_() % static_cast<uint64_t>(n)); }
  // Uniform in [0, 1) with 53 random bits.
  double unit() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }
  bool chance(double p) { return unit() < p; }
  // Standard normal (Box-Muller; the second value is dropped to keep the state simple).
  double normal() {
    const double u1 = 1.0 - unit();  // (0, 1]
    const double u2 = unit();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  std::mt19937_64 engine_;
};

// Softmax of random logits over the valid (>= 0) ids of one token; -1 entries get weight 0.
void fill_weights(Rng& rng, const int32_t* ids, int topk, float* weights) {
  std::vector<double> logits(static_cast<size_t>(topk), 0.0);
  double max_logit = -1e300;
  for (int k = 0; k < topk; ++k) {
    logits[k] = rng.normal();
    if (ids[k] >= 0) max_logit = std::max(max_logit, logits[k]);
  }
  double sum = 0.0;
  for (int k = 0; k < topk; ++k) {
    if (ids[k] >= 0) sum += std::exp(logits[k] - max_logit);
  }
  for (int k = 0; k < topk; ++k) {
    weights[k] = ids[k] >= 0 ? static_cast<float>(std::exp(logits[k] - max_logit) / sum) : 0.0f;
  }
}

bool contains(const int32_t* ids, int n, int32_t e) {
  return std::find(ids, ids + n, e) != ids + n;
}

// Fills ids[0..topk) with distinct experts; `pick` proposes candidates.
template <typename Pick>
void fill_distinct(int topk, int num_experts, int32_t* ids, Pick&& pick) {
  const int n = std::min(topk, num_experts);
  for (int k = 0; k < n; ++k) {
    int32_t e;
    do {
      e = pick(k);
    } while (contains(ids, k, e));
    ids[k] = e;
  }
  for (int k = n; k < topk; ++k) ids[k] = -1;
}

}  // namespace

Routing make_routing(RoutingKind kind, int num_tokens, int num_experts, int topk, uint64_t seed,
                     int hot_expert) {
  EPX_CHECK(num_tokens >= 0, InputError, "num_tokens", num_tokens, ">= 0");
  EPX_CHECK(num_experts >= 1, InputError, "num_experts", num_experts, ">= 1");
  EPX_CHECK(topk >= 1 && topk <= kMaxTopk, InputError, "topk", topk, "in [1, kMaxTopk]");
  Routing out;
  out.num_tokens = num_tokens;
  out.topk = topk;
  out.ids.assign(static_cast<size_t>(num_tokens) * topk, -1);
  out.weights.assign(static_cast<size_t>(num_tokens) * topk, 0.0f);
  Rng rng(seed);
  // The hot set of kSkewed: 4 consecutive experts from hot_expert, so they mostly share a rank
  // and that rank receives far more than the others.
  const int num_hot = std::min(4, num_experts);
  const int hot_base = ((hot_expert % num_experts) + num_experts) % num_experts;

  for (int n = 0; n < num_tokens; ++n) {
    int32_t* ids = out.ids.data() + static_cast<size_t>(n) * topk;
    float* weights = out.weights.data() + static_cast<size_t>(n) * topk;
    switch (kind) {
      case RoutingKind::kUniform:
        fill_distinct(topk, num_experts, ids, [&](int) { return rng.below(num_experts); });
        break;
      case RoutingKind::kSkewed:
        // 80 % of picks from the hot set while it has unused members, the rest uniform.
        fill_distinct(topk, num_experts, ids, [&](int k) {
          if (k < num_hot && rng.chance(0.8)) return (hot_base + rng.below(num_hot)) % num_experts;
          return rng.below(num_experts);
        });
        break;
      case RoutingKind::kOneExpert:
        // hot_expert is used as given: an out-of-range value makes every token invalid, which
        // is how tests exercise the device's input check.
        ids[0] = hot_expert;
        for (int k = 1; k < topk; ++k) ids[k] = -1;
        break;
      case RoutingKind::kMasked:
        fill_distinct(topk, num_experts, ids, [&](int) { return rng.below(num_experts); });
        // One token in 8 loses every entry; the others lose each entry with probability 1/7,
        // so about a quarter of all entries end up -1.
        if (rng.chance(1.0 / 8.0)) {
          std::fill(ids, ids + topk, -1);
        } else {
          for (int k = 0; k < topk; ++k) {
            if (rng.chance(1.0 / 7.0)) ids[k] = -1;
          }
        }
        break;
    }
    fill_weights(rng, ids, topk, weights);
  }
  return out;
}

std::vector<int> make_token_counts(int world_size, int max_tokens, int spec, uint64_t seed) {
  EPX_CHECK(world_size >= 1, InputError, "world_size", world_size, ">= 1");
  EPX_CHECK(max_tokens >= 0, InputError, "max_tokens", max_tokens, ">= 0");
  EPX_CHECK(spec <= max_tokens, InputError, "spec", spec,
            "< 0 (random) or <= max_tokens = " + std::to_string(max_tokens));
  std::vector<int> counts(static_cast<size_t>(world_size), spec);
  if (spec >= 0) return counts;
  Rng rng(seed ^ 0x7E57C0DE5EEDull);
  for (int& c : counts) {
    // A sixth each at the edges (0 and max), otherwise uniform in [0, max].
    const int roll = rng.below(6);
    if (roll == 0) {
      c = 0;
    } else if (roll == 1) {
      c = max_tokens;
    } else {
      c = rng.below(max_tokens + 1);
    }
  }
  return counts;
}

RankInput make_rank_input(const EpConfig& cfg, int num_tokens, const Routing& routing,
                          uint64_t seed) {
  EPX_CHECK(routing.num_tokens == num_tokens, InputError, "routing.num_tokens", routing.num_tokens,
            "num_tokens = " + std::to_string(num_tokens));
  EPX_CHECK(routing.topk == cfg.topk, InputError, "routing.topk", routing.topk,
            "cfg.topk = " + std::to_string(cfg.topk));
  RankInput in;
  in.num_tokens = num_tokens;
  in.routing = routing;
  const size_t elems = static_cast<size_t>(num_tokens) * cfg.hidden;
  std::vector<uint16_t> bf16(elems);
  Rng rng(seed ^ 0xAC71BA7E5ull);
  for (auto& v : bf16) {
    double x = rng.normal();
    // About one element in 500 is an outlier of magnitude ~20, as real activations have; they
    // make the 1x128 scales differ between blocks.
    if (rng.chance(1.0 / 500.0)) x = (x < 0 ? -20.0 : 20.0) * (0.75 + 0.5 * rng.unit());
    v = bf16_from_float(static_cast<float>(x));
  }
  if (cfg.input_fp8()) {
    in.x_fp8.resize(elems);
    in.scales.resize(static_cast<size_t>(num_tokens) * cfg.num_scale_groups());
    quantize_fp8(bf16.data(), num_tokens, cfg.hidden, in.x_fp8.data(), in.scales.data());
  } else {
    in.x_bf16 = std::move(bf16);
  }
  return in;
}

bool token_valid(const int32_t* ids, int topk, int num_experts) {
  for (int k = 0; k < topk; ++k) {
    if (ids[k] < -1 || ids[k] >= num_experts) return false;
    if (ids[k] >= 0 && contains(ids, k, ids[k])) return false;
  }
  return true;
}

}  // namespace epx::ref
