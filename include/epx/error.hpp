#pragma once
// epx::Error hierarchy and the check macros used by every host-side file.
//
// Library code never calls exit() or abort(): every failure becomes an exception derived from
// epx::Error carrying an ErrorCode, a message that names the argument, the value and the bound,
// and the file and line that raised it.

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

namespace epx {

enum class ErrorCode : int {
  kOk = 0,
  kConfig = 1,     // an EpConfig / LaunchConfig / environment value is impossible
  kInput = 2,      // a call's arguments (shapes, pointers, expert ids) are wrong
  kTimeout = 3,    // a bounded device wait expired
  kPeer = 4,       // a peer rank failed or disagreed
  kCuda = 5,       // a CUDA runtime/driver call failed
  kState = 6,      // the object refuses calls (earlier error, or misuse of the call order)
  kUnsupported = 7 // valid request that this build or machine cannot serve (e.g. no GPU)
};

const char* to_string(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& what) : std::runtime_error(what), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

class ConfigError : public Error {
 public:
  explicit ConfigError(const std::string& w) : Error(ErrorCode::kConfig, w) {}
};
class InputError : public Error {
 public:
  explicit InputError(const std::string& w) : Error(ErrorCode::kInput, w) {}
};
class TimeoutError : public Error {
 public:
  explicit TimeoutError(const std::string& w) : Error(ErrorCode::kTimeout, w) {}
};
class PeerError : public Error {
 public:
  explicit PeerError(const std::string& w) : Error(ErrorCode::kPeer, w) {}
};
class CudaError : public Error {
 public:
  explicit CudaError(const std::string& w) : Error(ErrorCode::kCuda, w) {}
};
class StateError : public Error {
 public:
  explicit StateError(const std::string& w) : Error(ErrorCode::kState, w) {}
};
class UnsupportedError : public Error {
 public:
  explicit UnsupportedError(const std::string& w) : Error(ErrorCode::kUnsupported, w) {}
};

namespace detail {
// Formats "<what>: <message> (file:line)". Kept out of line so the macros stay small.
std::string located(const std::string& message, const char* file, int line);

template <typename T>
std::string str(const T& v) {
  std::ostringstream os;
  os << v;
  return os.str();
}
}  // namespace detail

}  // namespace epx

// EPX_CHECK(cond, ErrorType, "name", value, "bound text"): throws ErrorType with
// "name = value, expected <bound text>" when cond is false.
#define EPX_CHECK(cond, ErrorType, name, value, bound)                                      \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      throw ErrorType(::epx::detail::located(std::string(name) + " = " +                   \
                                                 ::epx::detail::str(value) + ", expected " + \
                                                 (bound),                                   \
                                             __FILE__, __LINE__));                          \
    }                                                                                       \
  } while (0)

// EPX_THROW(ErrorType, message-expression)
#define EPX_THROW(ErrorType, msg) \
  throw ErrorType(::epx::detail::located((msg), __FILE__, __LINE__))
