#pragma once
// Bootstrap: the host-side exchange between the processes of one job before (and while) they
// share GPU memory (DESIGN §3): a few hundred bytes of handles and, on one node, file
// descriptors. No CUDA here; a Bootstrap works on machines without a GPU.
//
// Three ways to get one:
//   - SocketBootstrap (alias UnixSocketBootstrap): one process (or thread) per rank, rendezvous at
//     the address EPX_BOOTSTRAP names: a Unix-domain socket on one node (`epx launch` sets it,
//     with EPX_RANK and EPX_WORLD_SIZE), or tcp://HOST:PORT across hosts;
//   - CallbackBootstrap: a framework's own all-gather of bytes (torch.distributed and the like);
//   - NCCL's unique id across nodes (later, with NcclWorld).
//
// Every collective (all_gather, barrier, all_gather_fds) is called by every rank in the same
// order, from one thread per object; objects are not thread-safe. Every wait is bounded by the
// timeout (EPX_TIMEOUT_MS, default 10 s): a rank that never arrives becomes a TimeoutError that
// names it, a rank that exits or is killed a PeerError that names it, on every surviving rank.
// After such an error the object refuses further collectives (StateError): recreate the job.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "epx/config.hpp"

namespace epx {

// An owned POSIX file descriptor, closed on destruction. Move-only.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1) noexcept;  // closes the descriptor held, if any

 private:
  int fd_ = -1;
};

class Bootstrap {
 public:
  virtual ~Bootstrap() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Collective. Every rank passes its bytes (any length, lengths may differ between ranks);
  // returns size() strings, element r = rank r's bytes (this rank's own included).
  // Throws TimeoutError naming the ranks that did not call it within the timeout, PeerError
  // naming a rank that disconnected (exited, was killed) or called a different collective,
  // StateError after an earlier error.
  virtual std::vector<std::string> all_gather(const std::string& bytes) = 0;

  // Collective: returns once every rank has called it. Errors as all_gather.
  virtual void barrier();

  // Whether all_gather_fds() can pass descriptors between the ranks (processes on one node
  // connected by Unix sockets: yes; a framework's all-gather of bytes: no).
  virtual bool can_pass_fds() const { return false; }

  // Collective. Every rank passes one open descriptor `fd` (still owned by the caller); returns
  // size() new descriptors, element r referring to rank r's open file (for this rank, a
  // duplicate of `fd`), close-on-exec. Throws InputError when `fd` is not open,
  // UnsupportedError when !can_pass_fds(), and otherwise the errors of all_gather.
  virtual std::vector<UniqueFd> all_gather_fds(int fd);
};

// Where a SocketBootstrap meets, and how the ranks sit on the nodes. Read from the environment by
// from_env(): `epx launch` sets EPX_RANK, EPX_WORLD_SIZE and EPX_BOOTSTRAP for every rank it
// starts; the variables of torchrun, Slurm's srun and Open MPI's mpirun are understood too.
struct BootstrapOptions {
  int rank = 0;             // in [0, world_size)
  int world_size = 1;       // in [1, kMaxRanks]
  // "tcp://HOST:PORT" = TCP (HOST an IPv4 address, a host name resolved with
  // getaddrinfo, or "[IPv6 address]"; PORT in [1, 65535]; rank 0 listens on PORT of every
  // interface, the others connect to HOST); "@name" = Linux abstract socket namespace (no file;
  // the name disappears with the process that holds it); anything else = the path of a socket
  // file (an optional "unix:" prefix is dropped). A Unix address has at most 107 bytes (the limit
  // of sockaddr_un). May be empty only when world_size == 1.
  std::string address;
  int timeout_ms = 10000;   // EPX_TIMEOUT_MS: bound of every wait, in [1, kMaxTimeoutMs]

  // The node layout: this rank's index among the ranks of its node, and how many ranks each node
  // has (every node the same). Placement is by block: node = rank / local_world_size, so
  // rank % local_world_size == local_rank (validate() checks it). local_world_size == 0: not
  // known (an object made by hand), taken as one node.
  int local_rank = 0;
  int local_world_size = 0;
  // Whose variables from_env() read: "" (none: one rank), "epx", "torchrun", "slurm", "mpi".
  std::string launcher;

  int node() const { return local_world_size > 0 ? rank / local_world_size : 0; }
  int num_nodes() const { return local_world_size > 0 ? world_size / local_world_size : 1; }

  // Throws ConfigError naming the field, the value and the bound.
  void validate() const;

  // Reads the first complete set of launcher variables, in this order (the precedence):
  //   epx launch: EPX_RANK, EPX_WORLD_SIZE (one node: local rank = rank); EPX_BOOTSTRAP;
  //   torchrun:   RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE; MASTER_ADDR, MASTER_PORT;
  //   Slurm:      SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, and the ranks per node from
  //               SLURM_NTASKS_PER_NODE, else SLURM_STEP_TASKS_PER_NODE, else
  //               SLURM_TASKS_PER_NODE ("4(x2)" and "4,4" forms; every node the same);
  //               SLURM_NODEID, when set, must equal rank / ranks per node;
  //   Open MPI:   OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK,
  //               OMPI_COMM_WORLD_LOCAL_SIZE.
  // A family counts as present when its rank or its world size is set; then every variable of it
  // listed before the ';' must be set (a partial set is a ConfigError naming what is set and
  // what is missing). None present: a world of one rank.
  // The address is EPX_BOOTSTRAP when set; otherwise, for torchrun,
  // tcp://MASTER_ADDR:(MASTER_PORT + 1): torch's own TCP store already listens on MASTER_PORT on
  // rank 0's host, so epx takes the port after it. Slurm and Open MPI name no rendezvous: several
  // ranks without EPX_BOOTSTRAP are a ConfigError asking for EPX_BOOTSTRAP=tcp://<first host>:
  // <port>. Ranks on several nodes need a tcp:// address (a Unix socket does not cross hosts).
  // EPX_TIMEOUT_MS applies to all. Every malformed or inconsistent value is a ConfigError naming
  // the variable, its value and the bound.
  // A Slurm batch script also has SLURM_PROCID and SLURM_NTASKS: a single process started
  // there (not by srun) sets EPX_RANK=0 EPX_WORLD_SIZE=1 to be a world of one.
  static BootstrapOptions from_env();
  // from_env() on EPX_RANK, EPX_WORLD_SIZE, EPX_BOOTSTRAP and EPX_TIMEOUT_MS given as values
  // (nullptr = unset), no launcher's variables; for tests and for callers with their own env.
  static BootstrapOptions parse_env(const char* rank, const char* world_size, const char* address,
                                    const char* timeout_ms);
  // from_env() on an environment given as a function from a variable's name to its value
  // (nullptr = unset).
  using Lookup = std::function<const char*(const char* name)>;
  static BootstrapOptions parse_env(const Lookup& getenv);
};

// A fresh abstract-namespace address, "@epx-<pid>-<random hex>", unique per call.
std::string unique_bootstrap_address();

// Removes the socket file of `address` when nothing listens on it any more (its rank 0 was
// killed before it could remove it); `epx launch` calls it after its ranks end. Returns whether
// a file was removed. Abstract addresses have no file; a live listener's file is left alone.
bool remove_stale_socket_file(const std::string& address);

// Rendezvous of the ranks of one job as a star on a stream socket: a Unix-domain socket for the
// ranks of one node, TCP for ranks on several hosts (options.address = "tcp://HOST:PORT"); the
// protocol is the same. Rank 0 listens at options.address (over TCP: on PORT of every interface),
// every other rank connects to it (retrying until the timeout) and introduces itself (rank,
// world size, pid). Rank 0 answers every rank once all have arrived, so the
// constructor returns on every rank together, or throws on every rank that got that far:
//   - ConfigError: world sizes disagree, a rank number out of range or used twice, or the address
//     already in use by a live process (another job, or a second rank 0) — all at start-up;
//   - TimeoutError naming the ranks that did not arrive within options.timeout_ms (on rank 0 and
//     on every rank that did arrive), or naming rank 0 when nothing listens at the address;
//   - PeerError naming a rank that disconnected during start-up.
// Collectives go through rank 0 (gather, then send everything to every rank); file descriptors
// too (SCM_RIGHTS: each rank sends its descriptor to rank 0, rank 0 sends all of them to every
// rank), so the only connections are rank 0 <-> rank r. Descriptors pass over Unix sockets only:
// over TCP can_pass_fds() is false and all_gather_fds() throws UnsupportedError. Over TCP every
// connection has TCP_NODELAY, and every host must have the same byte order (frames carry
// integers in host order; a rank of the other order is not understood and times out).
// After start-up rank 0 keeps the address
// and answers any newcomer (a second job's rank, say) with a ConfigError that says the address
// is taken. A socket file is removed by rank 0 on destruction and on error, and by a surviving
// rank when rank 0 died without removing it; a stale file left by a killed job is detected
// (nothing accepts on it) and replaced.
class SocketBootstrap final : public Bootstrap {
 public:
  explicit SocketBootstrap(const BootstrapOptions& options);
  ~SocketBootstrap() override;
  SocketBootstrap(const SocketBootstrap&) = delete;
  SocketBootstrap& operator=(const SocketBootstrap&) = delete;

  int rank() const override;
  int size() const override;
  std::vector<std::string> all_gather(const std::string& bytes) override;
  bool can_pass_fds() const override;  // false over TCP
  std::vector<UniqueFd> all_gather_fds(int fd) override;

  const std::string& address() const;
  // Process ids of every rank, as each reported at start-up (over TCP, each on its own host).
  const std::vector<long>& pids() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The one-node name of the same class (its address a Unix-domain socket).
using UnixSocketBootstrap = SocketBootstrap;

// A framework's all-gather of bytes, e.g. torch.distributed.all_gather_object. The function is
// called once per collective with this rank's bytes and must return size() strings in rank
// order; whatever it throws propagates. It cannot pass file descriptors, so an IpcWorld over it
// shares memory through CUDA IPC handles instead of cuMem descriptors.
class CallbackBootstrap final : public Bootstrap {
 public:
  using AllGather = std::function<std::vector<std::string>(const std::string& bytes)>;

  // Throws ConfigError for a rank outside [0, size), a size outside [1, kMaxRanks] or an empty
  // function.
  CallbackBootstrap(int rank, int size, AllGather all_gather);

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  // Throws PeerError when the function returns other than size() strings.
  std::vector<std::string> all_gather(const std::string& bytes) override;

 private:
  int rank_;
  int size_;
  AllGather all_gather_;
};

// ---- start-up agreement -----------------------------------------------------------------------

// The version of this build of epx (CMake's PROJECT_VERSION), e.g. "0.1.0".
const char* library_version();

// Canonical text of everything the ranks of one job must agree on: the epx version, the backend
// and every EpConfig field except rank, one "key=value" line each, in a fixed order.
std::string fingerprint(const EpConfig& cfg, Backend backend);

// Collective: all-gathers every rank's fingerprint and throws ConfigError, on every rank, when
// they differ, naming the first differing field (in fingerprint order) and the values of rank 0
// and of the first rank that differs, e.g. "hidden: rank 0 has 7168, rank 2 has 4096".
// Errors of the bootstrap itself propagate.
void check_fingerprints(Bootstrap& bootstrap, const std::string& fingerprint);
void check_fingerprints(Bootstrap& bootstrap, const EpConfig& cfg, Backend backend);

}  // namespace epx
