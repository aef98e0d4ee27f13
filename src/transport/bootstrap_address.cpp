// Socket addresses of the bootstrap (bootstrap_address.hpp), and the public helpers on them:
// unique_bootstrap_address() and remove_stale_socket_file() (epx/bootstrap.hpp).

#include "transport/bootstrap_address.hpp"

#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
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

constexpr std::string_view kTcpScheme = "tcp://";
constexpr const char* kTcpForm =
    "tcp://HOST:PORT (HOST an IPv4 address, a host name or [an IPv6 address], PORT in "
    "[1, 65535])";

std::string_view strip_scheme(std::string_view a) {
  if (a.substr(0, 5) == "unix:") a.remove_prefix(5);
  return a;
}

SocketAddress resolve_tcp(const std::string& address) {
  const TcpEndpoint ep = parse_tcp_address("address", address);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(ep.port);
  const int rc = ::getaddrinfo(ep.host.c_str(), port.c_str(), &hints, &found);
  if (rc != 0) {
    EPX_THROW(ConfigError, fmt::format("bootstrap {}: cannot resolve the host \"{}\": {}",
                                       address, ep.host, ::gai_strerror(rc)));
  }
  // The first IPv4 answer, else the first IPv6 one: a name with both ("localhost") then works
  // on hosts without IPv6 too.
  SocketAddress s;
  for (const int family : {AF_INET, AF_INET6}) {
    for (const addrinfo* ai = found; ai != nullptr && s.len == 0; ai = ai->ai_next) {
      if (ai->ai_family != family || ai->ai_addrlen > sizeof(s.addr)) continue;
      s.family = ai->ai_family;
      std::memcpy(&s.addr, ai->ai_addr, ai->ai_addrlen);
      s.len = socklen_t(ai->ai_addrlen);
    }
  }
  ::freeaddrinfo(found);
  if (s.len == 0) {
    EPX_THROW(ConfigError, fmt::format("bootstrap {}: the host \"{}\" has no IPv4 or IPv6 "
                                       "address",
                                       address, ep.host));
  }
  // Rank 0 listens on PORT of every interface: the name the others use for its host may
  // resolve differently there (127.0.1.1 for its own name on many distributions).
  if (s.family == AF_INET) {
    sockaddr_in any{};
    any.sin_family = AF_INET;
    any.sin_addr.s_addr = htonl(INADDR_ANY);
    any.sin_port = htons(uint16_t(ep.port));
    std::memcpy(&s.bind_addr, &any, sizeof(any));
    s.bind_len = sizeof(any);
  } else {
    sockaddr_in6 any{};
    any.sin6_family = AF_INET6;
    any.sin6_addr = in6addr_any;
    any.sin6_port = htons(uint16_t(ep.port));
    std::memcpy(&s.bind_addr, &any, sizeof(any));
    s.bind_len = sizeof(any);
  }
  return s;
}

}  // namespace

bool is_tcp_address(std::string_view address) {
  return address.substr(0, kTcpScheme.size()) == kTcpScheme;
}

TcpEndpoint parse_tcp_address(std::string_view what, const std::string& address) {
  auto bad = [&](std::string_view why) {
    EPX_THROW(ConfigError,
              fmt::format("{} = \"{}\" {}, expected {}", what, address, why, kTcpForm));
  };
  std::string_view a(address);
  if (!is_tcp_address(a)) bad("is not a TCP address");
  a.remove_prefix(kTcpScheme.size());
  TcpEndpoint ep;
  std::string_view port;
  if (!a.empty() && a[0] == '[') {
    const size_t close = a.find(']');
    if (close == std::string_view::npos) bad("has no ']' after the IPv6 address");
    ep.host = std::string(a.substr(1, close - 1));
    const std::string_view rest = a.substr(close + 1);
    if (rest.empty() || rest[0] != ':') bad("has no \":PORT\" after the host");
    port = rest.substr(1);
  } else {
    const size_t colon = a.rfind(':');
    if (colon == std::string_view::npos) bad("has no \":PORT\"");
    ep.host = std::string(a.substr(0, colon));
    if (ep.host.find(':') != std::string::npos) bad("has an IPv6 address without brackets");
    port = a.substr(colon + 1);
  }
  if (ep.host.empty()) bad("has no host");
  for (const char c : ep.host) {
    if (c == '\0' || c == '/' || c == '[' || c == ']' ||
        std::isspace(static_cast<unsigned char>(c)) != 0) {
      bad("has a malformed host");
    }
  }
  const bool digits = !port.empty() && port.size() <= 5 &&
                      std::all_of(port.begin(), port.end(), [](char c) {
                        return std::isdigit(static_cast<unsigned char>(c)) != 0;
                      });
  const int value = digits ? std::stoi(std::string(port)) : 0;
  if (value < 1 || value > 65535) bad("has a malformed port");
  ep.port = value;
  return ep;
}

void validate_address(std::string_view what, const std::string& address, int world_size) {
  if (is_tcp_address(address)) {
    (void)parse_tcp_address(what, address);
    return;
  }
  if (address.empty()) {
    if (world_size > 1) {
      EPX_THROW(ConfigError,
                fmt::format("{} is empty, expected the socket address that all {} ranks share "
                            "(\"@name\" for the abstract namespace, a socket file path, or "
                            "tcp://HOST:PORT across hosts; `epx launch` sets EPX_BOOTSTRAP)",
                            what, world_size));
    }
    return;
  }
  const std::string_view a = strip_scheme(address);
  if (a.empty() || a == "@") {
    EPX_THROW(ConfigError, fmt::format("{} = \"{}\", expected \"@name\" or a socket file path "
                                       "(or tcp://HOST:PORT)",
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
  if (is_tcp_address(address)) return resolve_tcp(address);
  const std::string_view a = strip_scheme(address);
  SocketAddress s;
  sockaddr_un un{};
  un.sun_family = AF_UNIX;
  if (a[0] == '@') {
    // Abstract namespace: sun_path[0] = 0, then the name, no terminator; the length says where
    // the name ends.
    s.abstract = true;
    std::memcpy(un.sun_path + 1, a.data() + 1, a.size() - 1);
    s.len = socklen_t(offsetof(sockaddr_un, sun_path) + a.size());
  } else {
    s.path = std::string(a);
    std::memcpy(un.sun_path, a.data(), a.size());
    s.len = socklen_t(offsetof(sockaddr_un, sun_path) + a.size() + 1);
  }
  std::memcpy(&s.addr, &un, sizeof(un));
  s.bind_addr = s.addr;
  s.bind_len = s.len;
  return s;
}

void tune_connection(const SocketAddress& s, int fd) {
  if (!s.tcp()) return;
  const int on = 1;
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
}

bool connected_to_itself(const SocketAddress& s, int fd) {
  if (!s.tcp()) return false;
  sockaddr_storage here{}, there{};
  socklen_t here_len = sizeof(here), there_len = sizeof(there);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&here), &here_len) != 0 ||
      ::getpeername(fd, reinterpret_cast<sockaddr*>(&there), &there_len) != 0) {
    return false;
  }
  return here_len == there_len && std::memcmp(&here, &there, here_len) == 0;
}

bool someone_listens(const SocketAddress& s) {
  UniqueFd probe(::socket(s.family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!probe.valid()) return false;
  if (::connect(probe.get(), s.connect_sa(), s.len) == 0) return true;
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
  if (!s.is_file()) return false;
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
  if (address.empty() || transport::is_tcp_address(address)) return false;
  return transport::remove_if_stale(transport::resolve(address));
}

}  // namespace epx
