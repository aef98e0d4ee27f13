// LogFMT-10 rows on the CPU: the codec of src/core/logfmt.hpp (the kernels' own functions,
// compiled as plain C++), with the checks a host entry point owes its caller.

#include "core/logfmt.hpp"

#include <cstring>
#include <string>
#include <vector>

#include "epx/error.hpp"
#include "reference/reference.hpp"

namespace epx::ref {
namespace {

void check_hidden(int hidden) {
  EPX_CHECK(hidden > 0 && hidden % logfmt::kBlockValues == 0, InputError, "hidden (LogFMT)", hidden,
            "a positive multiple of 128");
}

}  // namespace

void logfmt_encode(const uint16_t* x, int rows, int hidden, uint8_t* out) {
  check_hidden(hidden);
  const auto stride = static_cast<size_t>(logfmt::row_stride(hidden));
  const auto bytes = static_cast<size_t>(logfmt::row_bytes(hidden));
  for (int i = 0; i < rows; ++i) {
    uint8_t* row = out + static_cast<size_t>(i) * stride;
    logfmt::encode_row(x + static_cast<size_t>(i) * hidden, hidden, row);
    std::memset(row + bytes, 0, stride - bytes);
  }
}

void logfmt_decode(const uint8_t* in, int rows, int hidden, float* out) {
  check_hidden(hidden);
  const auto stride = static_cast<size_t>(logfmt::row_stride(hidden));
  for (int i = 0; i < rows; ++i)
    logfmt::decode_row(in + static_cast<size_t>(i) * stride, hidden,
                       out + static_cast<size_t>(i) * hidden);
}

void logfmt_round_trip_row(const uint16_t* x, int hidden, float* out) {
  check_hidden(hidden);
  std::vector<uint8_t> row(static_cast<size_t>(logfmt::row_bytes(hidden)));
  logfmt::encode_row(x, hidden, row.data());
  logfmt::decode_row(row.data(), hidden, out);
}

std::vector<float> logfmt_round_trip(const uint16_t* x, int rows, int hidden) {
  check_hidden(hidden);
  std::vector<uint8_t> wire(static_cast<size_t>(rows) *
                            static_cast<size_t>(logfmt::row_stride(hidden)));
  std::vector<float> out(static_cast<size_t>(rows) * static_cast<size_t>(hidden));
  logfmt_encode(x, rows, hidden, wire.data());
  logfmt_decode(wire.data(), rows, hidden, out.data());
  return out;
}

}  // namespace epx::ref
