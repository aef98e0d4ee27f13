#pragma once
// Byte layouts of a rank's buffers are carved in order, each area aligned to 256 bytes (the
// alignment of cudaMalloc and of the widest vector access), by every backend's layout function.

#include <cstddef>

namespace epx {

inline constexpr size_t kAreaAlign = 256;

// Returns the offset of an area of `bytes` at `cursor` and moves the cursor past it, aligned.
inline size_t carve(size_t& cursor, size_t bytes) {
  const size_t off = cursor;
  cursor = (cursor + bytes + kAreaAlign - 1) / kAreaAlign * kAreaAlign;
  return off;
}

}  // namespace epx
