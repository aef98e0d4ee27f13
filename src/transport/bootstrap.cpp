// UnixSocketBootstrap, CallbackBootstrap and the job environment (include/epx/bootstrap.hpp).
//
// Connections exist only between rank 0 and each other rank (a star); rank 0 gathers each
// collective and sends the result to everyone, or an Abort frame carrying the error that every
// rank then throws. The frames themselves are bootstrap_frames.hpp's.

#include "epx/bootstrap.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string_view>
#include <thread>
#include <utility>

#include "core/env.hpp"
#include "epx/error.hpp"
#include "transport/bootstrap_address.hpp"
#include "transport/bootstrap_frames.hpp"

namespace epx {

void UniqueFd::reset(int fd) noexcept {
  if (fd_ >= 0) (void)::close(fd_);
  fd_ = fd;
}

void Bootstrap::barrier() { (void)all_gather(std::string()); }

std::vector<UniqueFd> Bootstrap::all_gather_fds(int /*fd*/) {
  EPX_THROW(UnsupportedError,
            "this bootstrap cannot pass file descriptors between ranks (only a "
            "UnixSocketBootstrap can); share memory through CUDA IPC handles instead");
}

namespace {

using transport::after_ms;
using transport::Clock;
using transport::collective_name;
using transport::Deadline;
using transport::decode_hello;
using transport::encode_error;
using transport::encode_hello;
using transport::errno_text;
using transport::Frame;
using transport::FrameType;
using transport::Hello;
using transport::IoFailure;
using transport::kProtocol;
using transport::ms_left;
using transport::put;
using transport::recv_frame;
using transport::remove_if_stale;
using transport::resolve;
using transport::send_frame;
using transport::SocketAddress;
using transport::someone_listens;
using transport::take;
using transport::throw_coded;
using transport::throw_encoded_error;
using transport::unlink_if_same;
using transport::validate_address;
using transport::wait_fd;

// Non-zero ranks wait this much longer than rank 0 for rank 0's verdict, so that when a rank is
// missing everyone hears rank 0 name it instead of timing out on their own a moment earlier.
constexpr int kVerdictGraceMs = 500;
constexpr int kConnectRetryMs = 10;
constexpr int kStaleFileGraceMs = 200;   // see remove_if_stale
constexpr int kAbortSendMs = 200;        // best effort: telling the others about a failure
constexpr int kNewcomerReplyMs = 500;    // rank 0's answer to a connection after start-up

// "rank 2" or "ranks 2, 3, 5".
std::string rank_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

}  // namespace

// ---- options ------------------------------------------------------------------------------------

void BootstrapOptions::validate() const {
  EPX_CHECK(world_size >= 1 && world_size <= kMaxRanks, ConfigError, "world_size", world_size,
            fmt::format("in [1, kMaxRanks = {}]", kMaxRanks));
  EPX_CHECK(rank >= 0 && rank < world_size, ConfigError, "rank", rank,
            fmt::format("in [0, world_size = {})", world_size));
  EPX_CHECK(timeout_ms >= 1 && timeout_ms <= kMaxTimeoutMs, ConfigError, "timeout_ms", timeout_ms,
            fmt::format("in [1, kMaxTimeoutMs = {}]", kMaxTimeoutMs));
  validate_address("address", address, world_size);
}

BootstrapOptions BootstrapOptions::parse_env(const char* rank, const char* world_size,
                                             const char* address, const char* timeout_ms) {
  BootstrapOptions o = env::parse_bootstrap(rank, world_size, address, timeout_ms);
  validate_address("EPX_BOOTSTRAP", o.address, o.world_size);
  return o;
}

BootstrapOptions BootstrapOptions::from_env() {
  BootstrapOptions o = env::bootstrap();
  validate_address("EPX_BOOTSTRAP", o.address, o.world_size);
  return o;
}


// ---- UnixSocketBootstrap ------------------------------------------------------------------------

struct UnixSocketBootstrap::Impl {
  BootstrapOptions opts;
  SocketAddress addr;
  std::vector<long> pids;
  uint32_t seq = 0;
  bool failed = false;
  std::string first_error;

  // rank 0
  // The socket file this rank created, removed when the object goes, also when its constructor
  // throws (so it is a member with its own destructor, not a step of ~Impl).
  struct SocketFile {
    std::string path;
    dev_t dev = 0;
    ino_t ino = 0;
    bool owned = false;
    SocketFile() = default;
    SocketFile(const SocketFile&) = delete;
    SocketFile& operator=(const SocketFile&) = delete;
    ~SocketFile() {
      if (owned) unlink_if_same(path, dev, ino);
    }
  };
  SocketFile file;
  UniqueFd listen_fd;
  std::vector<UniqueFd> peers;  // [r]: connection to rank r ([0] unused)
  std::thread newcomers;        // answers connections that arrive after start-up
  UniqueFd stop_read, stop_write;

  // other ranks
  UniqueFd root;

  explicit Impl(const BootstrapOptions& o) : opts(o) {
    opts.validate();
    pids.assign(size_t(opts.world_size), 0);
    pids[size_t(opts.rank)] = long(::getpid());
    if (opts.world_size == 1) return;
    addr = resolve(opts.address);
    if (opts.rank == 0) {
      start_root();
    } else {
      start_member();
    }
  }

  ~Impl() {
    if (newcomers.joinable()) {
      const char byte = 1;
      (void)!::write(stop_write.get(), &byte, 1);
      newcomers.join();
    }
  }

  int n() const { return opts.world_size; }
  size_t count() const { return size_t(opts.world_size); }
  int me() const { return opts.rank; }

  std::string who(int r) const {
    return pids[size_t(r)] != 0 ? fmt::format("rank {} (pid {})", r, pids[size_t(r)])
                                : fmt::format("rank {}", r);
  }
  std::string where() const { return fmt::format("bootstrap {}", opts.address); }

  [[noreturn]] void fail(ErrorCode code, const std::string& msg) {
    failed = true;
    first_error = msg;
    throw_coded(code, msg);
  }

  void check_usable() const {
    if (failed) {
      EPX_THROW(StateError, fmt::format("{}: rank {} refuses further collectives after an "
                                        "earlier error; restart the job. The error was: {}",
                                        where(), me(), first_error));
    }
  }

  // ---- start-up, rank 0

  void listen_at_address() {
    for (int attempt = 0;; ++attempt) {
      listen_fd.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
      if (!listen_fd.valid()) {
        EPX_THROW(PeerError, fmt::format("{}: socket(): {}", where(), errno_text(errno)));
      }
      if (::bind(listen_fd.get(), reinterpret_cast<const sockaddr*>(&addr.addr), addr.len) == 0) {
        break;
      }
      const int err = errno;
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
                                         addr.abstract ? "" : " file " + addr.path,
                                         errno_text(err)));
    }
    if (!addr.abstract) {
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
  [[noreturn]] void reject_all(ErrorCode code, const std::string& msg, int extra = -1) {
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

  void start_root() {
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
      if (rc < 0) reject_all(ErrorCode::kPeer, fmt::format("{}: poll(): {}", where(), errno_text(errno)));
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
  void answer_newcomers() noexcept {
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

  // ---- start-up, other ranks

  void start_member() {
    const Deadline deadline = after_ms(opts.timeout_ms);
    for (;;) {
      root.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
      if (!root.valid()) {
        EPX_THROW(PeerError, fmt::format("{}: socket(): {}", where(), errno_text(errno)));
      }
      if (::connect(root.get(), reinterpret_cast<const sockaddr*>(&addr.addr), addr.len) == 0) {
        break;
      }
      const int err = errno;
      if (err == EINPROGRESS) {
        // Not expected for Unix sockets, but legal: wait for the connection to complete.
        try {
          wait_fd(root.get(), POLLOUT, deadline);
        } catch (const IoFailure&) {
        }
        int so_error = 0;
        socklen_t len = sizeof(so_error);
        if (::getsockopt(root.get(), SOL_SOCKET, SO_ERROR, &so_error, &len) == 0 && so_error == 0)
          break;
      } else if (err != ENOENT && err != ECONNREFUSED && err != EAGAIN) {
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

  // ---- collectives

  // Rank 0 tells every other rank that the collective failed, and throws the same error.
  [[noreturn]] void abort_all(uint32_t s, ErrorCode code, const std::string& msg) {
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
  std::vector<Frame> gather(FrameType type, uint32_t s) {
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
      if (rc < 0) abort_all(s, ErrorCode::kPeer, fmt::format("{}: poll(): {}", where(), errno_text(errno)));
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
  void scatter_result(FrameType type, uint32_t s, const std::string& payload,
                      const std::vector<int>& fds = {}) {
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
  std::optional<Frame> pending_verdict() {
    try {
      Frame f = recv_frame(root.get(), Clock::now());
      if (f.type == FrameType::kAbort || f.type == FrameType::kReject) return f;
    } catch (const IoFailure&) {
    }
    return std::nullopt;
  }

  [[noreturn]] void root_failed(const IoFailure& e, const char* what, uint32_t s) {
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
  Frame exchange_with_root(FrameType type, uint32_t s, const std::string& payload,
                           FrameType expected, int fd = -1) {
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

  std::vector<std::string> all_gather(const std::string& bytes) {
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

  std::vector<UniqueFd> all_gather_fds(int fd) {
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
};

UnixSocketBootstrap::UnixSocketBootstrap(const BootstrapOptions& options)
    : impl_(std::make_unique<Impl>(options)) {}
UnixSocketBootstrap::~UnixSocketBootstrap() = default;

int UnixSocketBootstrap::rank() const { return impl_->opts.rank; }
int UnixSocketBootstrap::size() const { return impl_->opts.world_size; }
const std::string& UnixSocketBootstrap::address() const { return impl_->opts.address; }
const std::vector<long>& UnixSocketBootstrap::pids() const { return impl_->pids; }

std::vector<std::string> UnixSocketBootstrap::all_gather(const std::string& bytes) {
  return impl_->all_gather(bytes);
}

std::vector<UniqueFd> UnixSocketBootstrap::all_gather_fds(int fd) {
  return impl_->all_gather_fds(fd);
}

// ---- CallbackBootstrap --------------------------------------------------------------------------

CallbackBootstrap::CallbackBootstrap(int rank, int size, AllGather all_gather)
    : rank_(rank), size_(size), all_gather_(std::move(all_gather)) {
  EPX_CHECK(size >= 1 && size <= kMaxRanks, ConfigError, "size", size,
            fmt::format("in [1, kMaxRanks = {}]", kMaxRanks));
  EPX_CHECK(rank >= 0 && rank < size, ConfigError, "rank", rank,
            fmt::format("in [0, size = {})", size));
  EPX_CHECK(bool(all_gather_), ConfigError, "all_gather", "an empty function",
            "a callable that all-gathers bytes");
}

std::vector<std::string> CallbackBootstrap::all_gather(const std::string& bytes) {
  std::vector<std::string> out = all_gather_(bytes);
  EPX_CHECK(out.size() == size_t(size_), PeerError, "all_gather callback result size", out.size(),
            fmt::format("{} (one entry per rank)", size_));
  return out;
}

}  // namespace epx
