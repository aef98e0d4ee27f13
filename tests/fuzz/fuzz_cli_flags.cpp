// The CLI's flags module (apps/epx/flags.hpp): each value parser on every field of the input,
// then the fields as the argv of two commands built from the module — a sweep command's flags
// (bench, tune) made into a Sweep, and a check command's shape flags and --tokens made into an
// EpConfig. Refusals may only be ConfigError (epx) or CLI::ParseError (CLI11); what is accepted
// must be what the parsers promise: every value in its bound, every config valid.

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "epx/config.hpp"
#include "epx/error.hpp"
#include "flags.hpp"
#include "fuzz_input.hpp"

namespace {

using epx::ConfigError;
using epx::fuzz::refuses_only_with;
using epx::fuzz::require;
namespace cli = epx::cli;

void require_valid(const epx::EpConfig& cfg, const char* what) {
  require(refuses_only_with<ConfigError>(what, [&] { cfg.validate(); }),
          std::string(what) + " returned a config that validate() refuses");
}

void value_parsers(const std::string& t) {
  std::vector<int> counts;
  if (refuses_only_with<ConfigError>("parse_token_counts",
                                     [&] { counts = cli::parse_token_counts(t, "--tokens"); })) {
    require(!counts.empty(), "parse_token_counts accepted an empty list");
    for (int c : counts) {
      require(c >= 0 && c <= epx::kMaxTokensPerRank,
              "parse_token_counts accepted " + std::to_string(c));
    }
    for (int world : {-1, 0, 1, 3, int(counts.size())}) {
      std::vector<int> per_rank;
      if (refuses_only_with<ConfigError>("tokens_per_rank", [&] {
            per_rank = cli::tokens_per_rank(counts, world, "--tokens", t);
          })) {
        require(per_rank.size() == size_t(std::max(world, 0)),
                "tokens_per_rank gave " + std::to_string(per_rank.size()) + " counts for " +
                    std::to_string(world) + " ranks");
      }
    }
  }
  std::vector<int> ints;
  if (refuses_only_with<ConfigError>("parse_int_list", [&] {
        ints = cli::parse_int_list(t, "--blocks", 1, epx::kMaxBlocks);
      })) {
    std::vector<int> sorted = ints;
    std::sort(sorted.begin(), sorted.end());
    require(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
            "parse_int_list accepted a repeated value");
    for (int v : ints) require(v >= 1 && v <= epx::kMaxBlocks, "parse_int_list out of range");
  }
  (void)refuses_only_with<ConfigError>("parse_routing_flag", [&] { cli::parse_routing_flag(t); });
  std::vector<epx::Backend> backends;
  if (refuses_only_with<ConfigError>(
          "parse_backend_list", [&] { backends = cli::parse_backend_list(t, "--backends"); })) {
    require(!backends.empty() && backends.size() <= 3, "parse_backend_list: wrong count");
  }
  (void)refuses_only_with<ConfigError>("parse_world_kind", [&] { cli::parse_world_kind(t); });
  (void)refuses_only_with<ConfigError>("parse_dtype_flag", [&] { cli::parse_dtype_flag(t); });
  (void)refuses_only_with<ConfigError>("parse_layout_flag", [&] { cli::parse_layout_flag(t); });
  (void)refuses_only_with<ConfigError>("parse_scale_layout_flag",
                                       [&] { cli::parse_scale_layout_flag(t); });
  (void)cli::in_flag_names(t, "--tokens");
}

// CLI11 may refuse the command line (ParseError, help included); epx may refuse the values.
template <typename Build, typename Use>
void command(const std::vector<std::string>& args, Build build, Use use) {
  CLI::App app{"fuzz"};
  build(app);
  std::vector<const char*> argv{"epx"};
  for (const std::string& a : args) argv.push_back(a.c_str());
  const bool parsed = refuses_only_with<CLI::ParseError>(
      "CLI::App::parse", [&] { app.parse(int(argv.size()), argv.data()); });
  if (parsed) (void)refuses_only_with<ConfigError>("the command's flags", use);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const epx::fuzz::Fields f(data, size);
  std::vector<std::string> args;
  for (size_t i = 0; i < f.size() && i < 24; ++i) {
    if (i < 8) value_parsers(f.text(i));
    args.push_back(f.text(i));
  }

  cli::SweepFlags sweep_flags;
  command(
      args, [&](CLI::App& app) { cli::add_sweep_flags(&app, sweep_flags); },
      [&] {
        const cli::Sweep s = cli::make_sweep(sweep_flags);
        require_valid(s.cfg, "make_sweep");
        require(!s.tokens.empty(), "make_sweep: no token counts");
        for (int t : s.tokens) {
          require(t >= 1 && t <= s.cfg.max_tokens_per_rank, "make_sweep: count above the max");
          require_valid(s.config_for(t), "Sweep::config_for");
        }
        require(!s.devices.empty() && int(s.devices.size()) <= s.cfg.world_size,
                "make_sweep: GPUs outside [1, --world]");
      });

  cli::ShapeFlags shape;
  std::string tokens = "128";
  command(
      args,
      [&](CLI::App& app) {
        cli::add_shape_flags(&app, shape, cli::MaxTokensFlag::kOffered);
        app.add_option("--tokens", tokens);
      },
      [&] {
        const std::vector<int> counts = cli::parse_token_counts(tokens, "--tokens");
        const int most = std::max(1, *std::max_element(counts.begin(), counts.end()));
        const epx::EpConfig cfg = shape.config(most);
        require_valid(cfg, "ShapeFlags::config");
        const std::vector<int> per_rank =
            cli::tokens_per_rank(counts, cfg.world_size, "--tokens", tokens);
        require(int(per_rank.size()) == cfg.world_size, "tokens_per_rank: wrong count");
      });
  return 0;
}
