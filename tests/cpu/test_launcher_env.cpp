// BootstrapOptions from the launchers' environments (include/epx/bootstrap.hpp, src/core/env.cpp):
// `epx launch`, torchrun, Slurm and Open MPI, their precedence, the node layout and its checks,
// the rendezvous address each implies, partial and malformed sets; and ranks that meet through
// torchrun's variables alone, on 127.0.0.1.

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "bootstrap_harness.hpp"
#include "epx/bootstrap.hpp"
#include "epx/error.hpp"
#include "scoped_env.hpp"

namespace epx {
namespace {

using Env = std::map<std::string, std::string>;

BootstrapOptions parse(const Env& env) {
  return BootstrapOptions::parse_env([&](const char* name) -> const char* {
    const auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

::testing::AssertionResult refused(const Env& env, std::initializer_list<std::string> parts) {
  return throws_config_error([&] { (void)parse(env); }, parts);
}

const Env kTorchrun = {{"RANK", "5"},
                       {"WORLD_SIZE", "8"},
                       {"LOCAL_RANK", "1"},
                       {"LOCAL_WORLD_SIZE", "4"},
                       {"MASTER_ADDR", "node0"},
                       {"MASTER_PORT", "29500"}};
const Env kSlurm = {{"SLURM_PROCID", "6"},          {"SLURM_NTASKS", "8"},
                    {"SLURM_LOCALID", "2"},         {"SLURM_NODEID", "1"},
                    {"SLURM_NTASKS_PER_NODE", "4"}, {"EPX_BOOTSTRAP", "tcp://node0:29600"}};
const Env kMpi = {{"OMPI_COMM_WORLD_RANK", "3"},
                  {"OMPI_COMM_WORLD_SIZE", "4"},
                  {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                  {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                  {"EPX_BOOTSTRAP", "tcp://10.0.0.1:29600"}};

Env with(Env env, const Env& more) {
  for (const auto& [k, v] : more) env[k] = v;
  return env;
}
Env without(Env env, const std::string& name) {
  env.erase(name);
  return env;
}

TEST(LauncherEnv, NoLauncherIsOneRank) {
  const BootstrapOptions o = parse({{"LOCAL_RANK", "3"}});  // a stray LOCAL_RANK is no launcher
  EXPECT_EQ(o.launcher, "");
  EXPECT_EQ(o.world_size, 1);
  EXPECT_EQ(o.rank, 0);
  EXPECT_EQ(o.num_nodes(), 1);
}

TEST(LauncherEnv, EpxLaunchIsOneNode) {
  const BootstrapOptions o =
      parse({{"EPX_RANK", "2"}, {"EPX_WORLD_SIZE", "4"}, {"EPX_BOOTSTRAP", "@job"}});
  EXPECT_EQ(o.launcher, "epx");
  EXPECT_EQ(o.rank, 2);
  EXPECT_EQ(o.local_rank, 2);
  EXPECT_EQ(o.local_world_size, 4);
  EXPECT_EQ(o.num_nodes(), 1);
  EXPECT_EQ(o.address, "@job");
}

TEST(LauncherEnv, Torchrun) {
  const BootstrapOptions o = parse(with(kTorchrun, {{"EPX_TIMEOUT_MS", "250"}}));
  EXPECT_EQ(o.launcher, "torchrun");
  EXPECT_EQ(o.rank, 5);
  EXPECT_EQ(o.world_size, 8);
  EXPECT_EQ(o.local_rank, 1);
  EXPECT_EQ(o.local_world_size, 4);
  EXPECT_EQ(o.node(), 1);
  EXPECT_EQ(o.num_nodes(), 2);
  EXPECT_EQ(o.address, "tcp://node0:29501") << "MASTER_PORT + 1: torch's store has MASTER_PORT";
  EXPECT_EQ(o.timeout_ms, 250);
  EXPECT_EQ(parse(with(kTorchrun, {{"MASTER_ADDR", "fd00::7"}})).address, "tcp://[fd00::7]:29501");
  EXPECT_EQ(parse(with(kTorchrun, {{"EPX_BOOTSTRAP", "tcp://other:1234"}})).address,
            "tcp://other:1234");
  // One rank needs no rendezvous.
  const BootstrapOptions one =
      parse({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "1"}});
  EXPECT_EQ(one.world_size, 1);
  EXPECT_EQ(one.address, "");
}

TEST(LauncherEnv, Slurm) {
  BootstrapOptions o = parse(kSlurm);
  EXPECT_EQ(o.launcher, "slurm");
  EXPECT_EQ(o.rank, 6);
  EXPECT_EQ(o.world_size, 8);
  EXPECT_EQ(o.local_rank, 2);
  EXPECT_EQ(o.local_world_size, 4);
  EXPECT_EQ(o.node(), 1);
  EXPECT_EQ(o.address, "tcp://node0:29600");
  // The ranks per node from the step's or the job's list when --ntasks-per-node was not given.
  const Env no_per_node = without(kSlurm, "SLURM_NTASKS_PER_NODE");
  EXPECT_EQ(parse(with(no_per_node, {{"SLURM_TASKS_PER_NODE", "4(x2)"}})).local_world_size, 4);
  EXPECT_EQ(parse(with(no_per_node,
                       {{"SLURM_STEP_TASKS_PER_NODE", "4,4"}, {"SLURM_TASKS_PER_NODE", "8(x2)"}}))
                .local_world_size,
            4);
}

TEST(LauncherEnv, OpenMpi) {
  const BootstrapOptions o = parse(kMpi);
  EXPECT_EQ(o.launcher, "mpi");
  EXPECT_EQ(o.rank, 3);
  EXPECT_EQ(o.world_size, 4);
  EXPECT_EQ(o.local_rank, 1);
  EXPECT_EQ(o.local_world_size, 2);
  EXPECT_EQ(o.node(), 1);
  EXPECT_EQ(o.address, "tcp://10.0.0.1:29600");
}

TEST(LauncherEnv, Precedence) {
  const Env epx = {{"EPX_RANK", "1"}, {"EPX_WORLD_SIZE", "2"}, {"EPX_BOOTSTRAP", "@p"}};
  EXPECT_EQ(parse(with(with(with(kTorchrun, kSlurm), kMpi), epx)).launcher, "epx");
  EXPECT_EQ(parse(with(with(kTorchrun, kSlurm), kMpi)).launcher, "torchrun");
  EXPECT_EQ(parse(with(kSlurm, kMpi)).launcher, "slurm");
  EXPECT_EQ(parse(kMpi).launcher, "mpi");
}

TEST(LauncherEnv, PartialSetsNameTheVariables) {
  EXPECT_TRUE(refused(
      without(kTorchrun, "LOCAL_WORLD_SIZE"),
      {"torchrun's variables are set in part", "RANK = \"5\"", "but LOCAL_WORLD_SIZE not"}));
  EXPECT_TRUE(refused({{"WORLD_SIZE", "2"}}, {"but RANK, LOCAL_RANK, LOCAL_WORLD_SIZE not"}));
  EXPECT_TRUE(refused(without(kSlurm, "SLURM_LOCALID"), {"slurm's", "but SLURM_LOCALID not"}));
  EXPECT_TRUE(refused(without(kSlurm, "SLURM_NTASKS_PER_NODE"),
                      {"none of SLURM_NTASKS_PER_NODE, SLURM_STEP_TASKS_PER_NODE"}));
  EXPECT_TRUE(refused(without(kMpi, "OMPI_COMM_WORLD_LOCAL_SIZE"),
                      {"Open MPI's", "but OMPI_COMM_WORLD_LOCAL_SIZE not"}));
  EXPECT_TRUE(refused({{"EPX_RANK", "0"}}, {"EPX_RANK = \"0\" is set but EPX_WORLD_SIZE is not"}));
}

TEST(LauncherEnv, RendezvousAddress) {
  EXPECT_TRUE(refused(without(kTorchrun, "MASTER_PORT"), {"torchrun's MASTER_PORT is not set"}));
  EXPECT_TRUE(refused(with(kTorchrun, {{"MASTER_PORT", "65535"}}),
                      {"MASTER_PORT = \"65535\"", "[1, 65534]", "MASTER_PORT + 1"}));
  EXPECT_TRUE(refused(with(kTorchrun, {{"MASTER_ADDR", "a b"}}), {"MASTER_ADDR = \"a b\""}));
  EXPECT_TRUE(
      refused(without(kSlurm, "EPX_BOOTSTRAP"),
              {"Slurm names no rendezvous address", "EPX_BOOTSTRAP=tcp://<first host>:<port>"}));
  EXPECT_TRUE(refused(without(kMpi, "EPX_BOOTSTRAP"), {"Open MPI names no rendezvous address"}));
  // Several nodes cannot meet on a Unix socket.
  EXPECT_TRUE(refused(with(kSlurm, {{"EPX_BOOTSTRAP", "@job"}}),
                      {"EPX_BOOTSTRAP = \"@job\" is a Unix socket", "on 2 nodes"}));
  // One node can.
  EXPECT_EQ(parse(with(kSlurm, {{"SLURM_NTASKS_PER_NODE", "8"},
                                {"SLURM_NODEID", "0"},
                                {"SLURM_LOCALID", "6"},
                                {"EPX_BOOTSTRAP", "@job"}}))
                .address,
            "@job");
  EXPECT_TRUE(refused(with(kMpi, {{"EPX_BOOTSTRAP", "tcp://host"}}),
                      {"EPX_BOOTSTRAP = \"tcp://host\"", "tcp://HOST:PORT"}));
  EXPECT_TRUE(refused(with(kMpi, {{"EPX_BOOTSTRAP", ""}}), {"EPX_BOOTSTRAP = \"\""}));
}

TEST(LauncherEnv, LayoutChecks) {
  EXPECT_TRUE(refused(with(kTorchrun, {{"LOCAL_WORLD_SIZE", "3"}, {"LOCAL_RANK", "2"}}),
                      {"LOCAL_WORLD_SIZE = 3 with WORLD_SIZE = 8", "a divisor of WORLD_SIZE"}));
  EXPECT_TRUE(refused(with(kTorchrun, {{"LOCAL_RANK", "0"}}), {"RANK = 5 and LOCAL_RANK = 0",
                                                               "expected LOCAL_RANK = RANK % "
                                                               "LOCAL_WORLD_SIZE = 1",
                                                               "by block"}));
  EXPECT_TRUE(refused(with(kTorchrun, {{"LOCAL_RANK", "4"}}),
                      {"LOCAL_RANK = \"4\"", "[0, LOCAL_WORLD_SIZE = 4)"}));
  EXPECT_TRUE(refused(with(kSlurm, {{"SLURM_NODEID", "0"}}),
                      {"SLURM_NODEID = 0 with SLURM_PROCID = 6", "expected node 1"}));
  const Env no_per_node = without(kSlurm, "SLURM_NTASKS_PER_NODE");
  EXPECT_TRUE(refused(with(no_per_node, {{"SLURM_TASKS_PER_NODE", "4(x1),2(x2)"}}),
                      {"SLURM_TASKS_PER_NODE = \"4(x1),2(x2)\"",
                       "different numbers of ranks (4 "
                       "and 2)"}));
  for (const char* bad : {"", "4(x", "4(2)", "x", "4,", "0", "65(x2)"}) {
    EXPECT_TRUE(refused(with(no_per_node, {{"SLURM_TASKS_PER_NODE", bad}}),
                        {"SLURM_TASKS_PER_NODE = \"" + std::string(bad) + "\"", "\"4(x2),4\""}))
        << bad;
  }
}

TEST(LauncherEnv, MalformedValuesNameVariableValueAndBound) {
  EXPECT_TRUE(refused(with(kTorchrun, {{"RANK", "-1"}}), {"RANK = \"-1\"", "[0, WORLD_SIZE = 8)"}));
  EXPECT_TRUE(refused(with(kTorchrun, {{"RANK", "8"}}), {"RANK = \"8\"", "[0, WORLD_SIZE = 8)"}));
  EXPECT_TRUE(refused(with(kTorchrun, {{"WORLD_SIZE", "0"}}), {"WORLD_SIZE = \"0\"", "[1, 64]"}));
  EXPECT_TRUE(refused(with(kTorchrun, {{"WORLD_SIZE", "65"}}), {"WORLD_SIZE = \"65\""}));
  EXPECT_TRUE(
      refused(with(kSlurm, {{"SLURM_NTASKS_PER_NODE", "4x"}}), {"SLURM_NTASKS_PER_NODE = \"4x\""}));
  EXPECT_TRUE(refused(with(kMpi, {{"OMPI_COMM_WORLD_LOCAL_RANK", " 1"}}),
                      {"OMPI_COMM_WORLD_LOCAL_RANK = \" 1\""}));
  EXPECT_TRUE(refused(with(kMpi, {{"EPX_TIMEOUT_MS", "0"}}), {"EPX_TIMEOUT_MS = \"0\""}));
}

TEST(LauncherEnv, ValidateChecksTheLayoutFields) {
  BootstrapOptions o = options(5, 8, "tcp://node0:1");
  o.local_rank = 1;
  o.local_world_size = 4;
  EXPECT_NO_THROW(o.validate());
  o.local_rank = 0;
  EXPECT_TRUE(throws_config_error([&] { o.validate(); }, {"rank 5 has local_rank = 0", "block"}));
  o.local_rank = 2;
  o.local_world_size = 3;
  EXPECT_TRUE(throws_config_error([&] { o.validate(); }, {"local_world_size = 3", "divisor"}));
  o.local_world_size = 4;
  o.local_rank = 1;
  o.address = "@unix";
  EXPECT_TRUE(throws_config_error([&] { o.validate(); }, {"address = \"@unix\"", "2 nodes"}));
  o.local_world_size = 0;  // not known: one node
  EXPECT_TRUE(throws_config_error([&] { o.validate(); }, {"local_rank = 1"}));
  o.local_rank = 0;
  EXPECT_NO_THROW(o.validate());
}

TEST(LauncherEnv, FromEnvReadsTorchrunsVariables) {
  ScopedEnv a("EPX_RANK", nullptr), b("EPX_WORLD_SIZE", nullptr), c("EPX_BOOTSTRAP", nullptr);
  ScopedEnv d("RANK", "1"), e("WORLD_SIZE", "2"), f("LOCAL_RANK", "1"), g("LOCAL_WORLD_SIZE", "2");
  ScopedEnv h("MASTER_ADDR", "127.0.0.1"), i("MASTER_PORT", "40000");
  const BootstrapOptions o = BootstrapOptions::from_env();
  EXPECT_EQ(o.launcher, "torchrun");
  EXPECT_EQ(o.rank, 1);
  EXPECT_EQ(o.local_world_size, 2);
  EXPECT_EQ(o.address, "tcp://127.0.0.1:40001");
}

// Two "nodes" of one rank each, on this host, meeting through torchrun's variables only.
TEST(LauncherEnv, TorchrunRanksMeetAtMasterPortPlusOne) {
  const std::string address = loopback_tcp_address();  // epx's port: MASTER_PORT + 1
  const int port = std::stoi(address.substr(address.rfind(':') + 1));
  const auto out = run_processes(2, [&](int r) {
    const Env env = {{"RANK", std::to_string(r)},  {"WORLD_SIZE", "2"},
                     {"LOCAL_RANK", "0"},          {"LOCAL_WORLD_SIZE", "1"},
                     {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port - 1)},
                     {"EPX_TIMEOUT_MS", "5000"}};
    const BootstrapOptions o = parse(env);
    require(o.address == address && o.num_nodes() == 2 && o.node() == r, "options");
    SocketBootstrap b(o);
    gather_rounds(b);
  });
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(succeeded(out[size_t(r)])) << "rank " << r;
}

}  // namespace
}  // namespace epx
