#include "epx/error.hpp"

#include <string_view>

namespace epx {

const char* to_string(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk:
      return "ok";
    case ErrorCode::kConfig:
      return "config";
    case ErrorCode::kInput:
      return "input";
    case ErrorCode::kTimeout:
      return "timeout";
    case ErrorCode::kPeer:
      return "peer";
    case ErrorCode::kCuda:
      return "cuda";
    case ErrorCode::kState:
      return "state";
    case ErrorCode::kUnsupported:
      return "unsupported";
  }
  return "unknown";
}

namespace detail {

std::string located(const std::string& message, const char* file, int line) {
  // Only the file name: build directories differ between machines, the name is what a reader
  // greps for.
  std::string_view path = file != nullptr ? file : "?";
  const auto slash = path.find_last_of("/\\");
  if (slash != std::string_view::npos) path.remove_prefix(slash + 1);
  std::string out = message;
  out += " (";
  out += path;
  out += ':';
  out += std::to_string(line);
  out += ')';
  return out;
}

}  // namespace detail
}  // namespace epx
