// The process environment (core/env.hpp) and the public entry points built on it.

#include "core/env.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <climits>
#include <cstdlib>
#include <system_error>

#include "epx/error.hpp"

namespace epx {
namespace env {
namespace {

// The one place that looks at the process environment.
const char* raw(const char* name) { return std::getenv(name); }

}  // namespace

// ---- parsers --------------------------------------------------------------------------------

int parse_decimal(std::string_view name, std::string_view text, uint64_t lo, uint64_t hi,
                  const std::string& bound) {
  EPX_CHECK(lo <= hi && hi <= uint64_t(INT_MAX), InputError, "hi", hi, "in [lo, INT_MAX]");
  const bool digits_only = !text.empty() && std::all_of(text.begin(), text.end(), [](char c) {
    return std::isdigit(static_cast<unsigned char>(c)) != 0;
  });
  uint64_t value = 0;
  const auto [end, err] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (!digits_only || err != std::errc() || end != text.data() + text.size() || value < lo ||
      value > hi) {
    EPX_THROW(ConfigError, fmt::format("{} = \"{}\", expected {}", name, text, bound));
  }
  return static_cast<int>(value);
}

int parse_timeout_ms(std::string_view name, std::string_view text) {
  return parse_decimal(name, text, 1, static_cast<uint64_t>(kMaxTimeoutMs),
                       fmt::format("a decimal integer in [1, {}]", kMaxTimeoutMs));
}

BootstrapOptions parse_bootstrap(const char* rank, const char* world_size, const char* address,
                                 const char* timeout_ms) {
  BootstrapOptions o;
  if (timeout_ms != nullptr) o.timeout_ms = parse_timeout_ms("EPX_TIMEOUT_MS", timeout_ms);
  if (rank != nullptr && world_size == nullptr) {
    EPX_THROW(ConfigError, fmt::format("EPX_RANK = \"{}\" is set but EPX_WORLD_SIZE is not, "
                                       "expected both (or neither, for a single rank)",
                                       rank));
  }
  if (rank == nullptr && world_size != nullptr) {
    EPX_THROW(ConfigError, fmt::format("EPX_WORLD_SIZE = \"{}\" is set but EPX_RANK is not, "
                                       "expected both (or neither, for a single rank)",
                                       world_size));
  }
  if (world_size != nullptr) {
    o.world_size = parse_decimal("EPX_WORLD_SIZE", world_size, 1, kMaxRanks,
                                 fmt::format("a decimal integer in [1, {}]", kMaxRanks));
    o.rank = parse_decimal(
        "EPX_RANK", rank, 0, uint64_t(o.world_size - 1),
        fmt::format("a decimal integer in [0, EPX_WORLD_SIZE = {})", o.world_size));
  }
  if (address != nullptr) {
    o.address = address;
    if (o.address.empty()) {
      EPX_THROW(ConfigError, "EPX_BOOTSTRAP = \"\", expected \"@name\" or a socket file path "
                             "(or tcp://HOST:PORT)");
    }
  }
  if (o.world_size > 1 && o.address.empty()) {
    EPX_THROW(ConfigError,
              fmt::format("EPX_BOOTSTRAP is not set, expected the socket address that all "
                          "EPX_WORLD_SIZE = {} ranks share (\"@name\" or a socket file path; "
                          "`epx launch` sets it; tcp://HOST:PORT across hosts)",
                          o.world_size));
  }
  return o;
}

std::string parse_nccl_library(const char* text) {
  return text != nullptr && *text != '\0' ? std::string(text) : std::string("libnccl.so.2");
}

// ---- getters --------------------------------------------------------------------------------

EnvSettings settings() {
  return parse_env(raw("EPX_BACKEND"), raw("EPX_TIMEOUT_MS"), raw("EPX_CONFIG_PATH"));
}

int timeout_ms() {
  const char* text = raw("EPX_TIMEOUT_MS");
  return text != nullptr ? parse_timeout_ms("EPX_TIMEOUT_MS", text) : EpConfig{}.timeout_ms;
}

BootstrapOptions bootstrap() {
  return parse_bootstrap(raw("EPX_RANK"), raw("EPX_WORLD_SIZE"), raw("EPX_BOOTSTRAP"),
                         raw("EPX_TIMEOUT_MS"));
}

std::string nccl_library() { return parse_nccl_library(raw("EPX_NCCL_LIBRARY")); }

std::string ablate_text() {
  const char* v = raw("EPX_ABLATE");
  return v == nullptr ? std::string() : std::string(v);
}

std::string phase_clock_text() {
  const char* v = raw("EPX_PHASE_CLOCK");
  return v == nullptr ? std::string() : std::string(v);
}

int hardware_queues_per_gpu() {
  return ::epx::hardware_queues_per_gpu(raw("CUDA_DEVICE_MAX_CONNECTIONS"));
}

}  // namespace env

// ---- public entry points (epx/config.hpp) -----------------------------------------------------

EnvSettings parse_env(const char* backend, const char* timeout_ms, const char* config_path) {
  EnvSettings out;
  if (backend != nullptr) out.backend = detail::parse_backend_as("EPX_BACKEND", backend);
  if (timeout_ms != nullptr) out.timeout_ms = env::parse_timeout_ms("EPX_TIMEOUT_MS", timeout_ms);
  if (config_path != nullptr) {
    if (*config_path == '\0') {
      EPX_THROW(ConfigError, "EPX_CONFIG_PATH = \"\", expected the path of a JSON launch file");
    }
    out.config_path = std::string(config_path);
  }
  return out;
}

EnvSettings read_env() { return env::settings(); }

int hardware_queues_per_gpu(const char* max_connections) {
  if (max_connections == nullptr) return 8;  // CUDA's default
  return env::parse_decimal("CUDA_DEVICE_MAX_CONNECTIONS", max_connections, 1, 32,
                            "an integer in 1..32");
}

}  // namespace epx
