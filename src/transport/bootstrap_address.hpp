#pragma once
// Where the ranks of a UnixSocketBootstrap meet: "@name" in the Linux abstract socket namespace
// (no file; the name goes with the process that holds it), or the path of a socket file, which
// can outlive a killed rank 0 and is then recognised as stale (nothing accepts on it) and removed.

#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>

#include <cstddef>
#include <string>
#include <string_view>

namespace epx::transport {

inline constexpr size_t kMaxAddressBytes = sizeof(sockaddr_un::sun_path) - 1;  // 107 on Linux

struct SocketAddress {
  sockaddr_un addr{};
  socklen_t len = 0;
  bool abstract = false;
  std::string path;  // filesystem sockets only
};

// Throws ConfigError naming `what` (a field or an environment variable) for an address that is
// empty while world_size > 1, "@" alone, longer than kMaxAddressBytes, or holds a NUL byte. An
// optional "unix:" prefix is dropped before the checks.
void validate_address(std::string_view what, const std::string& address, int world_size);

// The sockaddr of a non-empty address that passed validate_address.
SocketAddress resolve(const std::string& address);

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
