// EpConfig::validate(), the JSON launch file (DESIGN §6) and the names of the enums.

#include "epx/config.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string_view>
#include <system_error>
#include <vector>

#include "core/env.hpp"
#include "core/logfmt.hpp"
#include "epx/error.hpp"

namespace epx {

// ---- enum names ---------------------------------------------------------------------------

namespace {

template <typename Enum>
struct NamedValue {
  Enum value;
  const char* name;
};

constexpr std::array<NamedValue<Backend>, 4> kBackendNames{{
    {Backend::kNaive, "naive"},
    {Backend::kAllgatherReduceScatter, "allgather_reducescatter"},
    {Backend::kLowLatency, "low_latency"},
    {Backend::kHighThroughput, "high_throughput"},
}};
constexpr std::array<NamedValue<DispatchDtype>, 3> kDtypeNames{{
    {DispatchDtype::kBF16, "bf16"},
    {DispatchDtype::kFP8, "fp8"},
    {DispatchDtype::kBF16ToFP8, "bf16-to-fp8"},
}};
constexpr std::array<NamedValue<ScaleLayout>, 2> kScaleLayoutNames{{
    {ScaleLayout::kRowMajor, "row"},
    {ScaleLayout::kColumnMajor, "column"},
}};
constexpr std::array<NamedValue<OutputLayout>, 2> kOutputLayoutNames{{
    {OutputLayout::kTokenMajor, "token"},
    {OutputLayout::kExpertMajor, "expert"},
}};
constexpr std::array<NamedValue<CombineMode>, 3> kCombineModeNames{{
    {CombineMode::kAuto, "auto"},
    {CombineMode::kPull, "pull"},
    {CombineMode::kPush, "push"},
}};
constexpr std::array<NamedValue<CombineFormat>, 2> kCombineFormatNames{{
    {CombineFormat::kBF16, "bf16"},
    {CombineFormat::kLogFMT, "logfmt"},
}};
constexpr std::array<NamedValue<CombineOrder>, 2> kCombineOrderNames{{
    {CombineOrder::kRank, "rank"},
    {CombineOrder::kHighestSlot, "highest_slot"},
}};

template <typename Enum, size_t N>
const char* name_of(const std::array<NamedValue<Enum>, N>& table, Enum v) {
  for (const auto& nv : table) {
    if (nv.value == v) return nv.name;
  }
  return "invalid";
}

template <typename Enum, size_t N>
bool is_named(const std::array<NamedValue<Enum>, N>& table, Enum v) {
  return std::any_of(table.begin(), table.end(), [v](const auto& nv) { return nv.value == v; });
}

template <typename Enum, size_t N>
std::string list_names(const std::array<NamedValue<Enum>, N>& table) {
  std::string out;
  for (const auto& nv : table) {
    if (!out.empty()) out += ", ";
    out += nv.name;
  }
  return out;
}

// `what` names where the text came from (a field or an environment variable).
template <typename Enum, size_t N>
Enum parse_named(const std::array<NamedValue<Enum>, N>& table, std::string_view what,
                 const std::string& text) {
  for (const auto& nv : table) {
    if (text == nv.name) return nv.value;
  }
  EPX_THROW(ConfigError,
            fmt::format("{} = \"{}\", expected one of {}", what, text, list_names(table)));
}

}  // namespace

namespace detail {

Backend parse_backend_as(std::string_view what, const std::string& text) {
  return parse_named(kBackendNames, what, text);
}

}  // namespace detail

const char* to_string(Backend b) { return name_of(kBackendNames, b); }
const char* to_string(DispatchDtype d) { return name_of(kDtypeNames, d); }
const char* to_string(ScaleLayout s) { return name_of(kScaleLayoutNames, s); }
const char* to_string(OutputLayout l) { return name_of(kOutputLayoutNames, l); }
const char* to_string(CombineMode m) { return name_of(kCombineModeNames, m); }
const char* to_string(CombineFormat f) { return name_of(kCombineFormatNames, f); }
const char* to_string(CombineOrder o) { return name_of(kCombineOrderNames, o); }

Backend parse_backend(const std::string& name) { return detail::parse_backend_as("backend", name); }
DispatchDtype parse_dispatch_dtype(const std::string& name) {
  return parse_named(kDtypeNames, "dtype", name);
}
OutputLayout parse_output_layout(const std::string& name) {
  return parse_named(kOutputLayoutNames, "layout", name);
}
ScaleLayout parse_scale_layout(const std::string& name) {
  return parse_named(kScaleLayoutNames, "scale_layout", name);
}
CombineMode parse_combine_mode(const std::string& name) {
  return parse_named(kCombineModeNames, "combine", name);
}
CombineFormat parse_combine_format(const std::string& name) {
  return parse_named(kCombineFormatNames, "combine_format", name);
}
CombineOrder parse_combine_order(const std::string& name) {
  return parse_named(kCombineOrderNames, "combine_order", name);
}

// ---- EpConfig -------------------------------------------------------------------------------

void EpConfig::validate() const {
  // Rank masks in the kernels are one 64-bit word; a world of 0 ranks has nobody to talk to.
  EPX_CHECK(world_size >= 1 && world_size <= kMaxRanks, ConfigError, "world_size", world_size,
            fmt::format("in [1, kMaxRanks = {}]", kMaxRanks));
  // The rank indexes the peer table and picks this rank's experts.
  EPX_CHECK(rank >= 0 && rank < world_size, ConfigError, "rank", rank,
            fmt::format("in [0, world_size = {})", world_size));
  // Row offsets inside one row stay in 32-bit arithmetic.
  EPX_CHECK(hidden >= 1 && hidden <= kMaxHidden, ConfigError, "hidden", hidden,
            fmt::format("in [1, kMaxHidden = {}]", kMaxHidden));
  // Kernels copy rows in 16-byte vectors; a bf16 row must be a whole number of them.
  EPX_CHECK(hidden % 8 == 0, ConfigError, "hidden", hidden,
            "a multiple of 8 (bf16 rows are copied in 16-byte vectors)");
  // Enum fields can hold any integer after a cast; refuse values that have no meaning.
  EPX_CHECK(is_named(kDtypeNames, dtype), ConfigError, "dtype", static_cast<int>(dtype),
            fmt::format("one of {}", list_names(kDtypeNames)));
  EPX_CHECK(is_named(kScaleLayoutNames, scale_layout), ConfigError, "scale_layout",
            static_cast<int>(scale_layout),
            fmt::format("one of {}", list_names(kScaleLayoutNames)));
  EPX_CHECK(is_named(kOutputLayoutNames, layout), ConfigError, "layout", static_cast<int>(layout),
            fmt::format("one of {}", list_names(kOutputLayoutNames)));
  EPX_CHECK(is_named(kCombineModeNames, combine), ConfigError, "combine", static_cast<int>(combine),
            fmt::format("one of {}", list_names(kCombineModeNames)));
  EPX_CHECK(is_named(kCombineFormatNames, combine_format), ConfigError, "combine_format",
            static_cast<int>(combine_format),
            fmt::format("one of {}", list_names(kCombineFormatNames)));
  EPX_CHECK(is_named(kCombineOrderNames, combine_order), ConfigError, "combine_order",
            static_cast<int>(combine_order),
            fmt::format("one of {}", list_names(kCombineOrderNames)));
  // The order follows each token's top-k row, which the token-major rows keep per token.
  EPX_CHECK(combine_order == CombineOrder::kRank || layout == OutputLayout::kTokenMajor,
            ConfigError, "combine_order", to_string(combine_order),
            fmt::format("rank with layout {} (highest_slot is token-major's)", to_string(layout)));
  // Only epx's own quantisation rounds scales; fp8 input keeps the caller's.
  EPX_CHECK(!round_scale || dtype == DispatchDtype::kBF16ToFP8, ConfigError, "round_scale", "true",
            fmt::format("false with dtype {} (only bf16-to-fp8 is quantised by epx)",
                        to_string(dtype)));
  // fp8 rows carry one f32 scale per 1x128 block; a partial block has no defined scale.
  EPX_CHECK(!wire_fp8() || hidden % kFp8BlockSize == 0, ConfigError, "hidden", hidden,
            fmt::format("a multiple of kFp8BlockSize = {} for dtype {}", kFp8BlockSize,
                        to_string(dtype)));
  // A LogFMT row carries one metadata word per block of 128 values; a partial block has none.
  EPX_CHECK(combine_format != CombineFormat::kLogFMT || hidden % logfmt::kBlockValues == 0,
            ConfigError, "combine_format", to_string(combine_format),
            fmt::format("bf16 with hidden = {} (LogFMT rows need hidden a multiple of {})", hidden,
                        logfmt::kBlockValues));
  // Every rank holds at least one expert ...
  EPX_CHECK(num_experts >= world_size, ConfigError, "num_experts", num_experts,
            fmt::format(">= world_size = {}", world_size));
  // ... and the same number of them: expert e lives on rank e / (E / W).
  EPX_CHECK(num_experts % world_size == 0, ConfigError, "num_experts", num_experts,
            fmt::format("a multiple of world_size = {}", world_size));
  // One routing entry per warp lane, and a token's experts are distinct, so K <= E.
  const int max_topk = std::min(kMaxTopk, num_experts);
  EPX_CHECK(topk >= 1 && topk <= max_topk, ConfigError, "topk", topk,
            fmt::format("in [1, min(kMaxTopk = {}, num_experts = {})] = [1, {}]", kMaxTopk,
                        num_experts, max_topk));
  // Buffers are sized for at least one token, and world_size * max_tokens must fit in int32.
  EPX_CHECK(max_tokens_per_rank >= 1 && max_tokens_per_rank <= kMaxTokensPerRank, ConfigError,
            "max_tokens_per_rank", max_tokens_per_rank,
            fmt::format("in [1, kMaxTokensPerRank = {}]", kMaxTokensPerRank));
  // Each round in flight owns a copy of the data areas; the kernels pick one of two.
  EPX_CHECK(rounds_in_flight >= 1 && rounds_in_flight <= kMaxRoundsInFlight, ConfigError,
            "rounds_in_flight", rounds_in_flight,
            fmt::format("in [1, kMaxRoundsInFlight = {}]", kMaxRoundsInFlight));
  // Masking drops a peer's rows from a round that other ranks may still count: ordered rows,
  // whose layout every rank derives from every rank's counts, would disagree.
  EPX_CHECK(!mask_failed_ranks || !deterministic, ConfigError, "mask_failed_ranks", "true",
            "false with deterministic = true (ordered rows need every rank's counts)");
  // Every device wait is bounded (DESIGN §5): 0 would fail at once, and a day is plenty.
  EPX_CHECK(timeout_ms >= 1 && timeout_ms <= kMaxTimeoutMs, ConfigError, "timeout_ms", timeout_ms,
            fmt::format("in [1, kMaxTimeoutMs = {}]", kMaxTimeoutMs));
}

// ---- JSON launch file ----------------------------------------------------------------------

namespace {

using nlohmann::json;

struct LaunchKey {
  const char* name;   // epx's key
  const char* alias;  // the key of the system we descend from, or null
  int max;
  int LaunchConfig::*field;
};

constexpr std::array<LaunchKey, 3> kLaunchKeys{{
    {"num_blocks", "block_num", kMaxBlocks, &LaunchConfig::num_blocks},
    {"warps_per_block", "warp_num_per_block", kMaxWarpsPerBlock, &LaunchConfig::warps_per_block},
    {"ring_rows", nullptr, kMaxRingRows, &LaunchConfig::ring_rows},
}};
constexpr std::array<const char*, 3> kSections{"global", "dispatch", "combine"};

std::string allowed_inner_keys() {
  std::string out;
  for (const auto& k : kLaunchKeys) {
    if (!out.empty()) out += ", ";
    out += k.alias != nullptr ? fmt::format("{} (alias {})", k.name, k.alias) : k.name;
  }
  return out;
}

// Fields left at 0 are "unset" (the file never writes 0: the allowed ranges start at 1).
LaunchConfig parse_section(const json& section, const std::string& section_name,
                           const std::string& origin) {
  if (!section.is_object()) {
    EPX_THROW(ConfigError,
              fmt::format("{}: {} is a JSON {}, expected an object with keys {}", origin,
                          section_name, section.type_name(), allowed_inner_keys()));
  }
  LaunchConfig out;
  for (const auto& key : kLaunchKeys) {
    const bool has_name = section.contains(key.name);
    const bool has_alias = key.alias != nullptr && section.contains(key.alias);
    if (has_name && has_alias) {
      EPX_THROW(ConfigError,
                fmt::format("{}: {}.{} and its alias {}.{} are both set, expected one of them",
                            origin, section_name, key.name, section_name, key.alias));
    }
  }
  for (const auto& item : section.items()) {
    // Plain names, not structured bindings: clang before 16 cannot capture those in a lambda.
    const std::string& name = item.key();
    const json& value = item.value();
    const auto* key = std::find_if(kLaunchKeys.begin(), kLaunchKeys.end(), [&](const auto& k) {
      return name == k.name || (k.alias != nullptr && name == k.alias);
    });
    const std::string path = section_name + "." + name;
    if (key == kLaunchKeys.end()) {
      EPX_THROW(ConfigError, fmt::format("{}: unknown key {}, expected one of {}", origin, path,
                                         allowed_inner_keys()));
    }
    const std::string range = fmt::format("an integer in [1, {}]", key->max);
    if (!value.is_number_integer()) {
      EPX_THROW(ConfigError, fmt::format("{}: {} = {} (a JSON {}), expected {}", origin, path,
                                         value.dump(), value.type_name(), range));
    }
    // Unsigned JSON integers may exceed int64; compare them as unsigned.
    const bool in_range =
        value.is_number_unsigned()
            ? value.get<uint64_t>() >= 1 && value.get<uint64_t>() <= static_cast<uint64_t>(key->max)
            : value.get<int64_t>() >= 1 && value.get<int64_t>() <= key->max;
    if (!in_range) {
      EPX_THROW(ConfigError,
                fmt::format("{}: {} = {}, expected {}", origin, path, value.dump(), range));
    }
    out.*(key->field) = static_cast<int>(value.get<int64_t>());
  }
  return out;
}

// nlohmann::json keeps the last of two equal keys; a tuning file that says the same thing twice
// is a mistake, so the parser callback refuses it.
json parse_strict(const std::string& text, const std::string& origin) {
  // Each open object: the key it is the value of ("" at the top) and the keys seen in it. The
  // dotted path is joined only for the message, so nesting costs memory in proportion to its
  // depth, not to its square.
  struct OpenObject {
    std::string name;
    std::set<std::string> keys;
  };
  std::vector<OpenObject> open;
  std::string last_key;
  auto callback = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
        open.push_back({open.empty() ? std::string() : last_key, {}});
        break;
      case json::parse_event_t::object_end:
        if (!open.empty()) open.pop_back();
        break;
      case json::parse_event_t::key: {
        last_key = parsed.get<std::string>();
        if (!open.empty() && !open.back().keys.insert(last_key).second) {
          std::string path;
          for (const OpenObject& o : open) {
            if (!o.name.empty()) path += o.name + ".";
          }
          EPX_THROW(ConfigError, fmt::format("{}: duplicate key {}{}, expected each key once",
                                             origin, path, last_key));
        }
        break;
      }
      default:
        break;
    }
    return true;
  };
  try {
    return json::parse(text, callback);
  } catch (const json::exception& e) {
    EPX_THROW(ConfigError, fmt::format("{}: invalid JSON ({}), expected an object with keys {}",
                                       origin, e.what(), "global, dispatch, combine"));
  }
}

}  // namespace

LaunchConfigs parse_launch_configs(const std::string& json_text, const std::string& origin) {
  const json doc = parse_strict(json_text, origin);
  if (!doc.is_object()) {
    EPX_THROW(ConfigError,
              fmt::format("{}: top level is a JSON {}, expected an object with keys global, "
                          "dispatch, combine",
                          origin, doc.type_name()));
  }
  for (const auto& [name, value] : doc.items()) {
    if (std::find(kSections.begin(), kSections.end(), name) == kSections.end()) {
      EPX_THROW(ConfigError,
                fmt::format("{}: unknown key {}, expected one of global, dispatch, combine", origin,
                            name));
    }
  }
  auto section = [&](const char* name) {
    return doc.contains(name) ? parse_section(doc.at(name), name, origin) : LaunchConfig{};
  };
  const LaunchConfig global = section("global");
  auto with_fallback = [&](LaunchConfig op) {
    for (const auto& key : kLaunchKeys) {
      if (op.*(key.field) == 0) op.*(key.field) = global.*(key.field);
    }
    return op;
  };
  LaunchConfigs out;
  out.dispatch = with_fallback(section("dispatch"));
  out.combine = with_fallback(section("combine"));
  return out;
}

LaunchConfigs load_launch_configs(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (path.empty()) {
    EPX_THROW(ConfigError, "launch config path is empty, expected a JSON file");
  }
  if (!fs::exists(path, ec)) {
    EPX_THROW(ConfigError,
              fmt::format("launch config file {} does not exist, expected a JSON file", path));
  }
  if (!fs::is_regular_file(path, ec)) {
    EPX_THROW(
        ConfigError,
        fmt::format("launch config path {} is not a regular file, expected a JSON file", path));
  }
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  if (!in.good() && !in.eof()) {
    EPX_THROW(ConfigError, fmt::format("launch config file {} could not be read", path));
  }
  return parse_launch_configs(text.str(), path);
}

std::string to_json(const LaunchConfigs& configs) {
  // Only set fields are written: 0 means "choose", which the file format cannot say.
  auto section = [](const LaunchConfig& c) {
    nlohmann::ordered_json s = nlohmann::ordered_json::object();
    for (const auto& key : kLaunchKeys) {
      if (c.*(key.field) != 0) s[key.name] = c.*(key.field);
    }
    return s;
  };
  nlohmann::ordered_json doc = nlohmann::ordered_json::object();
  doc["dispatch"] = section(configs.dispatch);
  doc["combine"] = section(configs.combine);
  return doc.dump(2) + "\n";
}

}  // namespace epx
