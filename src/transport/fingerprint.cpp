// The start-up agreement of a job's ranks: one canonical text per rank, compared field by field
// (include/epx/bootstrap.hpp).

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "epx/bootstrap.hpp"
#include "epx/error.hpp"

#ifndef EPX_VERSION
#error "EPX_VERSION must be defined by the build (CMake's PROJECT_VERSION)"
#endif

namespace epx {

const char* library_version() { return EPX_VERSION; }

std::string fingerprint(const EpConfig& c, Backend backend) {
  // The version comes first: when it differs, the other fields may not even be comparable.
  return fmt::format(
      "epx_version={}\nbackend={}\nworld_size={}\nhidden={}\nnum_experts={}\ntopk={}\n"
      "max_tokens_per_rank={}\ndtype={}\nscale_layout={}\nround_scale={}\nlayout={}\n"
      "deterministic={}\n"
      "rounds_in_flight={}\nmask_failed_ranks={}\nworst_case_output={}\ncombine={}\n"
      "combine_format={}\ncombine_order={}\ntimeout_ms={}\n",
      library_version(), to_string(backend), c.world_size, c.hidden, c.num_experts, c.topk,
      c.max_tokens_per_rank, to_string(c.dtype), to_string(c.scale_layout),
      c.round_scale ? "true" : "false", to_string(c.layout),
      c.deterministic ? "true" : "false", c.rounds_in_flight,
      c.mask_failed_ranks ? "true" : "false", c.worst_case_output ? "true" : "false",
      to_string(c.combine),
      to_string(c.combine_format), to_string(c.combine_order), c.timeout_ms);
}

namespace {

using Fields = std::vector<std::pair<std::string, std::string>>;

Fields parse_fields(std::string_view text) {
  Fields out;
  while (!text.empty()) {
    const size_t eol = text.find('\n');
    const std::string_view line = text.substr(0, eol);
    text = eol == std::string_view::npos ? std::string_view() : text.substr(eol + 1);
    if (line.empty()) continue;
    const size_t eq = line.find('=');
    if (eq == std::string_view::npos) {
      out.emplace_back(std::string(line), std::string());
    } else {
      out.emplace_back(std::string(line.substr(0, eq)), std::string(line.substr(eq + 1)));
    }
  }
  return out;
}

// Every value of `key`, in order. A fingerprint has each key once; a text that repeats one (a
// peer's, from another build) must not hide a difference behind the first value.
std::optional<std::vector<std::string>> value_of(const Fields& f, const std::string& key) {
  std::optional<std::vector<std::string>> out;
  for (const auto& [k, v] : f) {
    if (k != key) continue;
    if (!out) out.emplace();
    out->push_back(v);
  }
  return out;
}

std::string shown(const std::optional<std::vector<std::string>>& v) {
  if (!v) return "no such field";
  if (v->size() == 1) return v->front();
  return fmt::format("[{}]", fmt::join(*v, ", "));
}

// The first field (in rank 0's order, then fields only other ranks have) on which a rank
// differs from rank 0, as "field: rank 0 has A, rank r has B".
std::optional<std::string> first_difference(const std::vector<std::string>& texts) {
  std::vector<Fields> all;
  for (const std::string& t : texts) all.push_back(parse_fields(t));
  std::vector<std::string> keys;
  for (const Fields& f : all) {
    for (const auto& kv : f) {
      if (std::find(keys.begin(), keys.end(), kv.first) == keys.end()) keys.push_back(kv.first);
    }
  }
  for (const std::string& key : keys) {
    const auto v0 = value_of(all[0], key);
    for (size_t r = 1; r < all.size(); ++r) {
      const auto vr = value_of(all[r], key);
      if (vr != v0) {
        return fmt::format("{}: rank 0 has {}, rank {} has {}", key, shown(v0), r, shown(vr));
      }
    }
  }
  return std::nullopt;
}

}  // namespace

void check_fingerprints(Bootstrap& bootstrap, const std::string& mine) {
  const std::vector<std::string> all = bootstrap.all_gather(mine);
  if (const auto diff = first_difference(all)) {
    EPX_THROW(ConfigError,
              fmt::format("start-up check on rank {} of {}: the ranks disagree on {} (every rank "
                          "must run the same epx version and backend, and the same EpConfig "
                          "apart from rank)",
                          bootstrap.rank(), bootstrap.size(), *diff));
  }
}

void check_fingerprints(Bootstrap& bootstrap, const EpConfig& cfg, Backend backend) {
  check_fingerprints(bootstrap, fingerprint(cfg, backend));
}

}  // namespace epx
