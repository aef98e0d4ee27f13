#pragma once
// Where the ranks of a SocketBootstrap meet: "tcp://HOST:PORT" across hosts, "@name" in the Linux
// abstract socket namespace (no file; the name goes with the process that holds it), or the path
// of a socket file, which can outlive a killed rank 0 and is then recognised as stale (nothing
// accepts on it) and removed. The rest of the bootstrap sees only a SocketAddress: the family is
// the one difference between one node and several.

#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>

#include <cstddef>
#include <string>
#include <string_view>

namespace epx::transport {

inline constexpr size_t kMaxAddressBytes = sizeof(sockaddr_un::sun_path) - 1;  // 107 on Linux

struct SocketAddress {
  int family = AF_UNIX;     // AF_UNIX, AF_INET or AF_INET6
  sockaddr_storage addr{};  // where the other ranks connect
  socklen_t len = 0;
  sockaddr_storage bind_addr{};  // where rank 0 listens: addr, or over TCP the wildcard at PORT
  socklen_t bind_len = 0;
  bool abstract = false;
  std::string path;  // filesystem sockets only

  bool tcp() const { return family != AF_UNIX; }
  bool is_file() const { return family == AF_UNIX && !abstract; }
  const sockaddr* connect_sa() const { return reinterpret_cast<const sockaddr*>(&addr); }
  const sockaddr* bind_sa() const { return reinterpret_cast<const sockaddr*>(&bind_addr); }
};

// Whether `address` names a TCP endpoint ("tcp://...").
bool is_tcp_address(std::string_view address);

// The parts of "tcp://HOST:PORT" ("tcp://[v6]:PORT" gives HOST without the brackets). Throws
// ConfigError naming `what`, the value and the expected form.
struct TcpEndpoint {
  std::string host;
  int port = 0;
};
TcpEndpoint parse_tcp_address(std::string_view what, const std::string& address);

// Throws ConfigError naming `what` (a field or an environment variable) for an address that is
// empty while world_size > 1, "@" alone, longer than kMaxAddressBytes, or holds a NUL byte, and
// for a "tcp://" address not of the form tcp://HOST:PORT. An optional "unix:" prefix is dropped
// before the checks.
void validate_address(std::string_view what, const std::string& address, int world_size);

// The sockaddr of a non-empty address that passed validate_address. A TCP host name is resolved
// with getaddrinfo (the first IPv4 answer, else the first IPv6 one); one that does not resolve
// is a ConfigError.
SocketAddress resolve(const std::string& address);

// Makes a connected socket of `s` ready for the frames: TCP_NODELAY over TCP (small frames
// must not wait for Nagle's algorithm). Nothing for Unix sockets.
void tune_connection(const SocketAddress& s, int fd);

// A TCP connection to a port of this host with no listener can land on itself: the kernel may
// pick the destination port as the ephemeral source port, and the two ends meet (a simultaneous
// open). It then holds the port that rank 0 is about to listen on. True for such a connection:
// the caller closes it and tries again.
bool connected_to_itself(const SocketAddress& s, int fd);

// Whether something accepts connections at `s` (a live listener), probing with a connect.
bool someone_listens(const SocketAddress& s);

// Removes the socket file at `path` if it is still the one identified by (dev, ino).
void unlink_if_same(const std::string& path, dev_t dev, ino_t ino);

// A socket file nobody listens on any more (its rank 0 died): remove it, and say so. A process
// that dies closes its descriptors one by one, so a survivor that saw its connection close may
// still find the dying rank 0's listener for a moment: `grace_ms` is how long to keep looking.
// Abstract addresses have no file: false.
bool remove_if_stale(const SocketAddress& s, int grace_ms = 0);

}  // namespace epx::transport
