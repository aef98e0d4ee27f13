#pragma once
// What the fuzz targets share: the input cut into fields, and the one rule they all check — a
// parser of user text may refuse it only with the error its contract names; anything else it
// throws, and every crash, sanitizer report or broken invariant, is a finding.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace epx::fuzz {

// The input as fields separated by NUL bytes (environment values and argv strings cannot hold
// one). A field that is exactly "\x7f" stands for "unset" (a null pointer).
class Fields {
 public:
  Fields(const uint8_t* data, size_t size) {
    const std::string_view all(reinterpret_cast<const char*>(data), size);
    size_t start = 0;
    for (;;) {
      const size_t end = all.find('\0', start);
      fields_.emplace_back(all.substr(start, end == std::string_view::npos ? end : end - start));
      if (end == std::string_view::npos) break;
      start = end + 1;
    }
  }

  size_t size() const { return fields_.size(); }
  // Field i, or "" past the end.
  const std::string& text(size_t i) const { return i < fields_.size() ? fields_[i] : empty_; }
  // Field i as a C string, nullptr for "\x7f" or past the end.
  const char* c_str(size_t i) const {
    if (i >= fields_.size() || fields_[i] == kUnset) return nullptr;
    return fields_[i].c_str();
  }

  static constexpr std::string_view kUnset = "\x7f";

 private:
  std::vector<std::string> fields_;
  std::string empty_;
};

// Stops the run with a message: libFuzzer saves the input that got here.
[[noreturn]] inline void finding(const std::string& what) {
  std::fprintf(stderr, "epx fuzz finding: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

inline void require(bool ok, const std::string& what) {
  if (!ok) finding(what);
}

// Runs fn; Allowed is the only exception it may throw. Returns whether it returned normally.
template <typename Allowed, typename Fn>
bool refuses_only_with(const char* what, Fn&& fn) {
  try {
    fn();
    return true;
  } catch (const Allowed&) {
    return false;
  } catch (const std::exception& e) {
    finding(std::string(what) + " threw an unexpected exception: " + e.what());
  } catch (...) {
    finding(std::string(what) + " threw something that is not a std::exception");
  }
}

}  // namespace epx::fuzz
