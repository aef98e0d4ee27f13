// The combination of the worlds' peer-link reports (peer_links.hpp): no CUDA.
#include "transport/peer_links.hpp"

#include <fmt/format.h>

#include <mutex>
#include <utility>

#include "epx/error.hpp"

namespace epx::transport {
namespace {

std::mutex& query_mutex() {
  static std::mutex m;
  return m;
}

PeerLinkQuery& query_slot() {
  static PeerLinkQuery q;
  return q;
}

// Worse links rank higher: what one report saw wins over what another could not see.
int severity(char c) {
  switch (c) {
    case 'x': return 3;
    case 'p': return 2;
    case 'a': return 1;
    default: return 0;  // '=' and '?'
  }
}

}  // namespace

PeerLinkQuery set_peer_link_query(PeerLinkQuery query) {
  std::lock_guard<std::mutex> lock(query_mutex());
  return std::exchange(query_slot(), std::move(query));
}

PeerLinkQuery installed_peer_link_query() {
  std::lock_guard<std::mutex> lock(query_mutex());
  return query_slot();
}

std::string link_report(const std::vector<std::string>& gpu_of_rank,
                        const std::vector<int>& ordinal_of_rank, const PeerLinkQuery& query) {
  const size_t W = gpu_of_rank.size();
  EPX_CHECK(ordinal_of_rank.size() == W, InputError, "ordinal_of_rank.size()",
            ordinal_of_rank.size(), fmt::format("one per rank ({})", W));
  std::string out(W * W, '?');
  for (size_t i = 0; i < W; ++i) {
    for (size_t j = 0; j < W; ++j) {
      char& e = out[i * W + j];
      if (gpu_of_rank[i] == gpu_of_rank[j]) {
        e = '=';
      } else if (ordinal_of_rank[i] >= 0 && ordinal_of_rank[j] >= 0) {
        const PeerLink l = query(ordinal_of_rank[i], ordinal_of_rank[j]);
        e = !l.access ? 'x' : !l.native_atomics ? 'p' : 'a';
      }
    }
  }
  return out;
}

void require_peer_links(const std::vector<std::string>& reports,
                        const std::vector<std::string>& label_of_rank, const char* world) {
  const size_t W = label_of_rank.size();
  for (size_t p = 0; p < reports.size(); ++p) {
    EPX_CHECK(reports[p].size() == W * W, InputError, fmt::format("peer-link report {} size", p),
              reports[p].size(), fmt::format("world size squared ({})", W * W));
  }
  for (size_t i = 0; i < W; ++i) {
    for (size_t j = 0; j < W; ++j) {
      char worst = '?';
      for (const std::string& r : reports)
        if (severity(r[i * W + j]) > severity(worst)) worst = r[i * W + j];
      if (worst != 'x' && worst != 'p') continue;
      const std::string pair = fmt::format("rank {} ({}) and rank {} ({})", i, label_of_rank[i], j,
                                           label_of_rank[j]);
      if (worst == 'x') {
        EPX_THROW(UnsupportedError,
                  fmt::format("{}: {}: {} cannot access the memory of {} (no peer access): the "
                              "ranks' GPUs must reach each other over NVLink or PCIe P2P",
                              world, pair, label_of_rank[i], label_of_rank[j]));
      }
      EPX_THROW(UnsupportedError,
                fmt::format("{}: {}: {} has no native atomics on the memory of {} "
                            "(cudaDevP2PAttrNativeAtomicSupported = 0, e.g. GPUs linked over "
                            "PCIe): epx's dispatch reserves rows in its peers' memory with "
                            "system-scope atomics, which such a link does not carry (they would "
                            "silently lose updates); use GPUs linked by NVLink",
                            world, pair, label_of_rank[i], label_of_rank[j]));
    }
  }
}

}  // namespace epx::transport
