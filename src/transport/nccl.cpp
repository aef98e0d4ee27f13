// NcclWorld and SymmetricBuffer::create_nccl (world.hpp, symmetric.hpp). libnccl is opened at
// run time, so that only a process that builds an NcclWorld needs it.

#include <dlfcn.h>
#include <fmt/format.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/device_guard.hpp"
#include "core/env.hpp"
#include "epx/cuda_check.hpp"
#include "epx/bootstrap.hpp"
#include "epx/config.hpp"
#include "epx/symmetric.hpp"
#include "epx/world.hpp"
#include "transport/collective.hpp"
#include "transport/nccl_peers.hpp"
#include "transport/peer_links.hpp"

namespace epx {
namespace {

using transport::attempt;
using transport::gather_checked;
using transport::Step;

// ncclTeam (nccl_device/core.h), as ncclTeamLsa(ncclComm_t) returns it.
struct LsaTeam {
  int nRanks, rank, stride;
};

// The NCCL host functions epx calls, resolved once from libnccl.so.2 (or EPX_NCCL_LIBRARY).
struct Nccl {
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRankConfig) comm_init_rank_config = nullptr;
  decltype(&ncclCommGetAsyncError) async_error = nullptr;
  decltype(&ncclCommFinalize) comm_finalize = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclCommAbort) comm_abort = nullptr;
  decltype(&ncclMemAlloc) mem_alloc = nullptr;
  decltype(&ncclMemFree) mem_free = nullptr;
  decltype(&ncclCommWindowRegister) window_register = nullptr;
  decltype(&ncclCommWindowDeregister) window_deregister = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclReduceScatter) reduce_scatter = nullptr;
  decltype(&ncclSend) send = nullptr;
  decltype(&ncclRecv) recv = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
  LsaTeam (*team_lsa)(ncclComm_t) = nullptr;
  void* dev_comm_create = nullptr;   // ncclDevCommCreate (nccl_peers.cu calls it)
  void* dev_comm_destroy = nullptr;  // ncclDevCommDestroy
  int version = 0;
};

const Nccl& nccl() {
  static Nccl lib;
  static std::string error;
  static std::once_flag once;
  std::call_once(once, [] {
    const std::string name = env::nccl_library();
    void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* why = dlerror();
      error = fmt::format("NCCL: cannot load {} ({}); install NCCL >= 2.28 (e.g. the "
                          "nvidia-nccl-cu13 wheel) and name it in LD_LIBRARY_PATH or "
                          "EPX_NCCL_LIBRARY",
                          name, why != nullptr ? why : "unknown reason");
      return;
    }
    auto sym = [&](auto& fn, const char* symbol) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, symbol));
      if (fn == nullptr && error.empty())
        error = fmt::format("NCCL: {} has no {} (NCCL >= 2.28 needed)", name, symbol);
    };
    sym(lib.get_version, "ncclGetVersion");
    sym(lib.error_string, "ncclGetErrorString");
    sym(lib.get_unique_id, "ncclGetUniqueId");
    sym(lib.comm_init_rank_config, "ncclCommInitRankConfig");
    sym(lib.async_error, "ncclCommGetAsyncError");
    sym(lib.comm_finalize, "ncclCommFinalize");
    sym(lib.comm_destroy, "ncclCommDestroy");
    sym(lib.comm_abort, "ncclCommAbort");
    sym(lib.mem_alloc, "ncclMemAlloc");
    sym(lib.mem_free, "ncclMemFree");
    sym(lib.window_register, "ncclCommWindowRegister");
    sym(lib.window_deregister, "ncclCommWindowDeregister");
    sym(lib.team_lsa, "ncclTeamLsa");
    sym(lib.all_gather, "ncclAllGather");
    sym(lib.reduce_scatter, "ncclReduceScatter");
    sym(lib.send, "ncclSend");
    sym(lib.recv, "ncclRecv");
    sym(lib.group_start, "ncclGroupStart");
    sym(lib.group_end, "ncclGroupEnd");
    sym(lib.dev_comm_create, "ncclDevCommCreate");
    sym(lib.dev_comm_destroy, "ncclDevCommDestroy");
    if (error.empty()) (void)lib.get_version(&lib.version);
  });
  if (!error.empty()) EPX_THROW(UnsupportedError, error);
  return lib;
}

void nccl_check(ncclResult_t r, const char* call) {
  if (r == ncclSuccess) return;
  EPX_THROW(CudaError, fmt::format("{} failed: {} ({})", call, nccl().error_string(r), int(r)));
}

#define EPX_NCCL_CHECK(call) nccl_check((call), #call)

// The communicator is non-blocking, so that no NCCL call waits without a bound: a call returns
// ncclSuccess or ncclInProgress, and then the communicator's state is polled until it is done,
// an error, or EPX_TIMEOUT_MS has passed (TimeoutError; the caller aborts the communicator).
int nccl_timeout_ms() { return env::timeout_ms(); }

void nccl_finish(ncclResult_t r, ncclComm_t comm, const char* call) {
  if (r != ncclInProgress) nccl_check(r, call);
  const int timeout_ms = nccl_timeout_ms();
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    ncclResult_t state = ncclInProgress;
    nccl_check(nccl().async_error(comm, &state), "ncclCommGetAsyncError");
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) nccl_check(state, call);
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::steady_clock::now() - t0)
                        .count();
    if (ms > timeout_ms) {
      EPX_THROW(TimeoutError, fmt::format("{}: NCCL did not finish within {} ms (EPX_TIMEOUT_MS); "
                                          "a rank of the communicator did not take part",
                                          call, timeout_ms));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

#define EPX_NCCL_FINISH(comm, call) nccl_finish((call), (comm), #call)

std::string env_value(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string("unset") : fmt::format("{}={}", name, v);
}

// Without symmetric memory NCCL may still register a window, as host memory the device cannot
// read (an illegal address that ends every rank's context): refused up front, by name.
[[noreturn]] void no_symmetric_memory(const std::string& seen) {
  EPX_THROW(UnsupportedError,
            fmt::format("NcclWorld needs NCCL's symmetric memory (its device API), and this "
                        "communicator has none ({}): NCCL_CUMEM_ENABLE=0 or NCCL_P2P_DISABLE=1 "
                        "turns it off (here NCCL_CUMEM_ENABLE is {}, NCCL_P2P_DISABLE is {}), as "
                        "do GPUs without direct P2P between them; unset those variables, or use "
                        "IpcWorld",
                        seen, env_value("NCCL_CUMEM_ENABLE"), env_value("NCCL_P2P_DISABLE")));
}

}  // namespace

NcclWorld::NcclWorld(std::unique_ptr<Bootstrap> bootstrap, int device, int local_world_size)
    : bootstrap_(std::move(bootstrap)) {
  const DeviceGuard guard;  // the world's device is current while it is built, then the caller's
  transport::bootstrap_rank_size(bootstrap_.get(), &rank_, &size_);
  EPX_CHECK(local_world_size >= 0 && (local_world_size == 0 || size_ % local_world_size == 0),
            ConfigError, "local_world_size", local_world_size,
            fmt::format("0 (one node) or a divisor of the world size {}", size_));
  nodes_ = local_world_size > 0 ? size_ / local_world_size : 1;
  // Every rank must see the same layout: it decides which collectives follow and which engine
  // serves the backends.
  const std::vector<std::string> layouts = bootstrap_->all_gather(std::to_string(local_world_size));
  for (int r = 0; r < size_; ++r) {
    EPX_CHECK(layouts[size_t(r)] == std::to_string(local_world_size), ConfigError,
              "local_world_size", local_world_size,
              fmt::format("the same on every rank (rank {} has {})", r, layouts[size_t(r)]));
  }
  const bool one_node = nodes_ == 1;
  // NVLink multicast stays off unless the caller decided otherwise (it can take a shared GPU out
  // of service, and epx never needs it).
  ::setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  // 1. Local facts and NCCL itself; rank 0 draws the unique id.
  ncclUniqueId id{};
  const Step local = attempt([&] {
    device_ = transport::select_world_device(device, "an NCCL world", &num_sms_);
    const Nccl& lib = nccl();
    EPX_CHECK(lib.version >= 22800, UnsupportedError, "NCCL version", lib.version,
              ">= 22800 (2.28: symmetric windows and the device API)");
    if (rank_ == 0) EPX_NCCL_CHECK(lib.get_unique_id(&id));
  });
  const std::string mine(reinterpret_cast<const char*>(&id), sizeof(id));
  const std::vector<std::string> ids = gather_checked(*bootstrap_, "NCCL set-up", local, mine);
  std::memcpy(&id, ids[0].data(), sizeof(id));
  // Peer access and native peer atomics between the ranks' GPUs, before NCCL is asked for
  // anything (transport/peer_links.hpp).
  // (Across nodes the ranks meet only through NCCL's collectives.)
  if (one_node) transport::check_process_peer_links(*bootstrap_, device_, "NcclWorld");
  // 2. The communicator (collective inside NCCL), then its LSA team must be the whole world.
  const Step comm = attempt([&] {
    ncclComm_t c = nullptr;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t r = nccl().comm_init_rank_config(&c, size_, id, rank_, &config);
    comm_ = c;  // set even while in progress: an error below aborts it
    EPX_NCCL_FINISH(c, r);
    const LsaTeam lsa = nccl().team_lsa(c);
    EPX_CHECK(lsa.nRanks != 0, UnsupportedError, "NCCL LSA team size", 0,
              "> 0 (NCCL's device runtime did not start; rerun with NCCL_DEBUG=WARN)");
    EPX_CHECK(!one_node || lsa.nRanks == size_, UnsupportedError, "NCCL LSA team size",
              lsa.nRanks,
              fmt::format("the world size {} (every rank on one node over NVLink; across nodes "
                          "give the node layout: local_world_size, LOCAL_WORLD_SIZE)",
                          size_));
    if (!one_node) return;  // the collective engine needs neither windows nor the device API
    // NCCL refuses a device communicator without symmetric memory (NCCL_CUMEM_ENABLE=0,
    // NCCL_P2P_DISABLE=1), while its window registration still succeeds. The requirements'
    // layout is that of the headers epx was built with: probed only when the library is of
    // the same release (others: the checks of create_nccl's window remain).
    if (nccl().version / 100 == NCCL_VERSION_CODE / 100) {
      try {
        transport::probe_device_comm(c, nccl().dev_comm_create, nccl().dev_comm_destroy,
                                     [&](int r, const char* call) {
                                       nccl_finish(ncclResult_t(r), c, call);
                                     });
      } catch (const CudaError& e) {
        no_symmetric_memory(fmt::format("ncclDevCommCreate refused: {}", e.what()));
      }
    }
  });
  try {
    (void)gather_checked(*bootstrap_, "NCCL communicator", comm, "");
  } catch (...) {
    if (comm_ != nullptr) (void)nccl().comm_abort(static_cast<ncclComm_t>(comm_));
    comm_ = nullptr;
    throw;
  }
}

namespace {
// The end of a communicator, bounded. Orderly: a finalize (non-blocking: it completes with the
// peers' own), polled for EPX_TIMEOUT_MS, then the destroy, which then frees local resources only.
// Unwinding from an error (a peer may be dead), or a finalize that fails or outlives the bound:
// an abort, which does not talk to the peers. A teardown never waits without a bound.
void end_communicator(void* comm, bool orderly) {
  auto* c = static_cast<ncclComm_t>(comm);
  if (orderly) {
    try {
      EPX_NCCL_FINISH(c, nccl().comm_finalize(c));
      (void)nccl().comm_destroy(c);
      return;
    } catch (const Error&) {  // (TimeoutError, CudaError: the abort below)
    }
  }
  (void)nccl().comm_abort(c);
}
}  // namespace

NcclWorld NcclWorld::from_env(int device) {
  const BootstrapOptions options = BootstrapOptions::from_env();
  return NcclWorld(std::make_unique<SocketBootstrap>(options), device, options.local_world_size);
}

NcclWorld::NcclWorld(NcclWorld&& o) noexcept { *this = std::move(o); }

NcclWorld& NcclWorld::operator=(NcclWorld&& o) noexcept {
  if (this != &o) {
    if (comm_ != nullptr && !aborted_.load()) end_communicator(comm_, /*orderly=*/true);
    bootstrap_ = std::move(o.bootstrap_);
    comm_ = std::exchange(o.comm_, nullptr);
    rank_ = o.rank_;
    size_ = o.size_;
    device_ = o.device_;
    num_sms_ = o.num_sms_;
    nodes_ = o.nodes_;
    aborted_.store(o.aborted_.load());
  }
  return *this;
}

NcclWorld::~NcclWorld() {
  if (comm_ != nullptr && !aborted_.load())
    end_communicator(comm_, /*orderly=*/std::uncaught_exceptions() == 0);
}

void NcclWorld::abort() {
  if (comm_ == nullptr || aborted_.exchange(true)) return;
  (void)nccl().comm_abort(static_cast<ncclComm_t>(comm_));
}

namespace {
void check_not_aborted(const std::atomic<bool>& aborted) {
  EPX_CHECK(!aborted.load(), StateError, "NcclWorld", "aborted",
            "a live communicator (a collective outlived EPX_TIMEOUT_MS and the world was aborted: "
            "make a new world)");
}
}  // namespace

void NcclWorld::all_gather(const void* send, void* recv, size_t bytes, void* stream) {
  check_not_aborted(aborted_);
  auto* c = static_cast<ncclComm_t>(comm_);
  EPX_NCCL_FINISH(c, nccl().all_gather(send, recv, bytes, ncclUint8, c,
                                       static_cast<cudaStream_t>(stream)));
}

void NcclWorld::reduce_scatter_bf16(const void* send, void* recv, size_t count, void* stream) {
  check_not_aborted(aborted_);
  auto* c = static_cast<ncclComm_t>(comm_);
  EPX_NCCL_FINISH(c, nccl().reduce_scatter(send, recv, count, ncclBfloat16, ncclSum, c,
                                           static_cast<cudaStream_t>(stream)));
}

void NcclWorld::all_to_all(const void* send, const size_t* send_offsets, const size_t* send_bytes,
                           void* recv, const size_t* recv_offsets, const size_t* recv_bytes,
                           void* stream) {
  check_not_aborted(aborted_);
  const Nccl& lib = nccl();
  auto* c = static_cast<ncclComm_t>(comm_);
  auto* st = static_cast<cudaStream_t>(stream);
  EPX_NCCL_CHECK(lib.group_start());
  ncclResult_t first = ncclSuccess;
  auto ok = [](ncclResult_t r) { return r == ncclSuccess || r == ncclInProgress; };
  for (int r = 0; r < size_ && ok(first); ++r) {
    if (send_bytes[r] > 0)
      first = lib.send(static_cast<const uint8_t*>(send) + send_offsets[r], send_bytes[r],
                       ncclUint8, r, c, st);
    if (ok(first) && recv_bytes[r] > 0)
      first = lib.recv(static_cast<uint8_t*>(recv) + recv_offsets[r], recv_bytes[r], ncclUint8, r,
                       c, st);
  }
  const ncclResult_t end = lib.group_end();  // always closes the group
  if (first != ncclInProgress) EPX_NCCL_CHECK(first);
  EPX_NCCL_FINISH(c, end);
}

// ---- symmetric memory ---------------------------------------------------------------------------

namespace {

// What create_nccl registered: the window on `comm` and its ncclMemAlloc memory.
struct NcclWindow {
  ncclComm_t comm = nullptr;
  ncclWindow_t window = nullptr;
  void* memory = nullptr;
  int device = 0;
  ~NcclWindow() {
    const DeviceGuard guard;
    (void)cudaSetDevice(device);
    (void)cudaDeviceSynchronize();  // no kernel of this device still uses the window
    if (window != nullptr) {
      try {  // a non-blocking communicator: wait (bounded) before the memory goes
        nccl_finish(nccl().window_deregister(comm, window), comm, "ncclCommWindowDeregister");
      } catch (...) {
      }
    }
    if (memory != nullptr) (void)nccl().mem_free(memory);
  }
};

}  // namespace

SymmetricBuffer SymmetricBuffer::create_nccl(NcclWorld& world, size_t bytes) {
  EPX_CHECK(bytes > 0, InputError, "bytes", bytes, "> 0");
  EPX_CHECK(world.num_nodes() == 1, UnsupportedError, "NcclWorld nodes", world.num_nodes(),
            "1 for a symmetric buffer (NCCL's windows reach the ranks of one node)");
  const std::vector<std::string> sizes =
      world.bootstrap().all_gather(std::to_string(bytes));
  for (int r = 0; r < world.size(); ++r) {
    EPX_CHECK(sizes[size_t(r)] == std::to_string(bytes), InputError, "bytes", bytes,
              fmt::format("the same on every rank (rank {} asks for {})", r, sizes[size_t(r)]));
  }
  const DeviceGuard guard(world.device());
  SymmetricBuffer out;
  out.rank_ = world.rank();
  out.world_size_ = world.size();
  out.device_ = world.device();
  auto win = std::make_shared<NcclWindow>();
  win->comm = static_cast<ncclComm_t>(world.comm());
  win->device = world.device();
  // Registration is collective inside NCCL (and unbounded there): every rank's allocation is
  // agreed first, so that no rank enters it alone.
  const size_t rounded = (bytes + NCCL_WIN_REQUIRED_ALIGNMENT - 1) / NCCL_WIN_REQUIRED_ALIGNMENT *
                         NCCL_WIN_REQUIRED_ALIGNMENT;
  const Step allocated = attempt([&] {
    EPX_NCCL_CHECK(nccl().mem_alloc(&win->memory, rounded));
  });
  (void)gather_checked(world.bootstrap(), "ncclMemAlloc", allocated, "");
  // NCCL_WIN_DEFAULT: the LSA mapping is all epx needs; NCCL's symmetric collectives (which may
  // set up NVLink multicast) are never run on this buffer.
  const Step registered = attempt([&] {
    EPX_NCCL_FINISH(win->comm, nccl().window_register(win->comm, win->memory, rounded,
                                                      &win->window, NCCL_WIN_DEFAULT));
    if (win->window == nullptr) no_symmetric_memory("ncclCommWindowRegister gave no window");
    // The window is a device object the peer-table kernel reads: anything else is NCCL's
    // fallback registration, which faults there.
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, win->window) != cudaSuccess) {
      (void)cudaGetLastError();
      attr.type = cudaMemoryTypeUnregistered;
    }
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
      no_symmetric_memory("ncclCommWindowRegister gave a window the GPU cannot read");
    }
  });
  (void)gather_checked(world.bootstrap(), "ncclCommWindowRegister", registered, "");
  const Step table = attempt([&] {
    EPX_CUDA_CHECK(cudaMemset(win->memory, 0, rounded));
    EPX_CUDA_CHECK(
        cudaMalloc(reinterpret_cast<void**>(&out.peers_dev_), sizeof(uint8_t*) * world.size()));
    transport::fill_lsa_peer_table(win->window, world.size(), out.peers_dev_, nullptr);
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
    // This rank's own buffer through the same mapping as its peers see it (peers[rank]), so that
    // a kernel never reaches one location through two virtual addresses.
    EPX_CUDA_CHECK(cudaMemcpy(&out.local_, out.peers_dev_ + world.rank(), sizeof(uint8_t*),
                              cudaMemcpyDeviceToHost));
  });
  out.bytes_ = bytes;
  out.external_ = std::move(win);
  // Every rank's buffer is zeroed and its table complete before anyone's kernels touch a peer.
  (void)gather_checked(world.bootstrap(), "the NCCL peer table", table, "");
  return out;
}

}  // namespace epx
