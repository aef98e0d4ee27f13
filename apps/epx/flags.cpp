#include "flags.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <set>
#include <sstream>
#include <utility>

#include "epx/bootstrap.hpp"
#include "epx/error.hpp"

namespace epx::cli {

// ---- values ------------------------------------------------------------------------------------

void check_range(const char* flag, int64_t value, int64_t lo, int64_t hi, const std::string& why) {
  if (value >= lo && value <= hi) return;
  std::string bound =
      hi == INT64_MAX ? fmt::format("at least {}", lo) : fmt::format("in [{}, {}]", lo, hi);
  if (!why.empty()) bound += " (" + why + ")";
  EPX_THROW(ConfigError, fmt::format("{} = {}, expected {}", flag, value, bound));
}

std::vector<std::string> split_list(const std::string& text, const char* flag) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) {
      EPX_THROW(ConfigError,
                fmt::format("{} = '{}' has an empty item, expected a comma list", flag, text));
    }
    out.push_back(item);
  }
  if (out.empty() || text.back() == ',') {
    EPX_THROW(ConfigError, fmt::format("{} = '{}', expected a non-empty comma list", flag, text));
  }
  return out;
}

std::vector<int> parse_int_list(const std::string& text, const char* flag, int lo, int hi,
                                const std::string& why, Repeats repeats) {
  std::vector<int> out;
  std::set<int> seen;
  for (const std::string& item : split_list(text, flag)) {
    size_t pos = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &pos);
    } catch (const std::exception&) {
      pos = 0;
    }
    if (pos != item.size()) {
      EPX_THROW(ConfigError,
                fmt::format("{}: '{}' is not an integer, expected integers in [{}, {}]", flag, item,
                            lo, hi));
    }
    check_range(flag, v, lo, hi, why);
    if (repeats == Repeats::kRefused && !seen.insert(int(v)).second) {
      EPX_THROW(ConfigError,
                fmt::format("{} = '{}' lists {} twice, expected each value once", flag, text, v));
    }
    out.push_back(int(v));
  }
  return out;
}

std::vector<int> parse_token_counts(const std::string& text, const char* flag) {
  return parse_int_list(text, flag, 0, kMaxTokensPerRank, "tokens of one rank", Repeats::kAllowed);
}

std::vector<int> tokens_per_rank(const std::vector<int>& counts, int world, const char* flag,
                                 const std::string& text) {
  if (counts.size() == 1) return std::vector<int>(size_t(std::max(world, 0)), counts[0]);
  if (int(counts.size()) == world) return counts;
  EPX_THROW(ConfigError, fmt::format("{} = '{}' has {} counts, expected one count or {} (one per "
                                     "rank of --world)",
                                     flag, text, counts.size(), world));
}

ref::RoutingKind parse_routing_flag(const std::string& name) {
  if (name == "uniform") return ref::RoutingKind::kUniform;
  if (name == "skew") return ref::RoutingKind::kSkewed;
  if (name == "one-expert") return ref::RoutingKind::kOneExpert;
  if (name == "masked") return ref::RoutingKind::kMasked;
  EPX_THROW(
      ConfigError,
      fmt::format("--routing = '{}', expected one of uniform, skew, one-expert, masked", name));
}

namespace {

bool is_word_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_';
}

// `message` with every whole word that is a key of `names` replaced by its value, in one pass
// (a replacement is never matched again).
std::string replace_words(const std::string& message,
                          const std::vector<std::pair<std::string, std::string>>& names) {
  std::string out;
  size_t i = 0;
  while (i < message.size()) {
    if (!is_word_char(message[i])) {
      out += message[i++];
      continue;
    }
    size_t j = i;
    while (j < message.size() && is_word_char(message[j])) ++j;
    const std::string word = message.substr(i, j - i);
    const auto it =
        std::find_if(names.begin(), names.end(), [&](const auto& n) { return n.first == word; });
    out += it == names.end() ? word : it->second;
    i = j;
  }
  return out;
}

// parse(name), its ConfigError ("<field> = ...") rethrown as "<flag> = ...".
template <typename Parse>
auto parse_as_flag(Parse parse, const std::string& name, const char* field, const char* flag) {
  try {
    return parse(name);
  } catch (const ConfigError& e) {
    throw ConfigError(replace_words(e.what(), {{field, flag}}));
  }
}

}  // namespace

std::string in_flag_names(const std::string& message, const char* max_tokens_flag) {
  return replace_words(message, {{"world_size", "--world"},
                                 {"hidden", "--hidden"},
                                 {"num_experts", "--experts"},
                                 {"topk", "--topk"},
                                 {"max_tokens_per_rank", max_tokens_flag},
                                 {"dtype", "--dtype"},
                                 {"layout", "--layout"},
                                 {"scale_layout", "--scale-layout"},
                                 {"round_scale", "--round-scale"},
                                 {"combine", "--combine"},
                                 {"combine_format", "--combine-format"},
                                 {"combine_order", "--combine-order"},
                                 {"timeout_ms", "--timeout-ms"}});
}

Backend parse_backend_flag(const std::string& name, const char* flag) {
  return parse_as_flag(parse_backend, name, "backend", flag);
}

std::vector<Backend> parse_backend_list(const std::string& text, const char* flag) {
  std::vector<Backend> out;
  for (const std::string& name : split_list(text, flag)) {
    const Backend b = parse_backend_flag(name, flag);
    if (std::find(out.begin(), out.end(), b) != out.end()) {
      EPX_THROW(ConfigError, fmt::format("{} = '{}' lists {} twice, expected each backend once",
                                         flag, text, name));
    }
    out.push_back(b);
  }
  return out;
}

Backend backend_or_env(const std::string& name, const char* flag) {
  if (!name.empty()) return parse_backend_flag(name, flag);
  return read_env().backend.value_or(Backend::kLowLatency);
}

DispatchDtype parse_dtype_flag(const std::string& name) {
  return parse_as_flag(parse_dispatch_dtype, name, "dtype", "--dtype");
}

OutputLayout parse_layout_flag(const std::string& name) {
  return parse_as_flag(parse_output_layout, name, "layout", "--layout");
}

ScaleLayout parse_scale_layout_flag(const std::string& name) {
  return parse_as_flag(parse_scale_layout, name, "scale_layout", "--scale-layout");
}

std::vector<CombineFormat> parse_combine_format_list(const std::string& text, const char* flag) {
  std::vector<CombineFormat> out;
  for (const std::string& name : split_list(text, flag)) {
    const CombineFormat f = parse_as_flag(parse_combine_format, name, "combine_format", flag);
    if (std::find(out.begin(), out.end(), f) != out.end()) {
      EPX_THROW(ConfigError, fmt::format("{} = '{}' lists {} twice, expected each format once",
                                         flag, text, name));
    }
    out.push_back(f);
  }
  return out;
}

WorldKind parse_world_kind(const std::string& name) {
  for (WorldKind k : {WorldKind::kInProcess, WorldKind::kIpc, WorldKind::kNccl})
    if (name == to_string(k)) return k;
  EPX_THROW(ConfigError,
            fmt::format("--world-kind = '{}', expected one of in-process, ipc, nccl", name));
}

const char* to_string(WorldKind kind) {
  switch (kind) {
    case WorldKind::kInProcess:
      return "in-process";
    case WorldKind::kIpc:
      return "ipc";
    case WorldKind::kNccl:
      return "nccl";
  }
  return "invalid";
}

// ---- shape ------------------------------------------------------------------------------------

EpConfig ShapeFlags::config(int tokens, const char* tokens_flag) const {
  EpConfig cfg;
  cfg.world_size = world;
  cfg.hidden = hidden;
  cfg.num_experts = experts;
  cfg.topk = topk;
  const bool max_given = max_tokens != 0;
  cfg.max_tokens_per_rank = max_given ? max_tokens : tokens;
  cfg.dtype = parse_dtype_flag(dtype);
  cfg.layout = parse_layout_flag(layout);
  cfg.scale_layout = parse_scale_layout_flag(scale_layout);
  cfg.round_scale = round_scale;
  cfg.deterministic = deterministic;
  cfg.rounds_in_flight = rounds_in_flight;
  cfg.worst_case_output = worst_case_output;
  cfg.combine = parse_as_flag(parse_combine_mode, combine, "combine", "--combine");
  cfg.combine_format =
      parse_as_flag(parse_combine_format, combine_format, "combine_format", "--combine-format");
  cfg.combine_order =
      parse_as_flag(parse_combine_order, combine_order, "combine_order", "--combine-order");
  const EnvSettings env = read_env();  // throws ConfigError naming the variable
  if (env.timeout_ms) cfg.timeout_ms = *env.timeout_ms;
  if (timeout_ms != 0) cfg.timeout_ms = timeout_ms;
  try {
    cfg.validate();
  } catch (const ConfigError& e) {
    throw ConfigError(in_flag_names(e.what(), max_given ? "--max-tokens" : tokens_flag));
  }
  return cfg;
}

std::vector<int> ShapeFlags::devices() const {
  check_range("--gpus", gpus, 1, std::max(world, 1), "at most one GPU per rank of --world");
  std::vector<int> out;
  for (int g = 0; g < gpus; ++g) out.push_back(g);
  return out;
}

void add_shape_flags(CLI::App* c, ShapeFlags& f, MaxTokensFlag max_tokens) {
  c->add_option("--world", f.world, "ranks of the world")->capture_default_str();
  c->add_option("--gpus", f.gpus,
                "in-process: spread the ranks round-robin over GPUs 0..N-1 (peer access between "
                "them; each rank's SM budget is its GPU's SMs / the ranks on that GPU)")
      ->capture_default_str();
  c->add_option("--hidden", f.hidden, "hidden size H")->capture_default_str();
  c->add_option("--experts", f.experts, "global experts E")->capture_default_str();
  c->add_option("--topk", f.topk, "experts per token K")->capture_default_str();
  if (max_tokens == MaxTokensFlag::kOffered) {
    c->add_option("--max-tokens", f.max_tokens,
                  "max tokens per rank (default: the largest --tokens value)");
  }
  c->add_option("--dtype", f.dtype, "bf16 | fp8 | bf16-to-fp8 (bf16 in, fp8 on the wire)")
      ->capture_default_str();
  c->add_option("--layout", f.layout, "token | expert (dispatch output layout)")
      ->capture_default_str();
  c->add_option("--scale-layout", f.scale_layout, "row | column (received fp8 scales)")
      ->capture_default_str();
  c->add_flag("--round-scale", f.round_scale,
              "bf16-to-fp8: each 1x128 block's scale a power of two (DeepEP's round_scale)");
  c->add_flag("--deterministic", f.deterministic,
              "token-major rows in (source rank, source index) order on every call (the ranks "
              "exchange counts before any row moves)");
  c->add_option("--rounds-in-flight", f.rounds_in_flight,
                "1 | 2: dispatches whose combine may still be due (2: the next round's dispatch "
                "before this round's combine; `epx check` then runs two rounds interleaved)")
      ->capture_default_str();
  c->add_flag("--worst-case-output", f.worst_case_output,
              "high_throughput: receive areas for world x max tokens rows, so that dispatch never "
              "reads a count back on the host (CUDA graphs); default: sized per call");
  c->add_option("--combine", f.combine,
                "auto | pull | push: how combine moves the partials (low_latency, "
                "allgather_reducescatter); auto pulls when every rank is on one GPU")
      ->capture_default_str();
  c->add_option("--combine-format", f.combine_format,
                "bf16 | logfmt: what the partials cross as in combine (logfmt: LogFMT-10 rows, "
                "about 0.64 of the bytes, DeepEP's use_logfmt; low_latency only, --hidden a "
                "multiple of 128)")
      ->capture_default_str();
  c->add_option("--combine-order", f.combine_order,
                "rank | highest_slot: the order of combine's f32 sum (highest_slot: each rank at "
                "its highest top-k slot of the token, DeepEP V2's order; high_throughput only)")
      ->capture_default_str();
  c->add_option("--timeout-ms", f.timeout_ms,
                "bound of every device wait (default EPX_TIMEOUT_MS or 10000)");
}

void take_world_from_env(ShapeFlags& f, bool world_given, const char* command) {
  const BootstrapOptions env = BootstrapOptions::from_env();  // throws naming the variable
  EPX_CHECK(!world_given || f.world == env.world_size, ConfigError, "--world", f.world,
            fmt::format("EPX_WORLD_SIZE = {} with one process per rank (run `epx launch -n {} -- "
                        "{} --world-kind ipc ...`, or leave --world out)",
                        env.world_size, f.world, command));
  f.world = env.world_size;
}

// ---- token sweeps ----------------------------------------------------------------------------

void add_sweep_flags(CLI::App* c, SweepFlags& f) {
  add_shape_flags(c, f.shape, MaxTokensFlag::kNotOffered);
  c->add_option("--tokens", f.tokens,
                "tokens per rank, comma list; each is measured with its own group "
                "(max_tokens_per_rank = that count)")
      ->capture_default_str();
  c->add_option("--routing", f.routing, kRoutingNames)->capture_default_str();
  c->add_option("--seed", f.seed, "seed of inputs and routing")->capture_default_str();
}

Sweep make_sweep(const SweepFlags& f) {
  Sweep s;
  s.tokens = parse_int_list(f.tokens, "--tokens", 1, kMaxTokensPerRank,
                            "max_tokens_per_rank of its group");
  for (int t : s.tokens) (void)f.shape.config(t);  // every group's config, named by the flags
  s.cfg = f.shape.config(*std::max_element(s.tokens.begin(), s.tokens.end()));
  s.devices = f.shape.devices();
  s.routing = parse_routing_flag(f.routing);
  s.routing_name = f.routing;
  s.seed = f.seed;
  return s;
}

EpConfig Sweep::config_for(int t) const {
  EpConfig c = cfg;
  c.max_tokens_per_rank = t;
  return c;
}

// ---- environment -------------------------------------------------------------------------------

LaunchSource launch_from_env() {
  const EnvSettings env = read_env();
  if (!env.config_path) return {LaunchConfigs{}, "backend defaults", false};
  return {load_launch_configs(*env.config_path), "EPX_CONFIG_PATH=" + *env.config_path, true};
}

}  // namespace epx::cli
