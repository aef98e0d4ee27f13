// The Bootstrap interface's defaults, BootstrapOptions and CallbackBootstrap
// (include/epx/bootstrap.hpp). SocketBootstrap lives beside this file:
//   bootstrap_frames.*       framed messages and descriptor passing on a socket
//   bootstrap_address.*      tcp://HOST:PORT, "@name" and socket-file addresses, stale files
//   bootstrap_socket.hpp     the state of a SocketBootstrap
//   bootstrap_rendezvous.cpp its start-up
//   bootstrap_collectives.cpp its all_gather and all_gather_fds
// The environment (EPX_RANK, EPX_WORLD_SIZE, EPX_BOOTSTRAP, EPX_TIMEOUT_MS, and the launchers'
// variables) is read by core/env.

#include "epx/bootstrap.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <utility>

#include "core/env.hpp"
#include "epx/error.hpp"
#include "transport/bootstrap_address.hpp"

namespace epx {

void UniqueFd::reset(int fd) noexcept {
  if (fd_ >= 0) (void)::close(fd_);
  fd_ = fd;
}

void Bootstrap::barrier() { (void)all_gather(std::string()); }

std::vector<UniqueFd> Bootstrap::all_gather_fds(int /*fd*/) {
  EPX_THROW(UnsupportedError,
            "this bootstrap cannot pass file descriptors between ranks (only a "
            "SocketBootstrap on one node can); share memory through CUDA IPC handles instead");
}

// ---- options ------------------------------------------------------------------------------------

void BootstrapOptions::validate() const {
  EPX_CHECK(world_size >= 1 && world_size <= kMaxRanks, ConfigError, "world_size", world_size,
            fmt::format("in [1, kMaxRanks = {}]", kMaxRanks));
  EPX_CHECK(rank >= 0 && rank < world_size, ConfigError, "rank", rank,
            fmt::format("in [0, world_size = {})", world_size));
  EPX_CHECK(timeout_ms >= 1 && timeout_ms <= kMaxTimeoutMs, ConfigError, "timeout_ms", timeout_ms,
            fmt::format("in [1, kMaxTimeoutMs = {}]", kMaxTimeoutMs));
  transport::validate_address("address", address, world_size);
  EPX_CHECK(local_world_size >= 0 && local_world_size <= world_size, ConfigError,
            "local_world_size", local_world_size,
            fmt::format("in [0, world_size = {}] (0 = not known: one node)", world_size));
  if (local_world_size == 0) {
    EPX_CHECK(local_rank == 0, ConfigError, "local_rank", local_rank,
              "0 while local_world_size = 0 (not known)");
    return;
  }
  EPX_CHECK(world_size % local_world_size == 0, ConfigError, "local_world_size",
            local_world_size,
            fmt::format("a divisor of world_size = {} (every node has as many ranks)", world_size));
  EPX_CHECK(local_rank >= 0 && local_rank < local_world_size, ConfigError, "local_rank",
            local_rank, fmt::format("in [0, local_world_size = {})", local_world_size));
  if (rank % local_world_size != local_rank) {
    EPX_THROW(ConfigError,
              fmt::format("rank {} has local_rank = {}, expected rank % local_world_size = {}: "
                          "epx places ranks on nodes by block (node = rank / local_world_size, "
                          "ranks of one node consecutive); start the ranks with block placement",
                          rank, local_rank, rank % local_world_size));
  }
  if (num_nodes() > 1 && !transport::is_tcp_address(address)) {
    EPX_THROW(ConfigError,
              fmt::format("address = \"{}\" is a Unix socket, but the {} ranks are on {} nodes "
                          "(local_world_size = {}), expected tcp://HOST:PORT (a Unix socket "
                          "does not cross hosts)",
                          address, world_size, num_nodes(), local_world_size));
  }
}

BootstrapOptions BootstrapOptions::parse_env(const char* rank, const char* world_size,
                                             const char* address, const char* timeout_ms) {
  BootstrapOptions o = env::parse_bootstrap(rank, world_size, address, timeout_ms);
  transport::validate_address("EPX_BOOTSTRAP", o.address, o.world_size);
  return o;
}

BootstrapOptions BootstrapOptions::parse_env(const Lookup& getenv) {
  BootstrapOptions o = env::parse_launcher(getenv);
  transport::validate_address("EPX_BOOTSTRAP", o.address, o.world_size);
  o.validate();
  return o;
}

BootstrapOptions BootstrapOptions::from_env() {
  BootstrapOptions o = env::bootstrap();
  transport::validate_address("EPX_BOOTSTRAP", o.address, o.world_size);
  o.validate();
  return o;
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
