// Collectives of a SocketBootstrap (bootstrap_socket.hpp): every rank sends its part to rank
// 0, rank 0 gathers them and sends the result, or the error, to every rank.

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>

#include <cerrno>
#include <optional>
#include <string_view>
#include <utility>

#include "transport/bootstrap_socket.hpp"

namespace epx {
namespace {

using transport::after_ms;
using transport::Clock;
using transport::collective_name;
using transport::Deadline;
using transport::encode_error;
using transport::errno_text;
using transport::Frame;
using transport::FrameType;
using transport::IoFailure;
using transport::kAbortSendMs;
using transport::kStaleFileGraceMs;
using transport::kVerdictGraceMs;
using transport::ms_left;
using transport::put;
using transport::rank_list;
using transport::recv_frame;
using transport::remove_if_stale;
using transport::send_frame;
using transport::take;
using transport::throw_encoded_error;

}  // namespace

void SocketBootstrap::Impl::check_usable() const {
  if (failed) {
    EPX_THROW(StateError, fmt::format("{}: rank {} refuses further collectives after an "
                                      "earlier error; restart the job. The error was: {}",
                                      where(), me(), first_error));
  }
}

// Rank 0 tells every other rank that the collective failed, and throws the same error.
void SocketBootstrap::Impl::abort_all(uint32_t s, ErrorCode code, const std::string& msg) {
  const std::string payload = encode_error(code, msg);
  for (int r = 1; r < n(); ++r) {
    try {
      send_frame(peers[size_t(r)].get(), FrameType::kAbort, s, payload, after_ms(kAbortSendMs));
    } catch (const IoFailure&) {
    }
  }
  fail(code, msg);
}

// Rank 0: receives one frame of `type` for collective `s` from every other rank.
std::vector<Frame> SocketBootstrap::Impl::gather(FrameType type, uint32_t s) {
  const char* what = collective_name(type);
  const Deadline deadline = after_ms(opts.timeout_ms);
  std::vector<Frame> got(count());
  std::vector<bool> have(size_t(n()), false);
  have[0] = true;
  int remaining = n() - 1;
  while (remaining > 0) {
    std::vector<pollfd> pfds;
    std::vector<int> ranks;
    for (int r = 1; r < n(); ++r) {
      if (have[size_t(r)]) continue;
      pfds.push_back({peers[size_t(r)].get(), POLLIN, 0});
      ranks.push_back(r);
    }
    const int rc = ::poll(pfds.data(), pfds.size(), ms_left(deadline));
    if (rc < 0 && errno == EINTR) continue;
    if (rc < 0) {
      abort_all(s, ErrorCode::kPeer, fmt::format("{}: poll(): {}", where(), errno_text(errno)));
    }
    if (rc == 0) {
      abort_all(s, ErrorCode::kTimeout,
                fmt::format("{}: {} #{}: {} did not call it within {} ms (EPX_TIMEOUT_MS)",
                            where(), what, s, rank_list(ranks), opts.timeout_ms));
    }
    for (size_t i = 0; i < pfds.size(); ++i) {
      if (pfds[i].revents == 0) continue;
      const int r = ranks[i];
      Frame f;
      try {
        f = recv_frame(pfds[i].fd, deadline);
      } catch (const IoFailure& e) {
        if (e.kind == IoFailure::kClosed) {
          abort_all(s, ErrorCode::kPeer,
                    fmt::format("{}: {} #{}: {} disconnected (it exited or was killed)",
                                where(), what, s, who(r)));
        }
        if (e.kind == IoFailure::kTimeout) {
          abort_all(s, ErrorCode::kTimeout,
                    fmt::format("{}: {} #{}: {} sent part of its message and stalled for {} ms",
                                where(), what, s, who(r), opts.timeout_ms));
        }
        abort_all(s, ErrorCode::kPeer, fmt::format("{}: {} #{}: reading from {} failed: {}",
                                                   where(), what, s, who(r), e.detail));
      }
      if (f.type != type || f.seq != s) {
        abort_all(s, ErrorCode::kPeer,
                  fmt::format("{}: {} called {} #{} while rank 0 called {} #{}: every rank "
                              "must call the same collectives in the same order",
                              where(), who(r), collective_name(f.type), f.seq, what, s));
      }
      got[size_t(r)] = std::move(f);
      have[size_t(r)] = true;
      --remaining;
    }
  }
  return got;
}

// Rank 0: sends the result to every other rank. A rank that died since it sent its part is
// reported by name at the next collective (its connection reads as closed).
void SocketBootstrap::Impl::scatter_result(FrameType type, uint32_t s,
                                               const std::string& payload,
                                               const std::vector<int>& fds) {
  const Deadline deadline = after_ms(opts.timeout_ms);
  for (int r = 1; r < n(); ++r) {
    try {
      send_frame(peers[size_t(r)].get(), type, s, payload, deadline, fds.data(), fds.size());
    } catch (const IoFailure& e) {
      if (e.kind == IoFailure::kTimeout) {
        abort_all(s, ErrorCode::kTimeout,
                  fmt::format("{}: {} did not take the result of collective #{} within {} ms",
                              where(), who(r), s, opts.timeout_ms));
      }
    }
  }
}

// After a failed write to rank 0: rank 0 may have closed the connection just after telling
// this rank why (a Reject or an Abort waits unread); that beats a bare "disconnected".
std::optional<Frame> SocketBootstrap::Impl::pending_verdict() {
  try {
    Frame f = recv_frame(root.get(), Clock::now());
    if (f.type == FrameType::kAbort || f.type == FrameType::kReject) return f;
  } catch (const IoFailure&) {
  }
  return std::nullopt;
}

void SocketBootstrap::Impl::root_failed(const IoFailure& e, const char* what, uint32_t s) {
  if (e.kind == IoFailure::kClosed) {
    (void)remove_if_stale(addr, kStaleFileGraceMs);
    fail(ErrorCode::kPeer, fmt::format("{}: {} #{}: {} disconnected (it exited or was killed)",
                                       where(), what, s, who(0)));
  }
  if (e.kind == IoFailure::kTimeout) {
    fail(ErrorCode::kTimeout,
         fmt::format("{}: {} #{}: {} did not complete it within {} ms (EPX_TIMEOUT_MS): rank "
                     "0 did not call it, or is stuck",
                     where(), what, s, who(0), opts.timeout_ms));
  }
  fail(ErrorCode::kPeer, fmt::format("{}: {} #{}: talking to {} failed: {}", where(), what, s,
                                     who(0), e.detail));
}

// Other ranks: sends this rank's part to rank 0 and returns rank 0's answer.
Frame SocketBootstrap::Impl::exchange_with_root(FrameType type, uint32_t s,
                                                 const std::string& payload,
                                                 FrameType expected, int fd) {
  const char* what = collective_name(type);
  const Deadline deadline = after_ms(opts.timeout_ms + kVerdictGraceMs);
  std::optional<Frame> reply;
  try {
    send_frame(root.get(), type, s, payload, deadline, &fd, fd >= 0 ? 1 : 0);
  } catch (const IoFailure& e) {
    if (e.kind == IoFailure::kClosed) reply = pending_verdict();
    if (!reply) root_failed(e, what, s);
  }
  if (!reply) {
    try {
      reply = recv_frame(root.get(), deadline);
    } catch (const IoFailure& e) {
      root_failed(e, what, s);
    }
  }
  Frame& f = *reply;
  if (f.type == FrameType::kAbort) {
    failed = true;
    std::string_view in = f.payload;
    int32_t code = 0;
    (void)take(in, code);
    first_error = std::string(in);
    throw_encoded_error(f);
  }
  if (f.type != expected || f.seq != s) {
    fail(ErrorCode::kPeer, fmt::format("{}: {} #{}: unexpected reply from rank 0 (type {}, "
                                       "collective #{})",
                                       where(), what, s, uint32_t(f.type), f.seq));
  }
  return std::move(f);
}

std::vector<std::string> SocketBootstrap::Impl::all_gather(const std::string& bytes) {
  check_usable();
  const uint32_t s = ++seq;
  if (n() == 1) return {bytes};
  std::vector<std::string> out(count());
  if (me() == 0) {
    std::vector<Frame> got = gather(FrameType::kData, s);
    out[0] = bytes;
    for (int r = 1; r < n(); ++r) out[size_t(r)] = std::move(got[size_t(r)].payload);
    std::string result;
    for (const std::string& part : out) {
      put(result, uint64_t(part.size()));
      result += part;
    }
    scatter_result(FrameType::kResult, s, result);
    return out;
  }
  const Frame f = exchange_with_root(FrameType::kData, s, bytes, FrameType::kResult);
  std::string_view in = f.payload;
  for (std::string& part : out) {
    uint64_t len = 0;
    if (!take(in, len) || len > in.size()) {
      fail(ErrorCode::kPeer, fmt::format("{}: all_gather #{}: malformed result from rank 0",
                                         where(), s));
    }
    part.assign(in.data(), len);
    in.remove_prefix(len);
  }
  return out;
}

std::vector<UniqueFd> SocketBootstrap::Impl::all_gather_fds(int fd) {
  check_usable();
  EPX_CHECK(fd >= 0 && ::fcntl(fd, F_GETFD) != -1, InputError, "fd", fd,
            "an open file descriptor");
  const uint32_t s = ++seq;
  std::vector<UniqueFd> out(count());
  auto dup_own = [&] {
    UniqueFd d(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
    if (!d.valid()) {
      EPX_THROW(PeerError, fmt::format("{}: dup of fd {}: {}", where(), fd, errno_text(errno)));
    }
    return d;
  };
  if (n() == 1) {
    out[0] = dup_own();
    return out;
  }
  if (me() == 0) {
    std::vector<Frame> got = gather(FrameType::kFds, s);
    std::vector<int> raw(count());
    raw[0] = fd;
    for (int r = 1; r < n(); ++r) {
      if (got[size_t(r)].fds.size() != 1) {
        abort_all(s, ErrorCode::kPeer,
                  fmt::format("{}: all_gather_fds #{}: {} sent {} descriptors, expected 1",
                              where(), s, who(r), got[size_t(r)].fds.size()));
      }
      raw[size_t(r)] = got[size_t(r)].fds[0].get();
    }
    std::string payload;
    put(payload, uint32_t(n()));
    scatter_result(FrameType::kFdsResult, s, payload, raw);
    out[0] = dup_own();
    for (int r = 1; r < n(); ++r) out[size_t(r)] = std::move(got[size_t(r)].fds[0]);
    return out;
  }
  Frame f = exchange_with_root(FrameType::kFds, s, std::string(), FrameType::kFdsResult, fd);
  if (f.fds.size() != size_t(n())) {
    fail(ErrorCode::kPeer, fmt::format("{}: all_gather_fds #{}: rank 0 sent {} descriptors, "
                                       "expected {}",
                                       where(), s, f.fds.size(), n()));
  }
  return std::move(f.fds);
}

std::vector<std::string> SocketBootstrap::all_gather(const std::string& bytes) {
  return impl_->all_gather(bytes);
}

std::vector<UniqueFd> SocketBootstrap::all_gather_fds(int fd) {
  if (!can_pass_fds()) {
    EPX_THROW(UnsupportedError,
              fmt::format("bootstrap {}: descriptors cannot pass over TCP (between hosts); share "
                          "memory through CUDA IPC handles instead",
                          impl_->opts.address));
  }
  return impl_->all_gather_fds(fd);
}

}  // namespace epx
