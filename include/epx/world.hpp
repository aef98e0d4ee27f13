#pragma once
// Worlds: how ranks reach each other (DESIGN §3). A world only produces peer tables and
// placement facts; the kernels are the same in every world. InProcessWorld: all ranks in this
// process; IpcWorld: one process per rank on one node.

#include <atomic>
#include <memory>
#include <vector>

#include "epx/bootstrap.hpp"

namespace epx {

// N ranks in one process, on 1..N GPUs. Rank r runs on devices[r % devices.size()]. Ranks that
// share a GPU run their kernels concurrently on their own streams, which only works while all of
// their blocks are resident together, so each rank may launch at most sm_budget(r) blocks per
// kernel (the GPU's multiprocessors divided by the ranks placed on it).
//
// Each rank's stream needs a hardware work queue of its own: a kernel queued behind another
// rank's spinning kernel would wait for it. CUDA gives a process CUDA_DEVICE_MAX_CONNECTIONS
// queues per GPU (default 8, at most 32), fixed when its first CUDA call creates the context, so
// a process that places more ranks on one GPU must set it first (the `epx` CLI sets 32).
//
// Throws UnsupportedError when no GPU is visible, InputError for a bad rank count or device,
// ConfigError when more ranks share a GPU than CUDA_DEVICE_MAX_CONNECTIONS allows,
// UnsupportedError naming the pair when two of its GPUs lack peer access or native peer atomics
// (dispatch reserves rows in peers' memory with system-scope atomics, which a PCIe link without
// native atomics silently breaks). The calling thread's current device is left as it was (as by
// every epx call that visits other GPUs).
class InProcessWorld {
 public:
  explicit InProcessWorld(int num_ranks, std::vector<int> devices = {});

  int size() const { return num_ranks_; }
  int device_of(int rank) const;
  int ranks_on_device(int device) const;
  int num_sms(int rank) const;     // multiprocessors of the rank's GPU
  int sm_budget(int rank) const;   // blocks one kernel of this rank may use

 private:
  int num_ranks_;
  std::vector<int> devices_;
  std::vector<int> sms_;  // per entry of devices_
};

// How an IpcWorld shares device memory between its processes.
//
// Memory cost of kCudaIpc on several GPUs (not measured here; what CUDA documents): its handles
// are opened with cudaIpcMemLazyEnablePeerAccess, and opening a peer's allocation may create a
// CUDA context for the peer's GPU in this process, so that with one process per GPU on a node
// every process may hold a context on every GPU — a few hundred MiB each, gigabytes per GPU at
// 8 GPUs — that the engine's own memory budget does not see. kPosixFd maps the peers' memory
// into this process's one context (cuMemImportFromShareableHandle + cuMemMap + cuMemSetAccess
// for this GPU only) and creates no context on another GPU: it is what kAuto picks wherever the
// bootstrap can pass descriptors (UnixSocketBootstrap, `epx launch`). kCudaIpc remains for a
// framework's bootstrap that cannot (a CallbackBootstrap over torch.distributed); there, give
// each process only its own GPU (CUDA_VISIBLE_DEVICES) if the extra contexts matter.
enum class IpcHandles {
  kAuto,     // kPosixFd when every rank's bootstrap and GPU support it, else kCudaIpc
  kPosixFd,  // cuMem allocations exported as POSIX file descriptors, passed over Unix sockets
  kCudaIpc,  // cudaIpcGetMemHandle / cudaIpcOpenMemHandle, exchanged as bytes (any bootstrap);
             // may create a context on every peer GPU in every process (see above)
};
const char* to_string(IpcHandles h);

// One process per rank on one node, as inference engines run (one process per GPU, or several
// processes sharing a GPU). This process is rank bootstrap->rank() and runs on one GPU; its
// SymmetricBuffer (SymmetricBuffer::create_ipc) maps every peer's buffer into this process, so
// the kernels see the same peer table as in an InProcessWorld.
//
// The constructor is collective over the bootstrap's ranks: each rank reports its host, GPU
// (UUID), multiprocessors and what it can share memory with, and every rank checks the
// others. Ranks on the same GPU (the same UUID, whatever CUDA_VISIBLE_DEVICES says) share its
// multiprocessors: sm_budget() = SMs / ranks_on_device(), as in an InProcessWorld (processes
// on one GPU are time-sliced unless MPS is running; correct, but not for timing).
//
// Errors, on every rank: UnsupportedError when a rank has no GPU, when ranks run on different
// hosts (use NcclWorld across nodes), when two ranks' GPUs cannot access each other (no P2P) or
// lack native peer atomics (naming the pair; each process reports the pairs of GPUs it can see,
// a pair hidden from every process by CUDA_VISIBLE_DEVICES is not checked), or when kPosixFd is
// requested and a rank cannot use it (the failing rank's own error; the
// others a PeerError naming it); InputError for a device outside the visible ones; the
// bootstrap's TimeoutError / PeerError when a rank does not take part.
class IpcWorld {
 public:
  // device < 0: the calling thread's current CUDA device (engines select it first, e.g. with
  // torch.cuda.set_device).
  explicit IpcWorld(std::unique_ptr<Bootstrap> bootstrap, int device = -1,
                    IpcHandles handles = IpcHandles::kAuto);
  // A SocketBootstrap on BootstrapOptions::from_env() (EPX_RANK, EPX_WORLD_SIZE,
  // EPX_BOOTSTRAP, EPX_TIMEOUT_MS, set by `epx launch`; or torchrun's, Slurm's, Open MPI's
  // variables). ConfigError when the launcher put the ranks on several nodes.
  static IpcWorld from_env(int device = -1, IpcHandles handles = IpcHandles::kAuto);

  IpcWorld(IpcWorld&&) noexcept = default;
  IpcWorld& operator=(IpcWorld&&) noexcept = default;
  ~IpcWorld() = default;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }         // this process's CUDA ordinal
  int ranks_on_device() const { return ranks_on_device_; }  // ranks on this rank's GPU
  int num_sms() const { return num_sms_; }
  int sm_budget() const;                          // blocks one kernel of this rank may use
  IpcHandles handles() const { return handles_; }  // kPosixFd or kCudaIpc, equal on all ranks
  Bootstrap& bootstrap() { return *bootstrap_; }

 private:
  std::unique_ptr<Bootstrap> bootstrap_;
  int rank_ = 0;
  int size_ = 1;
  int device_ = 0;
  int ranks_on_device_ = 1;
  int num_sms_ = 1;
  IpcHandles handles_ = IpcHandles::kCudaIpc;
};

// One process per rank through NCCL (DESIGN §3, §10): an NCCL communicator created from a unique
// id that rank 0 draws and the bootstrap passes on; symmetric memory through ncclMemAlloc and
// ncclCommWindowRegister (SymmetricBuffer::create_nccl), and the peer table from the window's
// LSA pointers (NCCL's device API), so the intra-node kernels are those of every other world.
// NVLink multicast is never used. Inter-node traffic (GIN put + signal) is not implemented:
// every rank must be in this communicator's LSA team (one node), UnsupportedError otherwise.
// UnsupportedError too, on every rank, when NCCL has no symmetric memory for the communicator
// (NCCL_CUMEM_ENABLE=0, NCCL_P2P_DISABLE=1, or no direct P2P: NCCL would hand out a window the
// GPU cannot read, and the first kernel would fault on every rank), naming those variables; and
// when two ranks' GPUs lack peer access or native peer atomics, naming the pair (as IpcWorld).
//
// NCCL is loaded at run time (dlopen of libnccl.so.2, or EPX_NCCL_LIBRARY), so that nothing else
// depends on it; UnsupportedError names what is missing when it cannot be loaded. One GPU per
// rank (NCCL refuses two ranks of a communicator on one GPU). Collective constructor; the world
// must outlive every SymmetricBuffer and All2All made from it.
class NcclWorld {
 public:
  // device < 0: the calling thread's current CUDA device. local_world_size: the ranks of each node
  // (BootstrapOptions' node layout; 0 = one node). On one node every rank reaches every other
  // rank's memory (NCCL's symmetric windows, every backend); across nodes only NCCL's collectives
  // connect them (backends naive and allgather_reducescatter, epx's collective engine).
  explicit NcclWorld(std::unique_ptr<Bootstrap> bootstrap, int device = -1,
                     int local_world_size = 0);
  // A SocketBootstrap on BootstrapOptions::from_env() (`epx launch` sets it up; across nodes,
  // torchrun's variables or EPX_BOOTSTRAP=tcp://HOST:PORT with Slurm's or Open MPI's).
  static NcclWorld from_env(int device = -1);
  NcclWorld(NcclWorld&&) noexcept;
  NcclWorld& operator=(NcclWorld&&) noexcept;
  ~NcclWorld();

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  int num_nodes() const { return nodes_; }
  int ranks_on_device() const { return 1; }
  int num_sms() const { return num_sms_; }
  int sm_budget() const { return num_sms_; }
  Bootstrap& bootstrap() { return *bootstrap_; }
  void* comm() const { return comm_; }  // ncclComm_t

  // NCCL's own collectives on this communicator, the yardstick `epx bench` times beside the
  // backends; enqueued on `stream` (a cudaStream_t). Collective over the world.
  // recv[r * bytes ..] = rank r's send[0 .. bytes).
  void all_gather(const void* send, void* recv, size_t bytes, void* stream);
  // recv[i] = sum over ranks of send[rank() * count + i], bf16 elements.
  void reduce_scatter_bf16(const void* send, void* recv, size_t count, void* stream);
  // Grouped send/recv: send_bytes[r] bytes from send + send_offsets[r] to rank r,
  // recv_bytes[r] bytes from rank r into recv + recv_offsets[r] (size() entries each).
  void all_to_all(const void* send, const size_t* send_offsets, const size_t* send_bytes,
                  void* recv, const size_t* recv_offsets, const size_t* recv_bytes, void* stream);
  // Aborts the communicator (any thread): NCCL's kernels in flight end, later calls on this
  // world throw StateError. For a watchdog that found a collective past its time.
  void abort();
  bool aborted() const { return aborted_.load(); }

 private:
  std::unique_ptr<Bootstrap> bootstrap_;
  void* comm_ = nullptr;
  int rank_ = 0;
  int size_ = 1;
  int device_ = 0;
  int num_sms_ = 1;
  int nodes_ = 1;
  std::atomic<bool> aborted_{false};
};

}  // namespace epx
