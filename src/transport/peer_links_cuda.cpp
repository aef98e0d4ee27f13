// The driver's side of the worlds' peer-link checks (peer_links.hpp).
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <string>
#include <vector>

#include "epx/bootstrap.hpp"
#include "epx/cuda_check.hpp"
#include "transport/collective.hpp"
#include "transport/peer_links.hpp"

namespace epx::transport {
namespace {

PeerLink driver_peer_link(int from, int to) {
  int access = 0, atomics = 0;
  EPX_CUDA_CHECK(cudaDeviceCanAccessPeer(&access, from, to));
  EPX_CUDA_CHECK(
      cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, from, to));
  return PeerLink{.access = access != 0, .native_atomics = atomics != 0};
}

std::string uuid_hex(const cudaUUID_t& u) {
  std::string out;
  for (char c : u.bytes) out += fmt::format("{:02x}", static_cast<unsigned char>(c));
  return out;
}

}  // namespace

PeerLinkQuery peer_link_query() {
  PeerLinkQuery q = installed_peer_link_query();
  return q ? q : PeerLinkQuery(driver_peer_link);
}

void check_process_peer_links(Bootstrap& bootstrap, int device, const char* world) {
  // 1. Every rank's GPU: its UUID (the same in every process) and PCI bus id (for people).
  std::string me;
  std::vector<std::string> uuids_here;  // [ordinal] of this process
  const Step described = attempt([&] {
    const int count = cuda_device_count();
    for (int d = 0; d < count; ++d) {
      cudaDeviceProp prop{};
      EPX_CUDA_CHECK(cudaGetDeviceProperties(&prop, d));
      uuids_here.push_back(uuid_hex(prop.uuid));
    }
    cudaDeviceProp prop{};
    EPX_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    me = fmt::format("{} {:04x}:{:02x}:{:02x}", uuid_hex(prop.uuid), prop.pciDomainID,
                     prop.pciBusID, prop.pciDeviceID);
  });
  const std::vector<std::string> all =
      gather_checked(bootstrap, "describing the ranks' GPUs", described, me);
  std::vector<std::string> gpu_of_rank, label_of_rank;
  for (const std::string& a : all) {
    const size_t sp = a.find(' ');
    gpu_of_rank.push_back(a.substr(0, sp));
    label_of_rank.push_back("GPU " + (sp == std::string::npos ? a : a.substr(sp + 1)));
  }
  // 2. What this process sees of every pair, to every rank.
  std::string report;
  const Step seen = attempt([&] {
    std::vector<int> ordinal(gpu_of_rank.size(), -1);
    for (size_t r = 0; r < gpu_of_rank.size(); ++r)
      for (size_t d = 0; d < uuids_here.size(); ++d)
        if (uuids_here[d] == gpu_of_rank[r]) ordinal[r] = int(d);
    report = link_report(gpu_of_rank, ordinal, peer_link_query());
  });
  const std::vector<std::string> reports =
      gather_checked(bootstrap, "checking the links between the ranks' GPUs", seen, report);
  // The same reports on every rank: the same verdict on every rank.
  require_peer_links(reports, label_of_rank, world);
}

}  // namespace epx::transport
