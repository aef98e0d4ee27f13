// The JSON launch file (DESIGN §6): parse_launch_configs on any text. It may refuse the text
// only with ConfigError; what it accepts is in range, and writes back (to_json) as a file that
// reads to the same launch shapes.

#include <cstddef>
#include <cstdint>
#include <string>

#include "epx/config.hpp"
#include "epx/error.hpp"
#include "fuzz_input.hpp"

namespace {

using epx::fuzz::require;

void require_in_range(const epx::LaunchConfig& c, const char* op) {
  // 0 = unset (the backend chooses), anything else within the file format's ranges.
  require(c.num_blocks >= 0 && c.num_blocks <= epx::kMaxBlocks,
          std::string(op) + ".num_blocks out of range: " + std::to_string(c.num_blocks));
  require(c.warps_per_block >= 0 && c.warps_per_block <= epx::kMaxWarpsPerBlock,
          std::string(op) + ".warps_per_block out of range: " + std::to_string(c.warps_per_block));
}

bool same(const epx::LaunchConfig& a, const epx::LaunchConfig& b) {
  return a.num_blocks == b.num_blocks && a.warps_per_block == b.warps_per_block;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  epx::LaunchConfigs parsed;
  const bool accepted = epx::fuzz::refuses_only_with<epx::ConfigError>(
      "parse_launch_configs", [&] { parsed = epx::parse_launch_configs(text, "fuzz.json"); });
  if (!accepted) return 0;
  require_in_range(parsed.dispatch, "dispatch");
  require_in_range(parsed.combine, "combine");
  const std::string written = epx::to_json(parsed);
  epx::LaunchConfigs again;
  const bool reread = epx::fuzz::refuses_only_with<epx::ConfigError>(
      "parse_launch_configs(to_json(...))",
      [&] { again = epx::parse_launch_configs(written, "to_json"); });
  require(reread, "to_json wrote a file that does not parse:\n" + written);
  require(same(again.dispatch, parsed.dispatch) && same(again.combine, parsed.combine),
          "to_json does not round-trip:\n" + written);
  return 0;
}
