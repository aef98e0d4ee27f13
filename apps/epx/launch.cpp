// `epx launch -n N [--bootstrap ADDR] [--grace-ms MS] -- command args...`: starts N ranks of any
// command on this node (an epx subcommand, a test binary, a Python script), each with EPX_RANK,
// EPX_WORLD_SIZE and EPX_BOOTSTRAP set, forwards their output line by line with a "[rank i] "
// prefix, and stops the others as soon as one fails. No GPU needed.
//
// Each rank runs in its own process group (so a shell's children are stopped with it) and dies
// with the launcher (PR_SET_PDEATHSIG). Rank 0 inherits the launcher's stdin, the others read
// /dev/null. Exit code: 0 when every rank exited 0; otherwise that of the first rank that failed
// (its exit code, or 128 + the signal that killed it), or 128 + the signal that stopped the
// launcher.

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "commands.hpp"
#include "epx/bootstrap.hpp"
#include "epx/config.hpp"
#include "epx/error.hpp"

namespace epx::cli {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kReadChunk = 64 * 1024;
constexpr size_t kMaxLineBytes = 64 * 1024;  // a longer line is forwarded in pieces
constexpr int kPollMs = 100;

struct LaunchFlags {
  int ranks = 0;
  std::string bootstrap;
  int grace_ms = 3000;
  std::vector<std::string> command;
};

// Signals reach the main loop through a pipe (the handler only writes the signal number).
int g_signal_pipe = -1;

extern "C" void forward_signal_to_pipe(int sig) {
  const int saved = errno;
  const unsigned char byte = static_cast<unsigned char>(sig);
  if (g_signal_pipe >= 0) (void)!::write(g_signal_pipe, &byte, 1);
  errno = saved;
}

const char* signal_name(int sig) {
  switch (sig) {
    case SIGHUP: return "SIGHUP";
    case SIGINT: return "SIGINT";
    case SIGQUIT: return "SIGQUIT";
    case SIGILL: return "SIGILL";
    case SIGTRAP: return "SIGTRAP";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGKILL: return "SIGKILL";
    case SIGUSR1: return "SIGUSR1";
    case SIGSEGV: return "SIGSEGV";
    case SIGUSR2: return "SIGUSR2";
    case SIGPIPE: return "SIGPIPE";
    case SIGALRM: return "SIGALRM";
    case SIGTERM: return "SIGTERM";
    default: return "?";
  }
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return fmt::format("killed by signal {} ({})", sig, signal_name(sig));
  }
  return fmt::format("ended with wait status {:#x}", status);
}

bool succeeded(int status) { return WIFEXITED(status) && WEXITSTATUS(status) == 0; }

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

void write_all(int fd, std::string_view s) {
  while (!s.empty()) {
    const ssize_t n = ::write(fd, s.data(), s.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    s.remove_prefix(size_t(n));
  }
}

void say(const std::string& line) { write_all(STDERR_FILENO, "epx launch: " + line + "\n"); }

// One output stream of one rank: a pipe and the part of a line not yet forwarded.
struct Stream {
  int fd = -1;
  int to = -1;  // the launcher's stdout or stderr
  std::string pending;
};

struct Rank {
  pid_t pid = -1;
  Stream out, err;
  bool reaped = false;
  int status = 0;
  bool signalled = false;  // stopped by the launcher
};

// Forwards every complete line of `s` with the rank prefix; `all` also forwards the rest.
void forward_lines(Stream& s, int rank, bool all) {
  const std::string prefix = fmt::format("[rank {}] ", rank);
  size_t start = 0;
  std::string out;
  for (;;) {
    const size_t eol = s.pending.find('\n', start);
    if (eol == std::string::npos) break;
    out += prefix;
    out.append(s.pending, start, eol - start + 1);
    start = eol + 1;
  }
  s.pending.erase(0, start);
  if (!s.pending.empty() && (all || s.pending.size() >= kMaxLineBytes)) {
    out += prefix + s.pending + "\n";
    s.pending.clear();
  }
  if (!out.empty()) write_all(s.to, out);
}

// Reads what is available; false once the stream is closed (EOF or error).
bool pump(Stream& s, int rank) {
  char buf[kReadChunk];
  const ssize_t n = ::read(s.fd, buf, sizeof(buf));
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return true;
  if (n <= 0) {
    forward_lines(s, rank, true);
    ::close(s.fd);
    s.fd = -1;
    return false;
  }
  s.pending.append(buf, size_t(n));
  forward_lines(s, rank, false);
  return true;
}

// Restores the launcher's signal dispositions and closes the signal pipe when the command ends.
class SignalRoute {
 public:
  SignalRoute() {
    int p[2];
    if (::pipe2(p, O_CLOEXEC | O_NONBLOCK) != 0) {
      EPX_THROW(StateError, fmt::format("epx launch: pipe2: {}", std::strerror(errno)));
    }
    read_fd_ = p[0];
    write_fd_ = p[1];
    g_signal_pipe = write_fd_;
    struct sigaction sa {};
    sa.sa_handler = forward_signal_to_pipe;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    for (size_t i = 0; i < kSignals.size(); ++i) ::sigaction(kSignals[i], &sa, &old_[i]);
  }
  ~SignalRoute() {
    for (size_t i = 0; i < kSignals.size(); ++i) ::sigaction(kSignals[i], &old_[i], nullptr);
    g_signal_pipe = -1;
    ::close(read_fd_);
    ::close(write_fd_);
  }
  SignalRoute(const SignalRoute&) = delete;
  SignalRoute& operator=(const SignalRoute&) = delete;

  int fd() const { return read_fd_; }

  // Held around fork(): a signal that arrives before the child has restored the default
  // dispositions stays pending instead of running the launcher's handler in the child (where it
  // would be lost), and takes its default effect once the child unblocks it.
  class BlockedForFork {
   public:
    BlockedForFork() {
      sigset_t set;
      sigemptyset(&set);
      for (int sig : kSignals) sigaddset(&set, sig);
      ::sigprocmask(SIG_BLOCK, &set, &old_);
    }
    ~BlockedForFork() { ::sigprocmask(SIG_SETMASK, &old_, nullptr); }
    BlockedForFork(const BlockedForFork&) = delete;
    BlockedForFork& operator=(const BlockedForFork&) = delete;

   private:
    sigset_t old_;
  };

  // In a child before exec (signals still blocked): default dispositions, then unblocked.
  static void reset_in_child() {
    for (int sig : kSignals) ::signal(sig, SIG_DFL);
    sigset_t set;
    sigemptyset(&set);
    for (int sig : kSignals) sigaddset(&set, sig);
    ::sigprocmask(SIG_UNBLOCK, &set, nullptr);
  }

 private:
  static constexpr std::array<int, 4> kSignals{SIGCHLD, SIGINT, SIGTERM, SIGHUP};
  int read_fd_ = -1, write_fd_ = -1;
  std::array<struct sigaction, 4> old_{};
};

// fork + exec of one rank. Runs in the child only after fork: the launcher has no other threads.
[[noreturn]] void exec_rank(const LaunchFlags& f, const std::string& address, int rank,
                            pid_t launcher, int out_w, int err_w) {
  ::setpgid(0, 0);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher) _exit(127);  // the launcher died before prctl took effect
  SignalRoute::reset_in_child();
  ::dup2(out_w, STDOUT_FILENO);
  ::dup2(err_w, STDERR_FILENO);
  if (rank != 0) {
    const int null_fd = ::open("/dev/null", O_RDONLY);
    if (null_fd >= 0) ::dup2(null_fd, STDIN_FILENO);
  }
  ::setenv("EPX_RANK", std::to_string(rank).c_str(), 1);
  ::setenv("EPX_WORLD_SIZE", std::to_string(f.ranks).c_str(), 1);
  ::setenv("EPX_BOOTSTRAP", address.c_str(), 1);
  std::vector<char*> argv;
  for (const std::string& a : f.command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  const std::string msg = fmt::format("epx launch: cannot run {}: {}\n", f.command[0],
                                      std::strerror(errno));
  write_all(STDERR_FILENO, msg);
  _exit(127);
}

int run_launch(const LaunchFlags& f) {
  EPX_CHECK(f.ranks >= 1 && f.ranks <= kMaxRanks, ConfigError, "-n", f.ranks,
            fmt::format("in [1, kMaxRanks = {}]", kMaxRanks));
  EPX_CHECK(f.grace_ms >= 0, ConfigError, "--grace-ms", f.grace_ms, ">= 0");
  EPX_CHECK(!f.command.empty(), ConfigError, "command", "(none)",
            "a command after --, e.g. epx launch -n 2 -- epx check");
  const std::string address = f.bootstrap.empty() ? unique_bootstrap_address() : f.bootstrap;
  BootstrapOptions check;
  check.world_size = f.ranks;
  check.address = address;
  try {
    check.validate();
  } catch (const ConfigError& e) {
    throw ConfigError(std::string("--bootstrap: ") + e.what());  // the flag that gave it
  }

  SignalRoute signals;
  std::vector<Rank> ranks(size_t(f.ranks));
  const pid_t launcher = ::getpid();
  auto stop_all = [&](int sig, bool only_unreaped) {
    for (Rank& r : ranks) {
      if (r.pid <= 0 || (only_unreaped && r.reaped)) continue;
      if (!r.reaped) r.signalled = true;
      if (::kill(-r.pid, sig) != 0) (void)::kill(r.pid, sig);
    }
  };

  for (int i = 0; i < f.ranks; ++i) {
    int out_p[2], err_p[2];
    if (::pipe2(out_p, O_CLOEXEC) != 0 || ::pipe2(err_p, O_CLOEXEC) != 0) {
      stop_all(SIGKILL, true);
      EPX_THROW(StateError, fmt::format("epx launch: pipe2: {}", std::strerror(errno)));
    }
    pid_t pid = -1;
    {
      const SignalRoute::BlockedForFork blocked;
      pid = ::fork();
      if (pid == 0) exec_rank(f, address, i, launcher, out_p[1], err_p[1]);
    }
    if (pid < 0) {
      stop_all(SIGKILL, true);
      EPX_THROW(StateError, fmt::format("epx launch: fork of rank {}: {}", i, std::strerror(errno)));
    }
    (void)::setpgid(pid, pid);  // also here, so that stop_all reaches it even before it runs
    ::close(out_p[1]);
    ::close(err_p[1]);
    Rank& r = ranks[size_t(i)];
    r.pid = pid;
    r.out = Stream{out_p[0], STDOUT_FILENO, {}};
    r.err = Stream{err_p[0], STDERR_FILENO, {}};
  }

  int first_failed = -1;
  int stop_signal = 0;  // a signal that stopped the launcher itself
  bool stopping = false, killed = false;
  Clock::time_point kill_at{};
  std::optional<Clock::time_point> drain_until;
  int unreaped = f.ranks;
  auto begin_stop = [&](int sig) {
    stopping = true;
    kill_at = Clock::now() + std::chrono::milliseconds(f.grace_ms);
    stop_all(sig, false);
  };

  for (;;) {
    std::vector<pollfd> pfds{{signals.fd(), POLLIN, 0}};
    std::vector<std::pair<int, Stream*>> streams;
    for (int i = 0; i < f.ranks; ++i) {
      for (Stream* s : {&ranks[size_t(i)].out, &ranks[size_t(i)].err}) {
        if (s->fd < 0) continue;
        pfds.push_back({s->fd, POLLIN, 0});
        streams.emplace_back(i, s);
      }
    }
    int wait_ms = kPollMs;
    if (stopping && !killed) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(kill_at - Clock::now()).count();
      wait_ms = int(std::clamp<long long>(left, 0, kPollMs));
    }
    (void)::poll(pfds.data(), pfds.size(), wait_ms);

    if ((pfds[0].revents & POLLIN) != 0) {
      unsigned char sig = 0;
      while (::read(signals.fd(), &sig, 1) == 1) {
        if (sig != SIGCHLD && stop_signal == 0) stop_signal = sig;
      }
    }
    for (size_t i = 0; i < streams.size(); ++i) {
      if (pfds[1 + i].revents != 0) (void)pump(*streams[i].second, streams[i].first);
    }
    for (int i = 0; i < f.ranks; ++i) {
      Rank& r = ranks[size_t(i)];
      if (r.reaped) continue;
      int status = 0;
      if (::waitpid(r.pid, &status, WNOHANG) != r.pid) continue;
      r.reaped = true;
      r.status = status;
      --unreaped;
      if (!succeeded(status) && first_failed < 0 && !stopping) {
        first_failed = i;
        say(fmt::format("rank {} failed: {}; stopping the other ranks (SIGTERM, then SIGKILL "
                        "after {} ms)",
                        i, describe_status(status), f.grace_ms));
        begin_stop(SIGTERM);
      }
    }
    if (stop_signal != 0 && !stopping) {
      say(fmt::format("got {}; stopping every rank", signal_name(stop_signal)));
      begin_stop(stop_signal == SIGHUP ? SIGTERM : stop_signal);
    }
    if (stopping && !killed && Clock::now() >= kill_at && unreaped > 0) {
      stop_all(SIGKILL, true);
      killed = true;
    }
    if (unreaped == 0) {
      const bool open = std::any_of(ranks.begin(), ranks.end(), [](const Rank& r) {
        return r.out.fd >= 0 || r.err.fd >= 0;
      });
      // A rank's own children may keep its pipes open after it exited: wait a little, not forever.
      if (!drain_until) drain_until = Clock::now() + std::chrono::milliseconds(std::min(f.grace_ms, 1000));
      if (!open || Clock::now() >= *drain_until) break;
    }
  }
  for (int i = 0; i < f.ranks; ++i) {
    for (Stream* s : {&ranks[size_t(i)].out, &ranks[size_t(i)].err}) {
      if (s->fd < 0) continue;
      forward_lines(*s, i, true);
      ::close(s->fd);
      s->fd = -1;
    }
  }

  // A rank 0 that was killed (by a signal, or by us) could not remove its socket file.
  if (!f.bootstrap.empty() && remove_stale_socket_file(address)) {
    say(fmt::format("removed the socket file {} that rank 0 left behind", address));
  }
  if (first_failed < 0 && stop_signal == 0) return 0;
  for (int i = 0; i < f.ranks; ++i) {
    const Rank& r = ranks[size_t(i)];
    if (i == first_failed) continue;
    if (succeeded(r.status) && !r.signalled) continue;
    say(fmt::format("rank {} {}{}", i, describe_status(r.status),
                    r.signalled && WIFSIGNALED(r.status) ? " (stopped by epx launch)" : ""));
  }
  if (first_failed >= 0) {
    const int status = ranks[size_t(first_failed)].status;
    say(fmt::format("FAILED: rank {} of {} {} first", first_failed, f.ranks,
                    describe_status(status)));
    return exit_code_of(status) != 0 ? exit_code_of(status) : 1;
  }
  say(fmt::format("FAILED: stopped by {}", signal_name(stop_signal)));
  return 128 + stop_signal;
}

}  // namespace

void add_launch(CLI::App& app, int& exit_code) {
  auto f = std::make_shared<LaunchFlags>();
  CLI::App* c = app.add_subcommand(
      "launch",
      "start N ranks of a command on this node (EPX_RANK, EPX_WORLD_SIZE, EPX_BOOTSTRAP set for "
      "each), forward their output with a [rank i] prefix, stop all if one fails: "
      "epx launch -n 4 -- epx check --world-kind ipc");
  c->add_option("-n,--ranks", f->ranks, "number of ranks (processes)")->required();
  c->add_option("--bootstrap", f->bootstrap,
                "socket address for the ranks' rendezvous: @name (abstract) or a path "
                "(default: a fresh @epx-<pid>-<random> per launch)");
  c->add_option("--grace-ms", f->grace_ms,
                "after a rank fails: how long the others get between SIGTERM and SIGKILL")
      ->capture_default_str();
  // After "--" every argument is the command's, options included.
  c->add_option("command", f->command, "the command and its arguments (put them after --)")
      ->required();
  c->footer("Usage: epx launch -n N [--bootstrap ADDR] [--grace-ms MS] -- command [args...]");
  c->callback([f, &exit_code] { exit_code = run_launch(*f); });
}

}  // namespace epx::cli
