#pragma once
// The state of a SocketBootstrap (epx/bootstrap.hpp) and the steps that use it.
//
// Connections exist only between rank 0 and each other rank (a star). Start-up
// (bootstrap_rendezvous.cpp): rank 0 listens at the address, every other rank connects and says
// Hello, and rank 0 answers every rank once all have arrived, with Welcome or with a Reject that
// every rank throws. Collectives (bootstrap_collectives.cpp): rank 0 gathers each rank's part and
// sends the result to everyone, or an Abort frame carrying the error that every rank then throws.
// After any error the object refuses further collectives.

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "epx/bootstrap.hpp"
#include "epx/error.hpp"
#include "transport/bootstrap_address.hpp"
#include "transport/bootstrap_frames.hpp"

namespace epx {

namespace transport {

// Non-zero ranks wait this much longer than rank 0 for rank 0's verdict, so that when a rank is
// missing everyone hears rank 0 name it instead of timing out on their own a moment earlier.
inline constexpr int kVerdictGraceMs = 500;
inline constexpr int kStaleFileGraceMs = 200;  // see remove_if_stale
inline constexpr int kAbortSendMs = 200;       // best effort: telling the others about a failure

// "rank 2" or "ranks 2, 3, 5".
std::string rank_list(const std::vector<int>& ranks);

}  // namespace transport

struct SocketBootstrap::Impl {
  using Frame = transport::Frame;
  using FrameType = transport::FrameType;
  using IoFailure = transport::IoFailure;

  BootstrapOptions opts;
  transport::SocketAddress addr;
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
      if (owned) transport::unlink_if_same(path, dev, ino);
    }
  };
  SocketFile file;
  UniqueFd listen_fd;
  std::vector<UniqueFd> peers;  // [r]: connection to rank r ([0] unused)
  std::thread newcomers;        // answers connections that arrive after start-up
  UniqueFd stop_read, stop_write;

  // other ranks
  UniqueFd root;

  // Validates the options and meets the other ranks (start_root or start_member).
  explicit Impl(const BootstrapOptions& o);
  ~Impl();

  int n() const { return opts.world_size; }
  size_t count() const { return size_t(opts.world_size); }
  int me() const { return opts.rank; }

  std::string who(int r) const;  // "rank 2 (pid 1234)", once the pid is known
  std::string where() const;     // "bootstrap @address"

  // Marks the object failed with `msg` and throws it.
  [[noreturn]] void fail(ErrorCode code, const std::string& msg);
  // StateError naming the first error, once the object has failed.
  void check_usable() const;

  // ---- start-up, rank 0 (bootstrap_rendezvous.cpp)
  void listen_at_address();
  [[noreturn]] void reject_all(ErrorCode code, const std::string& msg, int extra = -1);
  void start_root();
  void answer_newcomers() noexcept;

  // ---- start-up, other ranks (bootstrap_rendezvous.cpp)
  void start_member();

  // ---- collectives (bootstrap_collectives.cpp)
  [[noreturn]] void abort_all(uint32_t s, ErrorCode code, const std::string& msg);
  std::vector<Frame> gather(FrameType type, uint32_t s);
  void scatter_result(FrameType type, uint32_t s, const std::string& payload,
                      const std::vector<int>& fds = {});
  std::optional<Frame> pending_verdict();
  [[noreturn]] void root_failed(const IoFailure& e, const char* what, uint32_t s);
  Frame exchange_with_root(FrameType type, uint32_t s, const std::string& payload,
                           FrameType expected, int fd = -1);
  std::vector<std::string> all_gather(const std::string& bytes);
  std::vector<UniqueFd> all_gather_fds(int fd);
};

}  // namespace epx
