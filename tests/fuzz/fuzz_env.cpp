// The environment (core/env.hpp): every variable's parser on any value, set or unset. Fields of
// the input (NUL-separated, "\x7f" = unset), in order: EPX_BACKEND, EPX_TIMEOUT_MS,
// EPX_CONFIG_PATH, CUDA_DEVICE_MAX_CONNECTIONS, EPX_RANK, EPX_WORLD_SIZE, EPX_BOOTSTRAP,
// EPX_NCCL_LIBRARY. A parser may refuse a value only with ConfigError, and what it accepts must
// satisfy the bounds its contract states. The same fields also serve as the start-up
// fingerprints of a job's ranks (check_fingerprints), texts that come from peers.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/env.hpp"
#include "epx/bootstrap.hpp"
#include "epx/config.hpp"
#include "epx/error.hpp"
#include "fuzz_input.hpp"
#include "transport/bootstrap_address.hpp"

namespace {

using epx::ConfigError;
using epx::fuzz::refuses_only_with;
using epx::fuzz::require;

enum Field { kBackend, kTimeout, kConfigPath, kMaxConnections, kRank, kWorldSize, kAddress, kNccl };

void settings(const epx::fuzz::Fields& f) {
  epx::EnvSettings s;
  if (!refuses_only_with<ConfigError>("parse_env", [&] {
        s = epx::parse_env(f.c_str(kBackend), f.c_str(kTimeout), f.c_str(kConfigPath));
      })) {
    return;
  }
  require(s.backend.has_value() == (f.c_str(kBackend) != nullptr), "EPX_BACKEND lost or invented");
  if (s.backend) {
    require(epx::parse_backend(epx::to_string(*s.backend)) == *s.backend,
            "EPX_BACKEND's value has no name");
  }
  if (s.timeout_ms) {
    require(*s.timeout_ms >= 1 && *s.timeout_ms <= epx::kMaxTimeoutMs,
            "EPX_TIMEOUT_MS accepted out of range: " + std::to_string(*s.timeout_ms));
    require(std::to_string(*s.timeout_ms).size() <= f.text(kTimeout).size(),
            "EPX_TIMEOUT_MS read more digits than it was given");
  }
  if (s.config_path) require(!s.config_path->empty(), "EPX_CONFIG_PATH accepted empty");
}

void hardware_queues(const epx::fuzz::Fields& f) {
  int queues = 0;
  if (!refuses_only_with<ConfigError>("hardware_queues_per_gpu", [&] {
        queues = epx::hardware_queues_per_gpu(f.c_str(kMaxConnections));
      })) {
    return;
  }
  require(queues >= 1 && queues <= 32,
          "CUDA_DEVICE_MAX_CONNECTIONS accepted out of 1..32: " + std::to_string(queues));
}

// A valid address resolves to a socket address that fits its storage (ASan watches the copy). A
// tcp:// host name is looked up only here, not by validation, so a name that does not resolve is
// refused then, and only with ConfigError.
void check_resolve(const std::string& address) {
  epx::transport::SocketAddress s{};
  if (!refuses_only_with<ConfigError>("resolve", [&] { s = epx::transport::resolve(address); })) {
    require(epx::transport::is_tcp_address(address), "resolve refused a valid socket path");
    return;
  }
  require(s.len <= sizeof(s.addr), "socket address longer than its storage");
}

void bootstrap(const epx::fuzz::Fields& f) {
  epx::BootstrapOptions o;
  if (!refuses_only_with<ConfigError>("BootstrapOptions::parse_env", [&] {
        o = epx::BootstrapOptions::parse_env(f.c_str(kRank), f.c_str(kWorldSize), f.c_str(kAddress),
                                             f.c_str(kTimeout));
      })) {
    return;
  }
  // What the environment gives must be options the bootstrap accepts.
  const bool valid =
      refuses_only_with<ConfigError>("BootstrapOptions::validate", [&] { o.validate(); });
  require(valid, "BootstrapOptions::parse_env accepted options that validate() refuses");
  if (!o.address.empty()) check_resolve(o.address);
}

void any_address(const epx::fuzz::Fields& f) {
  // Any text as an address of a world of 1 or 2 ranks: refused by name, or resolvable.
  for (int world : {1, 2}) {
    const std::string& a = f.text(kAddress);
    if (refuses_only_with<ConfigError>(
            "validate_address", [&] { epx::transport::validate_address("address", a, world); }) &&
        !a.empty()) {
      check_resolve(a);
    }
  }
}

void decimals(const epx::fuzz::Fields& f) {
  for (size_t i = 0; i < f.size() && i < 8; ++i) {
    const std::string& t = f.text(i);
    int v = -1;
    if (refuses_only_with<ConfigError>("parse_decimal", [&] {
          v = epx::env::parse_decimal("FIELD", t, 0, 1000, "a decimal integer in [0, 1000]");
        })) {
      require(v >= 0 && v <= 1000, "parse_decimal accepted out of range: " + std::to_string(v));
      require(std::to_string(v).size() <= t.size(), "parse_decimal invented digits");
    }
  }
  const std::string lib = epx::env::parse_nccl_library(f.c_str(kNccl));
  require(!lib.empty(), "EPX_NCCL_LIBRARY gave an empty library name");
}

// The start-up agreement on texts that peers sent: the fields as the fingerprints of the ranks
// of one job (one rank per field, at most 8). Ranks agree when their texts hold the same
// "key=value" lines, whatever the order of the keys and the empty lines; otherwise every rank
// throws ConfigError, and nothing else.
std::map<std::string, std::vector<std::string>> lines_by_key(const std::string& text) {
  std::map<std::string, std::vector<std::string>> out;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(start, end - start);
    start = end + 1;
    if (line.empty()) continue;
    const size_t eq = line.find('=');
    out[line.substr(0, eq)].push_back(eq == std::string::npos ? "" : line.substr(eq + 1));
  }
  return out;
}

void fingerprints(const epx::fuzz::Fields& f) {
  const int ranks = int(std::min<size_t>(f.size(), 8));
  std::vector<std::string> texts;
  for (int r = 0; r < ranks; ++r) texts.push_back(f.text(size_t(r)));
  const auto first = lines_by_key(texts[0]);
  const bool same = std::all_of(texts.begin(), texts.end(),
                                [&](const std::string& t) { return lines_by_key(t) == first; });
  for (int r = 0; r < ranks; ++r) {
    epx::CallbackBootstrap b(r, ranks, [&](const std::string&) { return texts; });
    const bool agreed = refuses_only_with<ConfigError>(
        "check_fingerprints", [&] { epx::check_fingerprints(b, texts[size_t(r)]); });
    require(agreed == same, agreed ? "check_fingerprints passed ranks that differ"
                                   : "check_fingerprints refused ranks that agree");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const epx::fuzz::Fields f(data, size);
  settings(f);
  hardware_queues(f);
  bootstrap(f);
  any_address(f);
  decimals(f);
  fingerprints(f);
  return 0;
}
