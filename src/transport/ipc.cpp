// IpcWorld and SymmetricBuffer::create_ipc: one process per rank on one node (DESIGN §3).
//
// Each rank allocates its buffer on its own GPU and maps every peer's buffer into its own
// address space; the peer table then holds addresses valid in this process, exactly what the
// kernels of an in-process world see. Two ways to share the memory:
//   kPosixFd: cuMemCreate (POSIX-descriptor handle type) -> cuMemExportToShareableHandle -> the
//             descriptors travel over the bootstrap's Unix sockets (SCM_RIGHTS) ->
//             cuMemImportFromShareableHandle -> cuMemAddressReserve / cuMemMap / cuMemSetAccess;
//   kCudaIpc: cudaMalloc -> cudaIpcGetMemHandle -> 64 bytes through any all-gather ->
//             cudaIpcOpenMemHandle (works over a framework's CallbackBootstrap).
// The driver API is reached through the runtime (cudaGetDriverEntryPointByVersion): nothing
// links libcuda, so binaries start on machines without a driver.
//
// Every step that can fail on one rank is followed by an all-gather of each rank's status, so
// a failure on one rank becomes an error on every rank instead of a wait for the timeout.

#include <cuda.h>
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include "core/device_guard.hpp"
#include "epx/bootstrap.hpp"
#include "epx/cuda_check.hpp"
#include "epx/symmetric.hpp"
#include "epx/world.hpp"
#include "transport/collective.hpp"
#include "transport/peer_links.hpp"

namespace epx {

using transport::attempt;
using transport::gather_checked;
using transport::Step;

const char* to_string(IpcHandles h) {
  switch (h) {
    case IpcHandles::kAuto: return "auto";
    case IpcHandles::kPosixFd: return "posix-fd";
    case IpcHandles::kCudaIpc: return "cuda-ipc";
  }
  return "invalid";
}

namespace {

// ---- driver entry points -------------------------------------------------------------------

// Members are named after the driver functions so that error messages name the call.
struct Driver {
  decltype(&::cuGetErrorName) cuGetErrorName = nullptr;
  decltype(&::cuGetErrorString) cuGetErrorString = nullptr;
  decltype(&::cuDeviceGet) cuDeviceGet = nullptr;
  decltype(&::cuDeviceGetAttribute) cuDeviceGetAttribute = nullptr;
  decltype(&::cuMemGetAllocationGranularity) cuMemGetAllocationGranularity = nullptr;
  decltype(&::cuMemCreate) cuMemCreate = nullptr;
  decltype(&::cuMemRelease) cuMemRelease = nullptr;
  decltype(&::cuMemExportToShareableHandle) cuMemExportToShareableHandle = nullptr;
  decltype(&::cuMemImportFromShareableHandle) cuMemImportFromShareableHandle = nullptr;
  decltype(&::cuMemAddressReserve) cuMemAddressReserve = nullptr;
  decltype(&::cuMemAddressFree) cuMemAddressFree = nullptr;
  decltype(&::cuMemMap) cuMemMap = nullptr;
  decltype(&::cuMemUnmap) cuMemUnmap = nullptr;
  decltype(&::cuMemSetAccess) cuMemSetAccess = nullptr;
};

// The ABI version the function pointer types above are taken from.
constexpr unsigned kDriverAbiVersion = 12000;

template <typename Fn>
void load_entry(Fn& fn, const char* symbol) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
  const cudaError_t e =
      cudaGetDriverEntryPointByVersion(symbol, &p, kDriverAbiVersion, cudaEnableDefault, &found);
#else
  const cudaError_t e = cudaGetDriverEntryPoint(symbol, &p, cudaEnableDefault, &found);
#endif
  if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || p == nullptr) {
    (void)cudaGetLastError();
    EPX_THROW(UnsupportedError,
              fmt::format("the CUDA driver does not provide {} (ABI {}): {}; an IpcWorld with "
                          "cuMem handles needs a CUDA 12 driver",
                          symbol, kDriverAbiVersion, cudaGetErrorName(e)));
  }
  fn = reinterpret_cast<Fn>(p);
}

// Loaded once, on first use; a failure throws and the next call tries again.
const Driver& driver() {
  static const Driver d = [] {
    Driver x;
#define EPX_LOAD(name) load_entry(x.name, #name)
    EPX_LOAD(cuGetErrorName);
    EPX_LOAD(cuGetErrorString);
    EPX_LOAD(cuDeviceGet);
    EPX_LOAD(cuDeviceGetAttribute);
    EPX_LOAD(cuMemGetAllocationGranularity);
    EPX_LOAD(cuMemCreate);
    EPX_LOAD(cuMemRelease);
    EPX_LOAD(cuMemExportToShareableHandle);
    EPX_LOAD(cuMemImportFromShareableHandle);
    EPX_LOAD(cuMemAddressReserve);
    EPX_LOAD(cuMemAddressFree);
    EPX_LOAD(cuMemMap);
    EPX_LOAD(cuMemUnmap);
    EPX_LOAD(cuMemSetAccess);
#undef EPX_LOAD
    return x;
  }();
  return d;
}

[[noreturn]] void throw_cu(CUresult r, const char* call, const char* file, int line) {
  const char* name = "unknown";
  const char* text = "unknown";
  (void)driver().cuGetErrorName(r, &name);
  (void)driver().cuGetErrorString(r, &text);
  throw CudaError(detail::located(fmt::format("{} failed: {} ({})", call, name, text), file, line));
}

#define EPX_CU_CHECK(call)                                          \
  do {                                                              \
    const CUresult epx_cu_ = (call);                                \
    if (epx_cu_ != CUDA_SUCCESS) throw_cu(epx_cu_, #call, __FILE__, __LINE__); \
  } while (0)

// "key=value" lines, as IpcWorld's ranks describe themselves.
std::string field(const std::string& text, std::string_view key) {
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t eol = std::min(text.find('\n', pos), text.size());
    const std::string_view line(text.data() + pos, eol - pos);
    if (line.size() > key.size() && line.substr(0, key.size()) == key && line[key.size()] == '=') {
      return std::string(line.substr(key.size() + 1));
    }
    pos = eol + 1;
  }
  return std::string();
}

std::string uuid_hex(const cudaUUID_t& u) {
  std::string out;
  for (char c : u.bytes) out += fmt::format("{:02x}", static_cast<unsigned char>(c));
  return out;
}

}  // namespace

namespace transport {

int select_world_device(int device, const char* what, int* num_sms) {
  require_gpu(what);
  int dev = device;
  if (dev < 0) EPX_CUDA_CHECK(cudaGetDevice(&dev));
  const int count = cuda_device_count();
  EPX_CHECK(dev >= 0 && dev < count, InputError, "device", dev,
            fmt::format("in [0, {}) (the GPUs visible to this process)", count));
  EPX_CUDA_CHECK(cudaSetDevice(dev));
  cudaDeviceProp prop{};
  EPX_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  *num_sms = prop.multiProcessorCount;
  return dev;
}

void bootstrap_rank_size(const Bootstrap* bootstrap, int* rank, int* size) {
  EPX_CHECK(bootstrap != nullptr, InputError, "bootstrap", "nullptr", "a Bootstrap");
  *rank = bootstrap->rank();
  *size = bootstrap->size();
  EPX_CHECK(*size >= 1 && *size <= kMaxRanks, InputError, "bootstrap size", *size,
            fmt::format("in [1, kMaxRanks = {}]", kMaxRanks));
}

}  // namespace transport

// ---- IpcWorld ---------------------------------------------------------------------------------

IpcWorld::IpcWorld(std::unique_ptr<Bootstrap> bootstrap, int device, IpcHandles handles)
    : bootstrap_(std::move(bootstrap)) {
  const DeviceGuard guard;  // the world's device is current while it is built, then the caller's
  transport::bootstrap_rank_size(bootstrap_.get(), &rank_, &size_);
  // Local facts first; a rank that fails here still takes part in the all-gather below, so
  // that every rank hears about it.
  std::string me;
  const Step local = attempt([&] {
    const int dev = transport::select_world_device(device, "an IPC world", &num_sms_);
    device_ = dev;
    cudaDeviceProp prop{};
    EPX_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    bool fd_ok = false;
    std::string fd_why = "the bootstrap cannot pass file descriptors";
    if (handles != IpcHandles::kCudaIpc && bootstrap_->can_pass_fds()) {
      const Driver& drv = driver();
      CUdevice cu_dev = 0;
      EPX_CU_CHECK(drv.cuDeviceGet(&cu_dev, dev));
      int vmm = 0, posix = 0;
      EPX_CU_CHECK(drv.cuDeviceGetAttribute(
          &vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, cu_dev));
      EPX_CU_CHECK(drv.cuDeviceGetAttribute(
          &posix, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, cu_dev));
      fd_ok = vmm != 0 && posix != 0;
      if (!fd_ok) fd_why = "its GPU does not export cuMem memory as POSIX descriptors";
    } else if (handles == IpcHandles::kCudaIpc) {
      fd_why = "kCudaIpc was requested";
    }
    if (handles == IpcHandles::kPosixFd && !fd_ok) {
      EPX_THROW(UnsupportedError,
                fmt::format("IpcWorld rank {}: handles = posix-fd, but {}", rank_, fd_why));
    }
    char host[256] = {};
    (void)::gethostname(host, sizeof(host) - 1);
    me = fmt::format("host={}\nuuid={}\nsms={}\nfd={}\npid={}\ngpu={}\n", host,
                     uuid_hex(prop.uuid), num_sms_, fd_ok ? 1 : 0, long(::getpid()), prop.name);
  });
  const std::vector<std::string> all =
      gather_checked(*bootstrap_, "setting up the IPC world", local, me);

  const std::string my_uuid = field(all[size_t(rank_)], "uuid");
  ranks_on_device_ = 0;
  bool every_fd = true;
  for (int r = 0; r < size_; ++r) {
    const std::string& info = all[size_t(r)];
    // Checked in the same order on every rank, so every rank throws the same error.
    if (field(info, "host") != field(all[0], "host")) {
      EPX_THROW(UnsupportedError,
                fmt::format("IpcWorld is for the ranks of one node: rank 0 runs on host {}, rank "
                            "{} on host {} (across nodes, use NcclWorld)",
                            field(all[0], "host"), r, field(info, "host")));
    }
    ranks_on_device_ += field(info, "uuid") == my_uuid;
    every_fd = every_fd && field(info, "fd") == "1";
  }
  handles_ = every_fd ? IpcHandles::kPosixFd : IpcHandles::kCudaIpc;

  // Peer access and native peer atomics between every pair of the ranks' GPUs, as far as any
  // process can see them (transport/peer_links.hpp).
  transport::check_process_peer_links(*bootstrap_, device_, "IpcWorld");
}

IpcWorld IpcWorld::from_env(int device, IpcHandles handles) {
  const BootstrapOptions options = BootstrapOptions::from_env();
  if (options.num_nodes() > 1) {
    EPX_THROW(ConfigError,
              fmt::format("IpcWorld::from_env: the launcher ({}) puts the {} ranks on {} nodes "
                          "({} per node), but an IpcWorld shares GPU memory within one node: "
                          "use NcclWorld across nodes, or start the ranks of one node only",
                          options.launcher, options.world_size, options.num_nodes(),
                          options.local_world_size));
  }
  return IpcWorld(std::make_unique<SocketBootstrap>(options), device, handles);
}

int IpcWorld::sm_budget() const { return std::max(1, num_sms_ / std::max(1, ranks_on_device_)); }

// ---- symmetric memory across processes ------------------------------------------------------

namespace detail {

struct IpcMappings {
  // One cuMem allocation mapped into this process: this rank's own, or a peer's import.
  struct Mapping {
    int rank = -1;
    CUdeviceptr ptr = 0;
    size_t size = 0;
    CUmemGenericAllocationHandle handle = 0;
    bool has_handle = false;
    bool reserved = false;
    bool mapped = false;
  };

  int device = 0;
  std::vector<Mapping> mappings;     // kPosixFd
  void* own_cuda_ipc = nullptr;      // kCudaIpc: this rank's cudaMalloc
  std::vector<void*> opened;         // kCudaIpc: [rank] peers' buffers opened here

  IpcMappings() = default;
  IpcMappings(const IpcMappings&) = delete;
  IpcMappings& operator=(const IpcMappings&) = delete;

  ~IpcMappings() {
    const DeviceGuard guard;
    (void)cudaSetDevice(device);
    // Kernels of this rank may still read or write the mappings: let them finish first.
    (void)cudaDeviceSynchronize();
    for (void* p : opened) {
      if (p != nullptr) (void)cudaIpcCloseMemHandle(p);
    }
    if (own_cuda_ipc != nullptr) (void)cudaFree(own_cuda_ipc);
    if (!mappings.empty()) {
      // The entry points were loaded when the first mapping was made.
      const Driver& drv = driver();
      for (auto it = mappings.rbegin(); it != mappings.rend(); ++it) {
        if (it->mapped) (void)drv.cuMemUnmap(it->ptr, it->size);
        if (it->reserved) (void)drv.cuMemAddressFree(it->ptr, it->size);
        if (it->has_handle) (void)drv.cuMemRelease(it->handle);
      }
    }
    (void)cudaGetLastError();
  }
};

void IpcMappingsDeleter::operator()(IpcMappings* m) const noexcept { delete m; }

}  // namespace detail

namespace {

using detail::IpcMappings;

// Reserves an address range for `m`, maps its allocation there and gives `device` read-write
// access to it.
void map_here(const Driver& drv, IpcMappings::Mapping& m, int device, size_t alignment) {
  EPX_CU_CHECK(drv.cuMemAddressReserve(&m.ptr, m.size, alignment, 0, 0));
  m.reserved = true;
  EPX_CU_CHECK(drv.cuMemMap(m.ptr, m.size, 0, m.handle, 0));
  m.mapped = true;
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  EPX_CU_CHECK(drv.cuMemSetAccess(m.ptr, m.size, &access, 1));
}

// Every rank must ask for the same number of bytes (the layout is derived from the same config).
void check_same_bytes(const Bootstrap& b, const std::vector<size_t>& bytes) {
  for (size_t r = 1; r < bytes.size(); ++r) {
    if (bytes[r] != bytes[0]) {
      EPX_THROW(InputError, fmt::format("create_ipc on rank {}: bytes differ between the ranks: "
                                        "rank 0 asks for {}, rank {} for {}",
                                        b.rank(), bytes[0], r, bytes[r]));
    }
  }
}

// kPosixFd. Returns every rank's base address in this process.
std::vector<uint8_t*> share_posix_fd(IpcWorld& world, IpcMappings& m, size_t bytes) {
  Bootstrap& b = world.bootstrap();
  const int n = world.size(), me = world.rank(), dev = world.device();
  UniqueFd exported;
  size_t granularity = 0;
  const Step allocated = attempt([&] {
    const Driver& drv = driver();
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    EPX_CU_CHECK(drv.cuMemGetAllocationGranularity(&granularity, &prop,
                                                   CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    IpcMappings::Mapping own;
    own.rank = me;
    own.size = (bytes + granularity - 1) / granularity * granularity;
    m.mappings.push_back(own);
    IpcMappings::Mapping& mine = m.mappings.back();
    EPX_CU_CHECK(drv.cuMemCreate(&mine.handle, mine.size, &prop, 0));
    mine.has_handle = true;
    int fd = -1;
    EPX_CU_CHECK(drv.cuMemExportToShareableHandle(&fd, mine.handle,
                                                  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    exported.reset(fd);
    map_here(drv, mine, dev, granularity);
    // Zeroed before any peer can see it: the descriptors travel only after the next all-gather.
    EPX_CUDA_CHECK(cudaMemset(reinterpret_cast<void*>(mine.ptr), 0, mine.size));
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
  });
  const std::vector<std::string> sizes = gather_checked(
      b, "allocating and exporting the symmetric buffer", allocated,
      fmt::format("{} {}", bytes, m.mappings.empty() ? 0 : m.mappings.back().size));
  std::vector<size_t> asked(static_cast<size_t>(n)), allocated_bytes(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    unsigned long long a = 0, s = 0;
    if (std::sscanf(sizes[size_t(r)].c_str(), "%llu %llu", &a, &s) != 2) {
      EPX_THROW(PeerError, fmt::format("create_ipc: malformed size report from rank {}", r));
    }
    asked[size_t(r)] = a;
    allocated_bytes[size_t(r)] = s;
  }
  check_same_bytes(b, asked);

  // Every rank's descriptor, to every rank (through rank 0; see UnixSocketBootstrap).
  std::vector<UniqueFd> fds = b.all_gather_fds(exported.get());
  exported.reset();
  const Step imported = attempt([&] {
    const Driver& drv = driver();
    for (int r = 0; r < n; ++r) {
      if (r == me) continue;
      IpcMappings::Mapping peer;
      peer.rank = r;
      peer.size = allocated_bytes[size_t(r)];
      m.mappings.push_back(peer);
      IpcMappings::Mapping& p = m.mappings.back();
      EPX_CU_CHECK(drv.cuMemImportFromShareableHandle(
          &p.handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fds[size_t(r)].get())),
          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
      p.has_handle = true;
      fds[size_t(r)].reset();  // the imported handle keeps the memory
      map_here(drv, p, dev, granularity);
    }
  });
  (void)gather_checked(b, "importing and mapping the peers' buffers", imported, "");
  std::vector<uint8_t*> bases(static_cast<size_t>(n), nullptr);
  for (const IpcMappings::Mapping& mp : m.mappings) {
    bases[size_t(mp.rank)] = reinterpret_cast<uint8_t*>(mp.ptr);
  }
  return bases;
}

// kCudaIpc. Returns every rank's base address in this process.
std::vector<uint8_t*> share_cuda_ipc(IpcWorld& world, IpcMappings& m, size_t bytes) {
  Bootstrap& b = world.bootstrap();
  const int n = world.size(), me = world.rank();
  std::string handle;
  const Step allocated = attempt([&] {
    EPX_CUDA_CHECK(cudaMalloc(&m.own_cuda_ipc, bytes));
    EPX_CUDA_CHECK(cudaMemset(m.own_cuda_ipc, 0, bytes));
    EPX_CUDA_CHECK(cudaDeviceSynchronize());
    cudaIpcMemHandle_t h{};
    EPX_CUDA_CHECK(cudaIpcGetMemHandle(&h, m.own_cuda_ipc));
    handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  });
  // [bytes as 8 raw bytes][the handle]
  std::string report(reinterpret_cast<const char*>(&bytes), sizeof(bytes));
  const std::vector<std::string> all = gather_checked(
      b, "allocating and exporting the symmetric buffer", allocated, report + handle);
  std::vector<size_t> asked(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    if (all[size_t(r)].size() != sizeof(size_t) + sizeof(cudaIpcMemHandle_t)) {
      EPX_THROW(PeerError, fmt::format("create_ipc: malformed handle from rank {}", r));
    }
    std::memcpy(&asked[size_t(r)], all[size_t(r)].data(), sizeof(size_t));
  }
  check_same_bytes(b, asked);
  const Step opened = attempt([&] {
    m.opened.assign(static_cast<size_t>(n), nullptr);
    for (int r = 0; r < n; ++r) {
      if (r == me) continue;
      cudaIpcMemHandle_t h{};
      std::memcpy(&h, all[size_t(r)].data() + sizeof(size_t), sizeof(h));
      EPX_CUDA_CHECK(cudaIpcOpenMemHandle(&m.opened[size_t(r)], h, cudaIpcMemLazyEnablePeerAccess));
    }
  });
  (void)gather_checked(b, "opening the peers' buffers", opened, "");
  std::vector<uint8_t*> bases(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    bases[size_t(r)] = static_cast<uint8_t*>(r == me ? m.own_cuda_ipc : m.opened[size_t(r)]);
  }
  return bases;
}

}  // namespace

SymmetricBuffer SymmetricBuffer::create_ipc(IpcWorld& world, size_t bytes) {
  EPX_CHECK(bytes > 0, InputError, "bytes", bytes, "> 0");
  const DeviceGuard guard(world.device());
  SymmetricBuffer out;
  out.rank_ = world.rank();
  out.world_size_ = world.size();
  out.device_ = world.device();
  out.bytes_ = bytes;
  out.ipc_.reset(new detail::IpcMappings());
  out.ipc_->device = world.device();
  const std::vector<uint8_t*> bases = world.handles() == IpcHandles::kPosixFd
                                          ? share_posix_fd(world, *out.ipc_, bytes)
                                          : share_cuda_ipc(world, *out.ipc_, bytes);
  out.local_ = bases[size_t(world.rank())];
  const Step table = attempt([&] {
    EPX_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&out.peers_dev_),
                              sizeof(uint8_t*) * bases.size()));
    EPX_CUDA_CHECK(cudaMemcpy(out.peers_dev_, bases.data(), sizeof(uint8_t*) * bases.size(),
                              cudaMemcpyHostToDevice));
    // A pageable copy may return before it lands: the table is complete before any kernel of
    // this rank (on a stream of its own) reads it.
    EPX_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  });
  // Also the closing barrier: no rank returns before every rank's table is complete.
  (void)gather_checked(world.bootstrap(), "building the peer table", table, "");
  return out;
}

}  // namespace epx
