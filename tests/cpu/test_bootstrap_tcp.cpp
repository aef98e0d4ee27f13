// SocketBootstrap over TCP (tcp://HOST:PORT, include/epx/bootstrap.hpp) on 127.0.0.1: all-gather
// and barrier over threads and over forked processes, a rank 0 that comes late, a host name and
// an IPv6 address, no descriptor passing, a port already taken, a rank that never arrives, ranks
// killed mid-collective, and malformed addresses. Timing bounds: bootstrap_harness.hpp.

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "bootstrap_harness.hpp"
#include "epx/bootstrap.hpp"
#include "epx/error.hpp"
#include "transport/bootstrap_address.hpp"

namespace epx {
namespace {

TEST(TcpBootstrap, AllGatherOverThreads) {
  for (const int n : {1, 2, 4}) {
    const std::string address = loopback_tcp_address();
    const auto out = run_threads(n, [&](int r) {
      SocketBootstrap b(options(r, n, address));
      require(b.rank() == r && b.size() == n, "rank/size");
      require(!b.can_pass_fds() || n == 1, "no descriptors over TCP");
      gather_rounds(b);
    });
    for (int r = 0; r < n; ++r) EXPECT_TRUE(succeeded(out[size_t(r)])) << n << " ranks, rank " << r;
  }
}

TEST(TcpBootstrap, AllGatherOverProcesses) {
  const int n = 4;
  const std::string address = loopback_tcp_address();
  const auto out = run_processes(n, [&](int r) {
    SocketBootstrap b(options(r, n, address));
    gather_rounds(b);
    check_pids(b);  // every rank learnt every rank's pid at start-up
  });
  for (int r = 0; r < n; ++r) EXPECT_TRUE(succeeded(out[size_t(r)])) << "rank " << r;
}

TEST(TcpBootstrap, RanksWaitForALateRankZero) {
  const std::string address = loopback_tcp_address();
  const auto out = run_threads(3, [&](int r) {
    if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    SocketBootstrap b(options(r, 3, address));
    b.barrier();
  });
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(succeeded(out[size_t(r)])) << "rank " << r;
}

TEST(TcpBootstrap, HostNameIsResolved) {
  const std::string port = loopback_tcp_address().substr(std::string("tcp://127.0.0.1:").size());
  const std::string address = "tcp://localhost:" + port;
  const auto out = run_threads(2, [&](int r) {
    SocketBootstrap b(options(r, 2, address));
    gather_rounds(b);
  });
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(succeeded(out[size_t(r)])) << "rank " << r;
}

TEST(TcpBootstrap, Ipv6AddressInBrackets) {
  UniqueFd probe(::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  socklen_t len = sizeof(a);
  if (!probe.valid() || ::bind(probe.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(probe.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    GTEST_SKIP() << "no IPv6 loopback on this host";
  }
  const std::string address = "tcp://[::1]:" + std::to_string(ntohs(a.sin6_port));
  probe.reset();
  const auto out = run_threads(2, [&](int r) {
    SocketBootstrap b(options(r, 2, address));
    gather_rounds(b);
  });
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(succeeded(out[size_t(r)])) << "rank " << r;
}

TEST(TcpBootstrap, DescriptorsDoNotPass) {
  const std::string address = loopback_tcp_address();
  const auto out = run_threads(2, [&](int r) {
    SocketBootstrap b(options(r, 2, address));
    require(!b.can_pass_fds(), "can_pass_fds() is false over TCP");
    (void)b.all_gather_fds(0);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(failed_with(out[size_t(r)], ErrorCode::kUnsupported,
                            {"descriptors cannot pass over TCP", address}))
        << "rank " << r;
  }
}

TEST(TcpBootstrap, PortInUseIsAConfigError) {
  const std::string address = loopback_tcp_address();
  const std::string port = address.substr(std::string("tcp://127.0.0.1:").size());
  // Another program listens on the port, on every interface.
  UniqueFd other(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(uint16_t(std::stoi(port)));
  ASSERT_EQ(::bind(other.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(other.get(), 4), 0);
  EXPECT_TRUE(throws_config_error([&] { SocketBootstrap b(options(0, 2, address)); },
                                  {address, "port is already in use"}));
}

// While rank 0 is late, a member's connect to a port of this host can meet itself (the kernel
// picks the destination port as the source port: a simultaneous open), and would hold the port
// rank 0 is about to listen on. The member recognises such a socket and tries again; a
// connection to a real listener is not mistaken for one.
TEST(TcpBootstrap, AConnectionToItselfIsRecognised) {
  const auto loopback = [](int port) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    return a;
  };
  const auto port_of = [](int fd) {
    sockaddr_in a{};
    socklen_t len = sizeof(a);
    EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
    return static_cast<int>(ntohs(a.sin_port));
  };
  const auto tcp = [](int port) {
    return transport::resolve("tcp://127.0.0.1:" + std::to_string(port));
  };
  const sockaddr_in any = loopback(0);
  // Bound to a free port, then connected to that same port.
  const int self = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(self, 0);
  ASSERT_EQ(::bind(self, reinterpret_cast<const sockaddr*>(&any), sizeof(any)), 0);
  const int p = port_of(self);
  const sockaddr_in to_self = loopback(p);
  ASSERT_EQ(::connect(self, reinterpret_cast<const sockaddr*>(&to_self), sizeof(to_self)), 0)
      << std::strerror(errno);
  EXPECT_TRUE(transport::connected_to_itself(tcp(p), self));
  ::close(self);
  // A client of a listener.
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  ASSERT_EQ(::bind(listener, reinterpret_cast<const sockaddr*>(&any), sizeof(any)), 0);
  ASSERT_EQ(::listen(listener, 1), 0);
  const int q = port_of(listener);
  const int client = ::socket(AF_INET, SOCK_STREAM, 0);
  const sockaddr_in to_listener = loopback(q);
  ASSERT_EQ(::connect(client, reinterpret_cast<const sockaddr*>(&to_listener),
                      sizeof(to_listener)),
            0);
  EXPECT_FALSE(transport::connected_to_itself(tcp(q), client));
  ::close(client);
  ::close(listener);
}

TEST(TcpBootstrap, RankThatNeverArrivesIsNamed) {
  const std::string address = loopback_tcp_address();
  const int timeout_ms = 300;
  const auto out =
      run_threads(2, [&](int r) { SocketBootstrap b(options(r, 3, address, timeout_ms)); });
  for (const auto& o : out) {
    EXPECT_TRUE(failed_with(o, ErrorCode::kTimeout,
                            {"rank 2 of 3 did not arrive within 300 ms", "arrived: ranks 0, 1"}));
    EXPECT_LT(o.seconds, timeout_ms / 1000.0 + 1.0);
  }
}

TEST(TcpBootstrap, RankZeroThatNeverArrivesIsNamed) {
  const std::string address = loopback_tcp_address();
  const Outcome o = run_rank([&] { SocketBootstrap b(options(1, 2, address, 300)); }, Clock::now());
  EXPECT_TRUE(failed_with(o, ErrorCode::kTimeout, {"rank 0 did not arrive within 300 ms"}));
  EXPECT_LT(o.seconds, 1.3);
}

TEST(TcpBootstrap, RankKilledMidCollectiveIsNamed) {
  for (const int victim : {2, 0}) {
    const std::string address = loopback_tcp_address();
    const auto out = run_processes(3, [&](int r) {
      SocketBootstrap b(options(r, 3, address, 5000));
      (void)b.all_gather("first");
      if (r == victim) ::raise(SIGKILL);
      (void)b.all_gather("second");
    });
    ASSERT_TRUE(WIFSIGNALED(out[size_t(victim)].wait_status));
    for (int r = 0; r < 3; ++r) {
      if (r == victim) continue;
      EXPECT_TRUE(failed_with(
          out[size_t(r)], ErrorCode::kPeer,
          {"all_gather #2", "rank " + std::to_string(victim) + " (pid", "disconnected"}))
          << "victim " << victim << ", rank " << r;
      EXPECT_LT(out[size_t(r)].seconds, 2.0) << "detected, not timed out";
    }
  }
}

TEST(TcpBootstrap, MalformedAddressesAreConfigErrors) {
  const char* bad[] = {
      "tcp://",           "tcp://host",     "tcp://:80",      "tcp://host:",      "tcp://host:0",
      "tcp://host:65536", "tcp://host:80x", "tcp://host:-1",  "tcp://::1:80",     "tcp://[::1",
      "tcp://[::1]80",    "tcp://[]:80",    "tcp://ho st:80", "tcp://host:123456"};
  for (const char* a : bad) {
    EXPECT_TRUE(throws_config_error([&] { options(0, 2, a).validate(); },
                                    {"address = \"" + std::string(a) + "\"", "tcp://HOST:PORT"}))
        << a;
    EXPECT_TRUE(
        throws_config_error([&] { (void)BootstrapOptions::parse_env("1", "2", a, nullptr); },
                            {"EPX_BOOTSTRAP = \"" + std::string(a) + "\"", "tcp://HOST:PORT"}))
        << a;
  }
  // Well-formed ones pass.
  for (const char* a :
       {"tcp://10.0.0.1:29501", "tcp://node-17.cluster:1", "tcp://[fe80::1]:65535"}) {
    EXPECT_NO_THROW(options(0, 2, a).validate()) << a;
  }
  // A host name that does not resolve: named at construction.
  EXPECT_TRUE(throws_config_error(
      [] { SocketBootstrap b(options(1, 2, "tcp://no-such-host.invalid:29501", 300)); },
      {"cannot resolve the host \"no-such-host.invalid\""}));
}

}  // namespace
}  // namespace epx
