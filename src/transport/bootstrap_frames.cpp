// Framed messages and descriptor passing on a Unix stream socket (bootstrap_frames.hpp).

#include "transport/bootstrap_frames.hpp"

#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <thread>

namespace epx::transport {
namespace {

constexpr size_t kMaxFrameBytes = size_t(1) << 30;
constexpr uint32_t kLastFrameType = uint32_t(FrameType::kAbort);

struct FrameHeader {
  uint32_t type;
  uint32_t seq;
  uint64_t length;
};

}  // namespace

std::string errno_text(int err) { return fmt::format("{} ({})", std::strerror(err), err); }

[[noreturn]] void throw_coded(ErrorCode code, const std::string& msg) {
  switch (code) {
    case ErrorCode::kConfig: EPX_THROW(ConfigError, msg);
    case ErrorCode::kTimeout: EPX_THROW(TimeoutError, msg);
    case ErrorCode::kInput: EPX_THROW(InputError, msg);
    case ErrorCode::kState: EPX_THROW(StateError, msg);
    case ErrorCode::kUnsupported: EPX_THROW(UnsupportedError, msg);
    case ErrorCode::kCuda: EPX_THROW(CudaError, msg);
    default: EPX_THROW(PeerError, msg);
  }
}


const char* collective_name(FrameType t) {
  switch (t) {
    case FrameType::kData: return "all_gather";
    case FrameType::kFds: return "all_gather_fds";
    default: return "an unexpected message";
  }
}

// ---- frames -------------------------------------------------------------------------------------

void wait_fd(int fd, short events, Deadline deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, ms_left(deadline));
    if (rc > 0) return;
    if (rc == 0) throw IoFailure{IoFailure::kTimeout, "timed out"};
    if (errno != EINTR) throw IoFailure{IoFailure::kSystem, "poll: " + errno_text(errno)};
  }
}

void send_frame(int fd, FrameType type, uint32_t seq, std::string_view payload, Deadline deadline,
                const int* fds, size_t num_fds) {
  const FrameHeader header{uint32_t(type), seq, payload.size()};
  const size_t total = sizeof(header) + payload.size();
  size_t sent = 0;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxRanks)];
  while (sent < total) {
    iovec iov[2];
    int num_iov = 0;
    if (sent < sizeof(header)) {
      iov[num_iov++] = {reinterpret_cast<char*>(const_cast<FrameHeader*>(&header)) + sent,
                        sizeof(header) - sent};
      if (!payload.empty()) iov[num_iov++] = {const_cast<char*>(payload.data()), payload.size()};
    } else {
      const size_t off = sent - sizeof(header);
      iov[num_iov++] = {const_cast<char*>(payload.data()) + off, payload.size() - off};
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = num_iov;
    if (sent == 0 && num_fds > 0) {
      // The descriptors travel with the frame's first byte.
      std::memset(control, 0, sizeof(control));
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * num_fds);
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * num_fds);
      std::memcpy(CMSG_DATA(c), fds, sizeof(int) * num_fds);
    }
    const ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) {
      sent += size_t(n);
      continue;
    }
    const int err = errno;
    if (err == EINTR) continue;
    if (err == EAGAIN || err == EWOULDBLOCK) {
      wait_fd(fd, POLLOUT, deadline);
    } else if (err == ETOOMANYREFS) {
      // Too many descriptors in flight for this user: the receivers are draining them.
      if (ms_left(deadline) == 0) throw IoFailure{IoFailure::kTimeout, "descriptors in flight"};
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } else if (err == EPIPE || err == ECONNRESET || err == ENOTCONN) {
      throw IoFailure{IoFailure::kClosed, "connection closed"};
    } else {
      throw IoFailure{IoFailure::kSystem, "sendmsg: " + errno_text(err)};
    }
  }
}

namespace {

// Reads exactly `size` bytes, keeping every descriptor that arrives with them.
void recv_bytes(int fd, char* buf, size_t size, Deadline deadline, std::vector<UniqueFd>& fds) {
  size_t got = 0;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxRanks)];
  while (got < size) {
    iovec iov{buf + got, size - got};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = ::recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n > 0) {
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; ++i) {
          int received = -1;
          std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
          fds.emplace_back(received);
        }
      }
      if ((msg.msg_flags & MSG_CTRUNC) != 0) {
        throw IoFailure{IoFailure::kProtocol, "more descriptors than expected"};
      }
      got += size_t(n);
      continue;
    }
    if (n == 0) throw IoFailure{IoFailure::kClosed, "connection closed"};
    const int err = errno;
    if (err == EINTR) continue;
    if (err == EAGAIN || err == EWOULDBLOCK) {
      wait_fd(fd, POLLIN, deadline);
    } else if (err == ECONNRESET || err == ENOTCONN) {
      throw IoFailure{IoFailure::kClosed, "connection reset"};
    } else {
      throw IoFailure{IoFailure::kSystem, "recvmsg: " + errno_text(err)};
    }
  }
}

}  // namespace

Frame recv_frame(int fd, Deadline deadline) {
  Frame f;
  FrameHeader h{};
  recv_bytes(fd, reinterpret_cast<char*>(&h), sizeof(h), deadline, f.fds);
  if (h.type < 1 || h.type > kLastFrameType || h.length > kMaxFrameBytes) {
    throw IoFailure{IoFailure::kProtocol,
                    fmt::format("malformed frame (type {}, {} bytes)", h.type, h.length)};
  }
  f.type = FrameType(h.type);
  f.seq = h.seq;
  f.payload.resize(h.length);
  recv_bytes(fd, f.payload.data(), h.length, deadline, f.fds);
  return f;
}

// ---- payloads -----------------------------------------------------------------------------------

std::string encode_hello(const Hello& h) {
  std::string out;
  put(out, h.magic);
  put(out, h.protocol);
  put(out, h.rank);
  put(out, h.world_size);
  put(out, h.pid);
  return out;
}

bool decode_hello(const Frame& f, Hello& h) {
  std::string_view in = f.payload;
  return f.type == FrameType::kHello && take(in, h.magic) && take(in, h.protocol) &&
         take(in, h.rank) && take(in, h.world_size) && take(in, h.pid) && in.empty() &&
         h.magic == kHelloMagic;
}

std::string encode_error(ErrorCode code, const std::string& msg) {
  std::string out;
  put(out, int32_t(code));
  out += msg;
  return out;
}

[[noreturn]] void throw_encoded_error(const Frame& f) {
  std::string_view in = f.payload;
  int32_t code = int32_t(ErrorCode::kPeer);
  if (!take(in, code)) code = int32_t(ErrorCode::kPeer);
  throw_coded(ErrorCode(code), std::string(in));
}

}  // namespace epx::transport
