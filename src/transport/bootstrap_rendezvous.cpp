// Start-up of a SocketBootstrap (bootstrap_socket.hpp): rank 0 listens and admits every rank,
// the others connect and introduce themselves; afterwards rank 0 turns newcomers away.

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <optional>
#include <string_view>
#include <utility>

#include "transport/bootstrap_socket.hpp"

namespace epx {

namespace transport {

std::string rank_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

}  // namespace transport

namespace {

using transport::after_ms;
using transport::decode_hello;
using transport::Deadline;
using transport::encode_error;
using transport::encode_hello;
using transport::errno_text;
using transport::Frame;
using transport::FrameType;
using transport::Hello;
using transport::IoFailure;
using transport::kAbortSendMs;
using transport::kProtocol;
using transport::kStaleFileGraceMs;
using transport::kVerdictGraceMs;
using transport::ms_left;
using transport::put;
using transport::rank_list;
using transport::recv_frame;
using transport::remove_if_stale;
using transport::send_frame;
using transport::someone_listens;
using transport::take;
using transport::throw_encoded_error;
using transport::wait_fd;

constexpr int kConnectRetryMs = 10;
constexpr int kNewcomerReplyMs = 500;  // rank 0's answer to a connection after start-up

}  // namespace

SocketBootstrap::Impl::Impl(const BootstrapOptions& o) : opts(o) {
  opts.validate();
  pids.assign(size_t(opts.world_size), 0);
  pids[size_t(opts.rank)] = long(::getpid());
  if (opts.world_size == 1) return;
  addr = transport::resolve(opts.address);
  if (opts.rank == 0) {
    start_root();
  } else {
    start_member();
  }
}

SocketBootstrap::Impl::~Impl() {
  if (newcomers.joinable()) {
    const char byte = 1;
    (void)!::write(stop_write.get(), &byte, 1);
    newcomers.join();
  }
}

std::string SocketBootstrap::Impl::who(int r) const {
  return pids[size_t(r)] != 0 ? fmt::format("rank {} (pid {})", r, pids[size_t(r)])
                              : fmt::format("rank {}", r);
}

std::string SocketBootstrap::Impl::where() const {
  return fmt::format("bootstrap {}", opts.address);
}

void SocketBootstrap::Impl::fail(ErrorCode code, const std::string& msg) {
  failed = true;
  first_error = msg;
  transport::throw_coded(code, msg);
}

// ---- rank 0 -------------------------------------------------------------------------------------

void SocketBootstrap::Impl::listen_at_address() {
  for (int attempt = 0;; ++attempt) {
    listen_fd.reset(::socket(addr.family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!listen_fd.valid()) {
      EPX_THROW(PeerError, fmt::format("{}: socket(): {}", where(), errno_text(errno)));
    }
    if (addr.tcp()) {
      // A port whose last job's connections linger in TIME_WAIT can be bound again; a port
      // with a live listener still cannot (EADDRINUSE).
      const int on = 1;
      (void)::setsockopt(listen_fd.get(), SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
    }
    if (::bind(listen_fd.get(), addr.bind_sa(), addr.bind_len) == 0) break;
    const int err = errno;
    if (err == EADDRINUSE && addr.tcp()) {
      EPX_THROW(ConfigError,
                fmt::format("{}: the port is already in use on this host: another job on the "
                            "same EPX_BOOTSTRAP address, a second rank 0, or another program. "
                            "Give each job its own port",
                            where()));
    }
    if (err == EADDRINUSE) {
      if (someone_listens(addr)) {
        EPX_THROW(ConfigError,
                  fmt::format("{}: the address is already in use by a live process: another "
                              "job on the same EPX_BOOTSTRAP address, or a second rank 0. Give "
                              "each job its own address (`epx launch` makes a fresh one per "
                              "launch)",
                              where()));
      }
      if (!addr.abstract && attempt == 0) {
        // A socket file that nobody accepts on: left behind by a job that was killed.
        (void)::unlink(addr.path.c_str());
        continue;
      }
    }
    EPX_THROW(ConfigError, fmt::format("{}: cannot bind the socket{}: {}", where(),
                                       addr.is_file() ? " file " + addr.path : "",
                                       errno_text(err)));
  }
  if (addr.is_file()) {
    struct stat st {};
    if (::lstat(addr.path.c_str(), &st) == 0) {
      file.path = addr.path;
      file.dev = st.st_dev;
      file.ino = st.st_ino;
      file.owned = true;
    }
  }
  if (::listen(listen_fd.get(), SOMAXCONN) != 0) {
    EPX_THROW(PeerError, fmt::format("{}: listen(): {}", where(), errno_text(errno)));
  }
}

// Tells every connected rank (and `extra`, a connection not yet admitted) why start-up
// failed, then throws the same error here.
void SocketBootstrap::Impl::reject_all(ErrorCode code, const std::string& msg, int extra) {
  const std::string payload = encode_error(code, msg);
  auto tell = [&](int fd) {
    try {
      send_frame(fd, FrameType::kReject, 0, payload, after_ms(kAbortSendMs));
    } catch (const IoFailure&) {
    }
  };
  for (const UniqueFd& p : peers) {
    if (p.valid()) tell(p.get());
  }
  if (extra >= 0) tell(extra);
  fail(code, msg);
}

void SocketBootstrap::Impl::start_root() {
  const Deadline deadline = after_ms(opts.timeout_ms);
  listen_at_address();
  peers.resize(count());
  std::vector<UniqueFd> pending;  // accepted, not yet introduced
  int arrived = 1;
  while (arrived < n()) {
    std::vector<pollfd> pfds;
    pfds.push_back({listen_fd.get(), POLLIN, 0});
    for (const UniqueFd& p : pending) pfds.push_back({p.get(), POLLIN, 0});
    std::vector<int> admitted;  // ranks whose connection is polled (a hang-up = a death)
    for (int r = 1; r < n(); ++r) {
      if (peers[size_t(r)].valid()) {
        pfds.push_back({peers[size_t(r)].get(), POLLIN, 0});
        admitted.push_back(r);
      }
    }
    const int rc = ::poll(pfds.data(), pfds.size(), ms_left(deadline));
    if (rc < 0 && errno == EINTR) continue;
    if (rc < 0) {
      reject_all(ErrorCode::kPeer, fmt::format("{}: poll(): {}", where(), errno_text(errno)));
    }
    if (rc == 0) {
      std::vector<int> missing, present{0};
      for (int r = 1; r < n(); ++r) (peers[size_t(r)].valid() ? present : missing).push_back(r);
      reject_all(ErrorCode::kTimeout,
                 fmt::format("{}: {} of {} did not arrive within {} ms (EPX_TIMEOUT_MS); "
                             "arrived: {}",
                             where(), rank_list(missing), n(), opts.timeout_ms,
                             rank_list(present)));
    }
    // Admitted ranks first: during start-up they may only hang up (die).
    for (size_t i = 0; i < admitted.size(); ++i) {
      if (pfds[1 + pending.size() + i].revents == 0) continue;
      const int r = admitted[i];
      reject_all(ErrorCode::kPeer,
                 fmt::format("{}: {} disconnected during start-up (it exited or was killed)",
                             where(), who(r)));
    }
    std::vector<UniqueFd> still_pending;
    for (size_t i = 0; i < pending.size(); ++i) {
      if (pfds[1 + i].revents == 0) {
        still_pending.push_back(std::move(pending[i]));
        continue;
      }
      UniqueFd conn = std::move(pending[i]);
      Frame f;
      Hello h;
      try {
        f = recv_frame(conn.get(), std::min(deadline, after_ms(kNewcomerReplyMs)));
      } catch (const IoFailure&) {
        continue;  // a probe (another rank 0 checking the address) or garbage: drop it
      }
      if (!decode_hello(f, h)) continue;
      if (h.protocol != kProtocol) {
        reject_all(ErrorCode::kConfig,
                   fmt::format("{}: rank {} (pid {}) speaks bootstrap protocol {}, rank 0 "
                               "speaks {}: every rank must run the same epx version",
                               where(), h.rank, h.pid, h.protocol, kProtocol),
                   conn.get());
      }
      if (h.world_size != n()) {
        reject_all(ErrorCode::kConfig,
                   fmt::format("{}: the world size disagrees: rank 0 has EPX_WORLD_SIZE = {}, "
                               "rank {} (pid {}) has {}",
                               where(), n(), h.rank, h.pid, h.world_size),
                   conn.get());
      }
      if (h.rank == 0) {
        reject_all(ErrorCode::kConfig,
                   fmt::format("{}: rank 0 used twice: by pid {} (listening) and pid {}",
                               where(), pids[0], h.pid),
                   conn.get());
      }
      if (h.rank < 0 || h.rank >= n()) {
        reject_all(ErrorCode::kConfig,
                   fmt::format("{}: rank {} (pid {}) is out of range, expected a rank in "
                               "[0, world size = {})",
                               where(), h.rank, h.pid, n()),
                   conn.get());
      }
      if (peers[size_t(h.rank)].valid()) {
        reject_all(ErrorCode::kConfig,
                   fmt::format("{}: rank {} used twice: by pid {} and pid {}", where(), h.rank,
                               pids[size_t(h.rank)], h.pid),
                   conn.get());
      }
      peers[size_t(h.rank)] = std::move(conn);
      pids[size_t(h.rank)] = long(h.pid);
      ++arrived;
    }
    pending = std::move(still_pending);
    if ((pfds[0].revents & POLLIN) != 0) {
      for (;;) {
        UniqueFd c(::accept4(listen_fd.get(), nullptr, nullptr, SOCK_CLOEXEC));
        if (!c.valid()) break;
        transport::tune_connection(addr, c.get());
        pending.push_back(std::move(c));
      }
    }
  }
  // Everyone is here: tell them, with every rank's pid for their messages. A rank that died
  // just now is reported by name at the first collective.
  std::string welcome;
  for (long pid : pids) put(welcome, int64_t(pid));
  for (int r = 1; r < n(); ++r) {
    try {
      send_frame(peers[size_t(r)].get(), FrameType::kWelcome, 0, welcome, deadline);
    } catch (const IoFailure&) {
    }
  }
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) == 0) {
    stop_read.reset(pipe_fds[0]);
    stop_write.reset(pipe_fds[1]);
    newcomers = std::thread([this] { answer_newcomers(); });
  }
}

// Runs on its own thread after start-up: any rank that connects now belongs to another job
// (or is a restarted rank); it gets a clear refusal instead of waiting for its timeout.
void SocketBootstrap::Impl::answer_newcomers() noexcept {
  for (;;) {
    pollfd p[2] = {{listen_fd.get(), POLLIN, 0}, {stop_read.get(), POLLIN, 0}};
    const int rc = ::poll(p, 2, -1);
    if (rc < 0 && errno == EINTR) continue;
    if (rc < 0 || p[1].revents != 0) return;
    if ((p[0].revents & POLLIN) == 0) continue;
    UniqueFd c(::accept4(listen_fd.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!c.valid()) continue;
    try {
      const Frame f = recv_frame(c.get(), after_ms(kNewcomerReplyMs));
      Hello h;
      if (!decode_hello(f, h)) continue;
      const std::string msg = fmt::format(
          "{}: the address is in use by a running job of {} ranks (rank 0 is pid {}); rank {} "
          "of a world of {} (pid {}) cannot join it. Give each job its own EPX_BOOTSTRAP "
          "address (`epx launch` makes a fresh one per launch)",
          where(), n(), pids[0], h.rank, h.world_size, h.pid);
      send_frame(c.get(), FrameType::kReject, 0, encode_error(ErrorCode::kConfig, msg),
                 after_ms(kNewcomerReplyMs));
    } catch (...) {
    }
  }
}

// ---- other ranks --------------------------------------------------------------------------------

void SocketBootstrap::Impl::start_member() {
  const Deadline deadline = after_ms(opts.timeout_ms);
  for (;;) {
    root.reset(::socket(addr.family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!root.valid()) {
      EPX_THROW(PeerError, fmt::format("{}: socket(): {}", where(), errno_text(errno)));
    }
    int err = ::connect(root.get(), addr.connect_sa(), addr.len) == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
      // TCP's usual answer (and legal for Unix sockets): wait for the connection to complete;
      // refused or unreachable, it is retried below.
      try {
        wait_fd(root.get(), POLLOUT, deadline);
      } catch (const IoFailure&) {
      }
      int so_error = 0;
      socklen_t len = sizeof(so_error);
      if (::getsockopt(root.get(), SOL_SOCKET, SO_ERROR, &so_error, &len) == 0 && so_error == 0)
        err = 0;
    }
    if (err == 0) {
      if (!transport::connected_to_itself(addr, root.get())) break;
      root.reset();  // frees the port for rank 0; nothing listened yet
    } else if (err != EINPROGRESS && err != ENOENT && err != ECONNREFUSED && err != EAGAIN &&
               !(addr.tcp() && (err == ETIMEDOUT || err == EHOSTUNREACH ||
                                err == ENETUNREACH))) {
      EPX_THROW(PeerError, fmt::format("{}: rank {} cannot connect to rank 0: {}", where(),
                                       me(), errno_text(err)));
    }
    if (ms_left(deadline) == 0) {
      fail(ErrorCode::kTimeout,
           fmt::format("{}: rank 0 did not arrive within {} ms (EPX_TIMEOUT_MS): nothing "
                       "listens at the address (rank {} of {} waited for it)",
                       where(), opts.timeout_ms, me(), n()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(kConnectRetryMs));
  }
  transport::tune_connection(addr, root.get());
  const Deadline verdict = deadline + std::chrono::milliseconds(kVerdictGraceMs);
  Hello h;
  h.rank = me();
  h.world_size = n();
  h.pid = ::getpid();
  Frame f;
  try {
    try {
      send_frame(root.get(), FrameType::kHello, 0, encode_hello(h), verdict);
    } catch (const IoFailure& e) {
      // Rank 0 may have refused this rank and closed already: read its verdict.
      std::optional<Frame> v = e.kind == IoFailure::kClosed ? pending_verdict() : std::nullopt;
      if (!v) throw;
      f = std::move(*v);
    }
    if (f.type != FrameType::kReject) f = recv_frame(root.get(), verdict);
  } catch (const IoFailure& e) {
    if (e.kind == IoFailure::kTimeout) {
      fail(ErrorCode::kTimeout,
           fmt::format("{}: rank 0 accepted rank {} but did not report within {} ms "
                       "(EPX_TIMEOUT_MS) that all {} ranks arrived",
                       where(), me(), opts.timeout_ms, n()));
    }
    (void)remove_if_stale(addr, kStaleFileGraceMs);
    fail(ErrorCode::kPeer, fmt::format("{}: rank 0 closed the connection during start-up "
                                       "without a verdict ({}): it exited or was killed",
                                       where(), e.detail));
  }
  if (f.type == FrameType::kReject) {
    failed = true;
    throw_encoded_error(f);
  }
  std::string_view in = f.payload;
  std::vector<long> all(count());
  bool ok = f.type == FrameType::kWelcome;
  for (long& pid : all) {
    int64_t v = 0;
    ok = ok && take(in, v);
    pid = long(v);
  }
  if (!ok || !in.empty()) {
    fail(ErrorCode::kPeer, fmt::format("{}: rank 0 answered with a malformed start-up reply",
                                       where()));
  }
  pids = std::move(all);
}

// ---- SocketBootstrap ------------------------------------------------------------------------

SocketBootstrap::SocketBootstrap(const BootstrapOptions& options)
    : impl_(std::make_unique<Impl>(options)) {}
SocketBootstrap::~SocketBootstrap() = default;

int SocketBootstrap::rank() const { return impl_->opts.rank; }
int SocketBootstrap::size() const { return impl_->opts.world_size; }
const std::string& SocketBootstrap::address() const { return impl_->opts.address; }
const std::vector<long>& SocketBootstrap::pids() const { return impl_->pids; }
bool SocketBootstrap::can_pass_fds() const {
  return !transport::is_tcp_address(impl_->opts.address);
}

}  // namespace epx
