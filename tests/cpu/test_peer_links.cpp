// What the worlds require of the links between their GPUs (src/transport/peer_links.hpp): the
// reports built through an injected query, and their combination into one verdict — on the
// CPU, with GPUs that lack native peer atomics made up by the query.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "epx/error.hpp"
#include "transport/peer_links.hpp"

namespace epx {
namespace {

using transport::link_report;
using transport::PeerLink;
using transport::PeerLinkQuery;
using transport::require_peer_links;

// Every pair linked with access and atomics, except the pairs (in either direction) listed.
PeerLinkQuery query_without(std::set<std::pair<int, int>> no_atomics,
                            std::set<std::pair<int, int>> no_access = {}) {
  return [=](int a, int b) {
    auto has = [&](const std::set<std::pair<int, int>>& s) {
      return s.count({a, b}) > 0 || s.count({b, a}) > 0;
    };
    return PeerLink{.access = !has(no_access), .native_atomics = !has(no_atomics) && !has(no_access)};
  };
}

std::vector<std::string> gpus_of(const std::vector<int>& devices) {
  std::vector<std::string> out;
  for (int d : devices) out.push_back(std::to_string(d));
  return out;
}

std::vector<std::string> labels_of(const std::vector<int>& devices) {
  std::vector<std::string> out;
  for (int d : devices) out.push_back("GPU " + std::to_string(d));
  return out;
}

// The refusal's message, or "" when the reports pass.
std::string verdict(const std::vector<std::string>& reports, const std::vector<int>& devices) {
  try {
    require_peer_links(reports, labels_of(devices), "TestWorld");
    return "";
  } catch (const UnsupportedError& e) {
    return e.what();
  }
}

TEST(PeerLinks, ReportMarksEveryPairOnce) {
  // Ranks 0..3 on GPUs 0, 1, 0, 1; GPUs 0 and 1 without native atomics.
  const std::vector<int> dev = {0, 1, 0, 1};
  const std::string r = link_report(gpus_of(dev), dev, query_without({{0, 1}}));
  EXPECT_EQ(r, "=p=p"
               "p=p="
               "=p=p"
               "p=p=");
}

TEST(PeerLinks, SameGpuIsNeverAsked) {
  const std::vector<int> dev = {0, 0, 0, 0};
  int asked = 0;
  const std::string r = link_report(gpus_of(dev), dev, [&](int, int) {
    ++asked;
    return PeerLink{};
  });
  EXPECT_EQ(asked, 0);
  EXPECT_EQ(r, std::string(16, '='));
  EXPECT_EQ(verdict({r}, dev), "");
}

TEST(PeerLinks, NativeAtomicsEverywherePass) {
  const std::vector<int> dev = {0, 1, 2, 3, 4, 5, 6, 7};
  EXPECT_EQ(verdict({link_report(gpus_of(dev), dev, query_without({}))}, dev), "");
}

TEST(PeerLinks, MissingNativeAtomicsAreRefusedNamingThePair) {
  const std::vector<int> dev = {0, 1, 2, 3, 4, 5, 6, 7};
  const std::string why = verdict({link_report(gpus_of(dev), dev, query_without({{2, 5}}))}, dev);
  EXPECT_NE(why.find("TestWorld"), std::string::npos) << why;
  EXPECT_NE(why.find("rank 2 (GPU 2) and rank 5 (GPU 5)"), std::string::npos) << why;
  EXPECT_NE(why.find("no native atomics"), std::string::npos) << why;
  EXPECT_NE(why.find("cudaDevP2PAttrNativeAtomicSupported = 0"), std::string::npos) << why;
}

TEST(PeerLinks, MissingPeerAccessIsRefusedNamingThePair) {
  const std::vector<int> dev = {0, 1, 2, 3};
  const std::string why =
      verdict({link_report(gpus_of(dev), dev, query_without({}, {{1, 3}}))}, dev);
  EXPECT_NE(why.find("rank 1 (GPU 1) and rank 3 (GPU 3)"), std::string::npos) << why;
  EXPECT_NE(why.find("no peer access"), std::string::npos) << why;
}

// Processes that each see only their own GPU (CUDA_VISIBLE_DEVICES) report '?': the pair is not
// checked. A process that sees both GPUs decides, and the worse report wins.
TEST(PeerLinks, ProcessesCombineWhatEachCanSee) {
  const std::vector<int> dev = {0, 1};
  const std::vector<std::string> gpus = gpus_of(dev);
  const PeerLinkQuery pcie = query_without({{0, 1}});
  const std::string only_own_0 = link_report(gpus, {0, -1}, pcie);
  const std::string only_own_1 = link_report(gpus, {-1, 0}, pcie);
  EXPECT_EQ(only_own_0, "=\?\?=");  // (escaped: no trigraph)
  EXPECT_EQ(verdict({only_own_0, only_own_1}, dev), "");
  const std::string sees_both = link_report(gpus, {0, 1}, pcie);
  EXPECT_NE(verdict({only_own_0, sees_both}, dev).find("no native atomics"), std::string::npos);
  const std::string nvlink = link_report(gpus, {0, 1}, query_without({}));
  EXPECT_NE(verdict({nvlink, sees_both}, dev).find("no native atomics"), std::string::npos);
  EXPECT_EQ(verdict({nvlink, only_own_1}, dev), "");
}

TEST(PeerLinks, MalformedReportIsAnInputError) {
  EXPECT_THROW(require_peer_links({"=a"}, {"GPU 0", "GPU 1"}, "TestWorld"), InputError);
}

// The seam: what a test installs is what the worlds use, until it is taken out again.
TEST(PeerLinks, TestQueryCanBeInstalledAndRemoved) {
  const PeerLinkQuery before = transport::set_peer_link_query(query_without({{0, 1}}));
  const PeerLinkQuery installed = transport::installed_peer_link_query();
  ASSERT_TRUE(bool(installed));
  EXPECT_FALSE(installed(0, 1).native_atomics);
  EXPECT_TRUE(installed(0, 2).native_atomics);
  (void)transport::set_peer_link_query(before);
  EXPECT_EQ(bool(transport::installed_peer_link_query()), bool(before));
}

}  // namespace
}  // namespace epx
