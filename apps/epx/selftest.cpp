// `epx selftest` (the CPU reference's own invariants, no GPU) and `epx sizes` (device memory of
// one rank's low_latency object).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "commands.hpp"
#include "epx/config.hpp"
#include "epx/error.hpp"
#include "flags.hpp"
#include "reference/reference.hpp"
#include "report.hpp"
#if EPX_HAVE_CUDA
#include "epx/all2all.hpp"
#endif

namespace epx::cli {
void add_selftest(CLI::App& app, int& exit_code) {
  auto f = std::make_shared<ShapeFlags>();
  auto seeds = std::make_shared<int>(3);
  auto tokens = std::make_shared<int>(128);
  CLI::App* c =
      app.add_subcommand("selftest",
                         "CPU only: check the reference's own invariants (delivery, dedup, counts, "
                         "combine of identity experts = sum_k w_k x within bf16 rounding)");
  add_shape_flags(c, *f, MaxTokensFlag::kOffered);
  c->add_option("--tokens", *tokens, "tokens per rank")->capture_default_str();
  c->add_option("--seeds", *seeds, "random cases")->capture_default_str();
  c->callback([f, seeds, tokens, &exit_code] {
    const EpConfig cfg = f->config(std::max(1, *tokens));
    const double tolerance =
        4.0 / 256 + (cfg.combine_format == CombineFormat::kLogFMT ? 0.0217 : 0.0);
    int failures = 0;
    double worst = 0.0;
    for (int seed = 1; seed <= *seeds; ++seed) {
      std::vector<ref::RankInput> in;
      for (int r = 0; r < cfg.world_size; ++r) {
        auto routing = ref::make_routing(ref::RoutingKind::kUniform, *tokens, cfg.num_experts,
                                         cfg.topk, seed * 131 + r);
        in.push_back(ref::make_rank_input(cfg, *tokens, routing, seed * 977 + r));
      }
      const auto tm = ref::dispatch_token_major(cfg, in);
      std::vector<std::vector<uint16_t>> partials;
      int64_t delivered = 0, expected = 0;
      for (int r = 0; r < cfg.world_size; ++r) {
        partials.push_back(ref::identity_partials(cfg, r, tm[r]));
        delivered += tm[r].count;
      }
      for (const auto& ri : in) {
        for (int n = 0; n < ri.num_tokens; ++n) {
          uint64_t mask = 0;
          for (int k = 0; k < cfg.topk; ++k) {
            const int id = ri.routing.ids[size_t(n) * cfg.topk + k];
            if (id >= 0) mask |= uint64_t(1) << cfg.expert_rank(id);
          }
          expected += __builtin_popcountll(mask);
        }
      }
      if (delivered != expected) {
        ++failures;
        fmt::print("  seed {}: {} rows delivered, {} expected after per-rank dedup\n", seed,
                   delivered, expected);
      }
      const auto y = ref::combine_token_major(cfg, in, tm, partials, cfg.combine_format);
      for (int s = 0; s < cfg.world_size; ++s) {
        for (int n = 0; n < in[s].num_tokens; ++n) {
          const auto v = ref::token_as_float(cfg, in[s], n);
          double wsum = 0;
          for (int k = 0; k < cfg.topk; ++k)
            if (in[s].routing.ids[size_t(n) * cfg.topk + k] >= 0)
              wsum += in[s].routing.weights[size_t(n) * cfg.topk + k];
          for (int h = 0; h < cfg.hidden; ++h) {
            const double want = wsum * v[h];
            const double got = ref::bf16_to_float(y[s][size_t(n) * cfg.hidden + h]);
            // bf16 rounding of each partial and of the sum: a few ulps of bf16 (2^-8 relative);
            // LogFMT rows add at most 0.0217 relative per partial (src/core/logfmt.hpp), and
            // the partials of a column share their sign here, so the sum keeps that bound.
            const double err = std::fabs(got - want) / (std::fabs(want) + 1e-3);
            worst = std::max(worst, err);
            if (err > tolerance) {
              ++failures;
              if (failures < 8)
                fmt::print("  seed {} rank {} token {} col {}: got {} expected {}\n", seed, s, n, h,
                           got, want);
            }
          }
        }
      }
    }
    fmt::print(
        "{}: reference selftest, world {}, H {}, E {}, K {}, {} tokens/rank, {} seed(s), "
        "worst relative combine error {:.2e}\n",
        failures == 0 ? "PASS" : "FAIL", cfg.world_size, cfg.hidden, cfg.num_experts, cfg.topk,
        *tokens, *seeds, worst);
    exit_code = failures == 0 ? 0 : 1;
  });
}

void add_sizes(CLI::App& app, int& exit_code) {
  auto f = std::make_shared<ShapeFlags>();
  auto tokens = std::make_shared<std::string>("128,1024");
  CLI::App* c = app.add_subcommand("sizes", "device memory of one rank's low_latency object");
  add_shape_flags(c, *f, MaxTokensFlag::kOffered);
  c->add_option("--tokens", *tokens, "max tokens per rank, comma list")->capture_default_str();
  c->callback([f, tokens, &exit_code] {
#if EPX_HAVE_CUDA
    fmt::print("{:>10} {:>8} {:>7} {:>16}\n", "max_tok", "dtype", "layout", "bytes per rank");
    for (int t : parse_int_list(*tokens, "--tokens", 1, kMaxTokensPerRank, "", Repeats::kAllowed)) {
      for (const char* layout : {"token", "expert"}) {
        ShapeFlags g = *f;
        g.max_tokens = 0;
        g.layout = layout;
        const EpConfig cfg = g.config(t);
        fmt::print("{:>10} {:>8} {:>7} {:>16}\n", t, to_string(cfg.dtype), layout,
                   mib(low_latency_buffer_bytes(cfg)));
      }
    }
    exit_code = 0;
#else
    (void)f;
    (void)tokens;
    (void)exit_code;
    EPX_THROW(UnsupportedError, "epx sizes needs a CUDA build of epx");
#endif
  });
}

}  // namespace epx::cli
