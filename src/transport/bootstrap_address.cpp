// Socket addresses of the bootstrap (bootstrap_address.hpp), and the public helpers on them:
// unique_bootstrap_address() and remove_stale_socket_file() (epx/bootstrap.hpp).

#include "transport/bootstrap_address.hpp"

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>

#include "epx/bootstrap.hpp"
#include "epx/error.hpp"

namespace epx {
namespace transport {
namespace {

std::string_view strip_scheme(std::string_view a) {
  if (a.substr(0, 5) == "unix:") a.remove_prefix(5);
  return a;
}

}  // namespace

void validate_address(std::string_view what, const std::string& address, int world_size) {
  if (address.empty()) {
    if (world_size > 1) {
      EPX_THROW(ConfigError,
                fmt::format("{} is empty, expected the socket address that all {} ranks share "
                            "(\"@name\" for the abstract namespace, or a socket file path; "
                            "`epx launch` sets EPX_BOOTSTRAP)",
                            what, world_size));
    }
    return;
  }
  const std::string_view a = strip_scheme(address);
  if (a.empty() || a == "@") {
    EPX_THROW(ConfigError, fmt::format("{} = \"{}\", expected \"@name\" or a socket file path",
                                       what, address));
  }
  const size_t bytes = a[0] == '@' ? a.size() - 1 : a.size();
  if (bytes > kMaxAddressBytes) {
    EPX_THROW(ConfigError,
              fmt::format("{} = \"{}\" is {} bytes long, expected at most {} (sockaddr_un)", what,
                          address, bytes, kMaxAddressBytes));
  }
  if (a.find('\0') != std::string_view::npos) {
    EPX_THROW(ConfigError, fmt::format("{} contains a NUL byte, expected a name or a path", what));
  }
}

SocketAddress resolve(const std::string& address) {
  const std::string_view a = strip_scheme(address);
  SocketAddress s;
  s.addr.sun_family = AF_UNIX;
  if (a[0] == '@') {
    // Abstract namespace: sun_path[0] = 0, then the name, no terminator; the length says where
    // the name ends.
    s.abstract = true;
    std::memcpy(s.addr.sun_path + 1, a.data() + 1, a.size() - 1);
    s.len = socklen_t(offsetof(sockaddr_un, sun_path) + a.size());
  } else {
    s.path = std::string(a);
    std::memcpy(s.addr.sun_path, a.data(), a.size());
    s.len = socklen_t(offsetof(sockaddr_un, sun_path) + a.size() + 1);
  }
  return s;
}

bool someone_listens(const SocketAddress& s) {
  UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!probe.valid()) return false;
  if (::connect(probe.get(), reinterpret_cast<const sockaddr*>(&s.addr), s.len) == 0) return true;
  // A full backlog (EAGAIN) still means a live listener.
  return errno == EAGAIN || errno == EINPROGRESS;
}

void unlink_if_same(const std::string& path, dev_t dev, ino_t ino) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0 && st.st_dev == dev && st.st_ino == ino &&
      S_ISSOCK(st.st_mode)) {
    (void)::unlink(path.c_str());
  }
}

bool remove_if_stale(const SocketAddress& s, int grace_ms) {
  if (s.abstract) return false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(grace_ms);
  for (;;) {
    struct stat st {};
    if (::lstat(s.path.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode)) return false;
    if (!someone_listens(s)) {
      unlink_if_same(s.path, st.st_dev, st.st_ino);
      return true;
    }
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace transport

std::string unique_bootstrap_address() {
  static std::mt19937_64 rng{std::random_device{}() ^
                             uint64_t(std::chrono::steady_clock::now().time_since_epoch().count())};
  return fmt::format("@epx-{}-{:016x}", long(::getpid()), rng());
}

bool remove_stale_socket_file(const std::string& address) {
  transport::validate_address("address", address, 1);
  if (address.empty()) return false;
  return transport::remove_if_stale(transport::resolve(address));
}

}  // namespace epx
