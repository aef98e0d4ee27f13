#pragma once
// The wire of SocketBootstrap: framed messages on a stream socket, file descriptors passed
// with them, and the payloads that are more than bytes (a rank's introduction, an error).
//
// Every message is a frame {type, sequence number, payload length} + payload, with file
// descriptors (SCM_RIGHTS) attached to the frame's first bytes. Sockets stay blocking; every read
// and write is MSG_DONTWAIT + poll() against a deadline, so no call can wait past it, and
// MSG_NOSIGNAL keeps a dead peer from raising SIGPIPE. Failures are IoFailure, which the caller
// turns into an epx error that names the ranks involved.

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "epx/bootstrap.hpp"
#include "epx/error.hpp"

namespace epx::transport {

// ---- deadlines ----------------------------------------------------------------------------------

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

inline Deadline after_ms(int ms) { return Clock::now() + std::chrono::milliseconds(ms); }

// Whole milliseconds until `deadline` (rounded up), 0 once it has passed: a poll() timeout.
inline int ms_left(Deadline deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return int(std::clamp<long long>(left, 0, INT_MAX));
}

// "Connection refused (111)".
std::string errno_text(int err);

// Throws the epx error of `code` (PeerError for a code without its own type) with `msg`.
[[noreturn]] void throw_coded(ErrorCode code, const std::string& msg);

// ---- frames -------------------------------------------------------------------------------------

enum class FrameType : uint32_t {
  kHello = 1,   // rank r -> rank 0: Hello
  kWelcome,     // rank 0 -> rank r: every rank's pid (int64 each); start-up succeeded
  kReject,      // rank 0 -> rank r: int32 code + message; start-up failed
  kData,        // rank r -> rank 0: all_gather bytes
  kResult,      // rank 0 -> rank r: all_gather result, per rank uint64 length + bytes
  kFds,         // rank r -> rank 0: one descriptor
  kFdsResult,   // rank 0 -> rank r: every rank's descriptor, in rank order
  kAbort,       // rank 0 -> rank r: int32 code + message; the collective failed
};

// The collective a frame a rank sends belongs to: "all_gather", "all_gather_fds", or "an
// unexpected message".
const char* collective_name(FrameType t);

struct Frame {
  FrameType type{};
  uint32_t seq = 0;
  std::string payload;
  std::vector<UniqueFd> fds;  // received with the frame, close-on-exec
};

// Raised by the frame layer, turned into an epx error with rank names by the caller.
struct IoFailure {
  enum Kind { kClosed, kTimeout, kProtocol, kSystem } kind;
  std::string detail;
};

// Waits until `fd` is ready for `events` (or hung up: the next call reports that).
void wait_fd(int fd, short events, Deadline deadline);

// Sends one frame, with `num_fds` descriptors (at most kMaxRanks) attached to its first byte.
void send_frame(int fd, FrameType type, uint32_t seq, std::string_view payload, Deadline deadline,
                const int* fds = nullptr, size_t num_fds = 0);

// Receives one whole frame and the descriptors that came with it. IoFailure::kProtocol for a
// malformed header or more descriptors than a frame can carry.
Frame recv_frame(int fd, Deadline deadline);

// ---- payloads -----------------------------------------------------------------------------------

// Fixed-width fields in host byte order: both ends are on the same machine, or over TCP on
// machines of the same byte order (a Hello of the other order fails its magic and is dropped).
template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(v));
}
template <typename T>
bool take(std::string_view& in, T& v) {
  if (in.size() < sizeof(T)) return false;
  std::memcpy(&v, in.data(), sizeof(T));
  in.remove_prefix(sizeof(T));
  return true;
}

inline constexpr uint32_t kHelloMagic = 0x42585045;  // "EPXB"
inline constexpr uint32_t kProtocol = 1;

// How a rank introduces itself to rank 0 at start-up.
struct Hello {
  uint32_t magic = kHelloMagic;
  uint32_t protocol = kProtocol;
  int32_t rank = 0;
  int32_t world_size = 0;
  int64_t pid = 0;
};

std::string encode_hello(const Hello& h);
// Whether `f` is a well-formed Hello (of any protocol version); fills `h` if so.
bool decode_hello(const Frame& f, Hello& h);

// The payload of a Reject or an Abort: int32 code + message.
std::string encode_error(ErrorCode code, const std::string& msg);
// Throws the error a Reject or an Abort frame carries.
[[noreturn]] void throw_encoded_error(const Frame& f);

}  // namespace epx::transport
