// The shared harness of the bootstrap, fingerprint and launcher tests (bootstrap_harness.hpp).

#include "bootstrap_harness.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <thread>

namespace epx {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

BootstrapOptions options(int rank, int size, const std::string& address, int timeout_ms) {
  BootstrapOptions o;
  o.rank = rank;
  o.world_size = size;
  o.address = address;
  o.timeout_ms = timeout_ms;
  return o;
}

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

Outcome run_rank(const std::function<void()>& body, Clock::time_point t0) {
  Outcome o;
  try {
    body();
    o.ok = true;
  } catch (const Error& e) {
    o.epx_error = true;
    o.code = e.code();
    o.message = e.what();
  } catch (const std::exception& e) {
    o.message = e.what();
  }
  o.seconds = seconds_since(t0);
  return o;
}

std::vector<Outcome> run_threads(int n, const std::function<void(int)>& body) {
  std::vector<Outcome> out(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  const auto t0 = Clock::now();
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] { out[size_t(r)] = run_rank([&] { body(r); }, t0); });
  }
  for (auto& t : threads) t.join();
  return out;
}

std::vector<Outcome> run_processes(int n, const std::function<void(int)>& body) {
  std::vector<pid_t> pids;
  std::vector<int> reads;
  const auto t0 = Clock::now();
  for (int r = 0; r < n; ++r) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) throw std::runtime_error("pipe2");
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork");
    if (pid == 0) {
      ::close(p[0]);
      const Outcome o = run_rank([&] { body(r); }, t0);
      const std::string report = std::string(o.ok ? "1" : "0") + (o.epx_error ? "1" : "0") +
                                 std::to_string(int(o.code)) + "\n" + o.message;
      size_t off = 0;
      while (off < report.size()) {
        const ssize_t w = ::write(p[1], report.data() + off, report.size() - off);
        if (w <= 0) break;
        off += size_t(w);
      }
      _exit(0);
    }
    ::close(p[1]);
    pids.push_back(pid);
    reads.push_back(p[0]);
  }
  std::vector<Outcome> out(static_cast<size_t>(n));
  std::vector<std::string> text(static_cast<size_t>(n));
  std::vector<bool> done(static_cast<size_t>(n), false);
  int remaining = n;
  while (remaining > 0) {
    std::vector<pollfd> pfds;
    std::vector<int> idx;
    for (int r = 0; r < n; ++r) {
      if (reads[size_t(r)] < 0) continue;
      pfds.push_back({reads[size_t(r)], POLLIN, 0});
      idx.push_back(r);
    }
    if (pfds.empty()) break;
    (void)::poll(pfds.data(), pfds.size(), 100);
    for (size_t i = 0; i < pfds.size(); ++i) {
      if (pfds[i].revents == 0) continue;
      const int r = idx[i];
      char buf[4096];
      const ssize_t got = ::read(reads[size_t(r)], buf, sizeof(buf));
      if (got > 0) {
        text[size_t(r)].append(buf, size_t(got));
      } else {
        ::close(reads[size_t(r)]);
        reads[size_t(r)] = -1;
        out[size_t(r)].seconds = seconds_since(t0);
      }
    }
    if (seconds_since(t0) > 20) {
      for (pid_t pid : pids) ::kill(pid, SIGKILL);
    }
  }
  for (int r = 0; r < n; ++r) {
    int status = 0;
    ::waitpid(pids[size_t(r)], &status, 0);
    Outcome& o = out[size_t(r)];
    o.wait_status = status;
    const std::string& t = text[size_t(r)];
    const size_t eol = t.find('\n');
    if (eol == std::string::npos || eol < 3) {
      o.message = "no report (the process died)";
      continue;
    }
    o.ok = t[0] == '1';
    o.epx_error = t[1] == '1';
    o.code = ErrorCode(std::atoi(t.substr(2, eol - 2).c_str()));
    o.message = t.substr(eol + 1);
  }
  return out;
}

::testing::AssertionResult succeeded(const Outcome& o) {
  if (o.ok) return testing::AssertionSuccess();
  return testing::AssertionFailure() << "threw: " << o.message;
}

::testing::AssertionResult failed_with(const Outcome& o, ErrorCode code,
                                       std::initializer_list<std::string> parts) {
  if (o.ok) return testing::AssertionFailure() << "did not throw";
  if (!o.epx_error) return testing::AssertionFailure() << "threw a non-epx error: " << o.message;
  if (o.code != code) {
    return testing::AssertionFailure() << "threw " << to_string(o.code) << " (wanted "
                                       << to_string(code) << "): " << o.message;
  }
  for (const std::string& p : parts) {
    if (o.message.find(p) == std::string::npos) {
      return testing::AssertionFailure() << "message \"" << o.message << "\" lacks \"" << p << "\"";
    }
  }
  return testing::AssertionSuccess() << o.message;
}

TempDir::TempDir() {
  char tmpl[] = "/tmp/epx-bootstrap-test-XXXXXX";
  const char* d = ::mkdtemp(tmpl);
  if (d == nullptr) throw std::runtime_error("mkdtemp");
  path_ = d;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

std::string loopback_tcp_address() {
  UniqueFd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (!s.valid() || ::bind(s.get(), reinterpret_cast<const sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(s.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    throw std::runtime_error("no free TCP port on 127.0.0.1");
  }
  return "tcp://127.0.0.1:" + std::to_string(ntohs(a.sin_port));
}

std::string payload(int rank, int round) {
  std::string p = "rank " + std::to_string(rank) + " round " + std::to_string(round) + ":";
  const size_t extra = (round == 2 && rank == 1) ? 300000 : size_t(rank) * 37 * size_t(round);
  p.append(extra, char('a' + (rank + round) % 26));
  return p;
}

void gather_rounds(Bootstrap& b) {
  const int n = b.size();
  for (int round = 0; round < 3; ++round) {
    const std::vector<std::string> all = b.all_gather(payload(b.rank(), round));
    require(int(all.size()) == n, "all_gather returned " + std::to_string(all.size()) + " parts");
    for (int q = 0; q < n; ++q) {
      require(all[size_t(q)] == payload(q, round),
              "round " + std::to_string(round) + ": part of rank " + std::to_string(q));
    }
  }
  b.barrier();
  const std::vector<std::string> empty = b.all_gather(std::string());
  for (const std::string& e : empty) require(e.empty(), "empty all_gather");
}

void check_pids(SocketBootstrap& b) {
  const std::vector<std::string> pids = b.all_gather(std::to_string(::getpid()));
  for (int q = 0; q < b.size(); ++q) {
    require(std::to_string(b.pids()[size_t(q)]) == pids[size_t(q)],
            "pid of rank " + std::to_string(q));
  }
}

EpConfig job_config() {
  EpConfig c;
  c.world_size = 3;
  c.hidden = 7168;
  c.num_experts = 48;
  c.topk = 8;
  c.max_tokens_per_rank = 128;
  return c;
}

CommandResult run_command(const std::vector<std::string>& argv,
                          const std::vector<std::pair<std::string, std::string>>& env) {
  int out_p[2], err_p[2];
  if (::pipe2(out_p, O_CLOEXEC) != 0 || ::pipe2(err_p, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
  const auto t0 = Clock::now();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out_p[1], STDOUT_FILENO);
    ::dup2(err_p[1], STDERR_FILENO);
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    _exit(127);
  }
  ::close(out_p[1]);
  ::close(err_p[1]);
  CommandResult r;
  int fds[2] = {out_p[0], err_p[0]};
  std::string* sinks[2] = {&r.out, &r.err};
  while (fds[0] >= 0 || fds[1] >= 0) {
    pollfd p[2] = {{fds[0], POLLIN, 0}, {fds[1], POLLIN, 0}};
    (void)::poll(p, 2, 100);
    for (int i = 0; i < 2; ++i) {
      if (fds[i] < 0 || p[i].revents == 0) continue;
      char buf[4096];
      const ssize_t n = ::read(fds[i], buf, sizeof(buf));
      if (n > 0) {
        sinks[i]->append(buf, size_t(n));
      } else {
        ::close(fds[i]);
        fds[i] = -1;
      }
    }
    if (seconds_since(t0) > 20) ::kill(pid, SIGKILL);
  }
  ::waitpid(pid, &r.status, 0);
  r.seconds = seconds_since(t0);
  return r;
}

int exit_code(const CommandResult& r) { return WIFEXITED(r.status) ? WEXITSTATUS(r.status) : -1; }

std::string self_exe() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

}  // namespace epx
