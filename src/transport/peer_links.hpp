#pragma once
// What the worlds require of the links between their GPUs, and the seam through which they ask.
//
// epx's kernels read and write their peers' memory, and dispatch reserves rows there with
// system-scope atomics (`next_row` in the peer engine, `expert_rows` in both engines): a pair of
// GPUs needs peer access and native peer atomics (NVLink, or a PCIe P2P path that carries
// atomics). Where atomics are not native, the atomics silently fail to be atomic. Every world
// checks every pair of its ranks on distinct GPUs before it hands out memory, and refuses with an
// UnsupportedError naming the pair. Ranks sharing a GPU need nothing.
//
// One process (InProcessWorld) asks about each pair of its GPUs. Worlds of one process per rank
// exchange what each process can see: each reports, for every pair of ranks whose GPUs it can
// see (CUDA_VISIBLE_DEVICES may hide some), what the driver says, and every rank combines the
// reports; a pair that no process can see is not checked (give the processes every GPU and pick
// one with the world's `device` argument for the check to cover it).
//
// No CUDA here: the combination is plain data, so that the CPU tests hold it to its rules.

#include <functional>
#include <string>
#include <vector>

namespace epx {
class Bootstrap;
}

namespace epx::transport {

struct PeerLink {
  bool access = false;          // cudaDeviceCanAccessPeer
  bool native_atomics = false;  // cudaDevP2PAttrNativeAtomicSupported
};

// from_device's kernels reaching to_device's memory; both CUDA ordinals of this process.
using PeerLinkQuery = std::function<PeerLink(int from_device, int to_device)>;

// Test seam: the query every world uses from now on (an empty function restores the driver's
// query, which lives with the worlds in the CUDA library). Returns the previous one. Tests use
// it to see a world's refusal on machines whose GPUs all have native atomics, or on one GPU.
PeerLinkQuery set_peer_link_query(PeerLinkQuery query);
// The installed test query (empty when none).
PeerLinkQuery installed_peer_link_query();

// One process's report: size() * size() characters, entry i * W + j for rank i's kernels
// reaching rank j's memory: '=' same GPU, '?' one of the two GPUs is not visible here, 'x' no
// peer access, 'p' peer access without native atomics, 'a' both.
// gpu_of_rank[r]: an identity of rank r's GPU that is the same in every process (its UUID);
// ordinal_of_rank[r]: that GPU's ordinal in this process, or -1 when it is not visible here.
std::string link_report(const std::vector<std::string>& gpu_of_rank,
                        const std::vector<int>& ordinal_of_rank, const PeerLinkQuery& query);

// Every process's report (one, for an InProcessWorld): UnsupportedError naming the first pair of
// ranks (i, j), in row-major order, that any report finds without peer access or without native
// atomics; `label_of_rank[r]` says which GPU rank r is on (e.g. "GPU 1" or a PCI bus id) and
// `world` which world refuses. InputError for reports of the wrong size.
void require_peer_links(const std::vector<std::string>& reports,
                        const std::vector<std::string>& label_of_rank, const char* world);

// ---- defined with the worlds, in the CUDA library (peer_links_cuda.cpp) -----------------------

// The installed test query, else the driver's (cudaDeviceCanAccessPeer and
// cudaDeviceGetP2PAttribute(cudaDevP2PAttrNativeAtomicSupported)).
PeerLinkQuery peer_link_query();

// Collective over `bootstrap`'s ranks (worlds of one process per rank): every rank reports its
// GPU (`device`, an ordinal of this process) and the links it can see between the ranks' GPUs,
// and every rank throws the same UnsupportedError when a pair lacks peer access or native
// atomics (a rank that fails to report: its own error, the others a PeerError naming it).
void check_process_peer_links(Bootstrap& bootstrap, int device, const char* world);

}  // namespace epx::transport
