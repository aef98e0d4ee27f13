#pragma once
// Parsing of environment variables shared by core and the transports.
#include <cstdint>
#include <string>
#include <string_view>

namespace epx::detail {

// Strict decimal in [lo, hi]: digits only, no sign, no spaces, no suffix, no exponent.
// ConfigError "NAME = "text", expected BOUND".
int parse_env_decimal(std::string_view name, std::string_view text, uint64_t lo, uint64_t hi,
                      const std::string& bound);

}  // namespace epx::detail
