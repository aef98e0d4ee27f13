// `epx serve-bench`: inter-token latency of a simulated serving workload per backend (DESIGN §1,
// the end-to-end test plan of the system we descend from: DeepSeek-R1 with 8-way data + expert
// parallelism, naive vs allgather_reducescatter vs low_latency).
//
// W in-process ranks on GPU 0, one host thread and one stream each. The workload and its
// chunked-prefill scheduler live in serve_sched.hpp (no CUDA, unit-tested). Every engine step:
// the scheduler gives each rank its tokens; each rank runs --layers MoE layers (MoeLayer,
// include/epx/moe.hpp) on them through the backend's All2All, in chunks of --chunk-size with the
// same chunk count on every rank; the step's wall time runs from the release of all ranks'
// threads until every thread has drained its stream and joined. Output tokens are stamped with the
// end of their step. With --cuda-graph each backend runs a second time with its decode-only steps
// replayed as per-rank CUDA graphs (one per batch bucket, MoeLayer's captured path). Only the MoE
// layers are simulated (no attention, no dense layers), and every layer reads the step's input
// activations (there is no residual stream).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.hpp"
#include "commands.hpp"
#include "epx/config.hpp"
#include "epx/error.hpp"
#include "reference/moe_ref.hpp"
#include "serve_sched.hpp"
#if EPX_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "epx/cuda_check.hpp"
#include "testing/graph_capture.hpp"
#include "epx/all2all.hpp"
#include "epx/moe.hpp"
#include "epx/world.hpp"
#endif

namespace epx::cli {
namespace {

constexpr double kProgressEveryS = 5.0;
constexpr int kDeepSeekMoeLayers = 58;  // DeepSeek-R1: 61 layers, the first 3 dense

enum class WeightsMode { kAuto, kDistinct, kShared };

struct ServeFlags {
  serve::Workload workload;  // defaults: serve_sched.hpp
  std::string backends = "naive,allgather_reducescatter,low_latency";
  int hidden = 7168;
  int intermediate = 2048;
  int experts = 256;
  int topk = 8;
  int shared_intermediate = 2048;
  int layers = 2;
  std::string weights = "auto";
  std::string dtype = "bf16-to-fp8";
  std::string layout = "token";
  uint64_t seed = 1;
  std::string json_path;
  std::string preset;
  bool cuda_graph = false;
  std::string graph_buckets;  // --graph-buckets: comma list, empty = 1, 2, 4, ... up to the largest
  std::string graph_scope = "rank";  // --graph-scope
  std::string graph_split;    // --graph-split: empty = expert (rank scope)
  std::string graph_experts;  // --graph-experts: empty = auto
};

struct ServePlan {
  serve::Workload workload;
  std::vector<Backend> backends;
  ref::moe::MoeShape shape;
  EpConfig cfg;  // one rank's; max_tokens_per_rank = --chunk-size
  int layers = 2;
  WeightsMode weights = WeightsMode::kAuto;
  LaunchSource launch;
  uint64_t seed = 1;
  std::string json_path;
  std::string preset_note;  // empty unless --preset
  bool cuda_graph = false;  // also run every backend with decode steps as CUDA graph replays
  std::vector<int> graph_buckets;  // with cuda_graph: the decode batch sizes captured
  bool world_graphs = false;       // --graph-scope world: one graph of every rank per bucket
  bool split_graphs = true;        // --graph-split expert: expert stages in graphs of their own
  CaptureExperts graph_experts = CaptureExperts::kSwitch;  // --graph-experts
};

// --graph-experts auto: all-rows whenever ranks share the GPU. Measured on an H200 (32 hardware
// queues), decode graphs with SWITCH nodes stop from 20 in-process ranks (split or not; at 16 one
// run of two), and once at 8 ranks with two layers sharing one MoeLayer (a rank late by one call,
// 10 s); graphs without conditional nodes replayed every time, at 8 and 32 ranks.

// --preset original: the original test's numbers, scaled to one GPU (see the help text).
constexpr int kOrigPrompts = 2000, kOrigIsl = 2000, kOrigOsl = 100, kOrigConcurrency = 2000,
              kOrigChunk = 1024, kOrigBatched = 32768;

std::string preset_help() {
  return fmt::format(
      "original: the DeepSeek-R1 DP{0}/EP{0} test of the system we descend from ({1} prompts, "
      "ISL {2}, OSL {3}, concurrency {4}, chunk {5}, {6} batched tokens per rank) scaled to one "
      "GPU: the --world ranks share one GPU, so prompts, concurrency and batched tokens are "
      "divided by --world ({7}, {7}, {8} at 8 ranks: the GPU carries per step the tokens one "
      "GPU of the original carried); ISL, OSL and chunk are kept; the model's {9} MoE layers "
      "become --layers. Flags given explicitly win over the preset",
      8, kOrigPrompts, kOrigIsl, kOrigOsl, kOrigConcurrency, kOrigChunk, kOrigBatched,
      (kOrigPrompts + 7) / 8, kOrigBatched / 8, kDeepSeekMoeLayers);
}

// Sets the workload flags the user did not give (`given` holds the names of those given);
// returns the line that says what it did.
std::string apply_preset(ServeFlags& f, const std::map<std::string, bool>& given) {
  if (f.preset.empty()) return "";
  if (f.preset != "original") {
    EPX_THROW(ConfigError, fmt::format("--preset = '{}', expected original", f.preset));
  }
  serve::Workload& w = f.workload;
  check_range("--world", w.world, 1, 32, "in-process ranks on one GPU");
  const int div = w.world;
  auto set = [&](const char* flag, int& field, int value) {
    if (!given.count(flag)) field = value;
  };
  set("--num-prompts", w.num_prompts, (kOrigPrompts + div - 1) / div);
  set("--concurrency", w.concurrency, (kOrigConcurrency + div - 1) / div);
  set("--max-batched-tokens", w.max_batched_tokens, std::max(1, kOrigBatched / div));
  set("--isl", w.isl, kOrigIsl);
  set("--osl", w.osl, kOrigOsl);
  set("--chunk-size", w.chunk_size, kOrigChunk);
  return fmt::format(
      "preset original: {} prompts -> {}, concurrency {} -> {}, batched tokens/rank {} -> {} "
      "(divided by the {} ranks sharing one GPU), ISL {}, OSL {}, chunk {} (kept: {}), "
      "{} MoE layers -> {}",
      kOrigPrompts, w.num_prompts, kOrigConcurrency, w.concurrency, kOrigBatched,
      w.max_batched_tokens, div, w.isl, w.osl, w.chunk_size,
      given.empty() ? "no workload flag given" : "explicit flags win", kDeepSeekMoeLayers,
      f.layers);
}

void check_multiple_of_512(const char* flag, int value, bool zero_ok) {
  if ((zero_ok && value == 0) || (value >= 512 && value <= kMaxHidden && value % 512 == 0)) return;
  EPX_THROW(ConfigError,
            fmt::format("--{} = {}, expected {}a multiple of 512 in [512, {}] (the MoE layer's fp8 "
                        "GEMMs: K / 128 a multiple of 4)",
                        flag, value, zero_ok ? "0 (none) or " : "", kMaxHidden));
}

// Largest decode batch per rank that --cuda-graph captures: the chunk, the step budget, and
// kMaxGraphBatch, beyond which a decode step runs eagerly (a captured layer holds one body per
// GEMM row bucket and local expert, so graphs of large batches grow to tens of thousands of nodes).
constexpr int kMaxGraphBatch = 128;
int largest_decode_bucket(const serve::Workload& w) {
  return std::min({w.chunk_size, w.max_batched_tokens, kMaxGraphBatch});
}

// Decode batch buckets of --cuda-graph: 1, 2, 4, ... below `largest`, then `largest` (the
// smaller of --chunk-size and --max-batched-tokens: one chunk).
std::vector<int> decode_buckets(int largest) {
  std::vector<int> out;
  for (int b = 1; b < largest; b *= 2) out.push_back(b);
  out.push_back(largest);
  return out;
}

ServePlan validate(ServeFlags f, const std::map<std::string, bool>& given) {
  ServePlan p;
  p.cuda_graph = f.cuda_graph;
  p.preset_note = apply_preset(f, given);
  p.workload = f.workload;
  serve::validate(p.workload);
  const int W = p.workload.world;
  check_range("--layers", f.layers, 1, 1024);
  check_multiple_of_512("hidden", f.hidden, false);
  check_multiple_of_512("intermediate", f.intermediate, false);
  check_multiple_of_512("shared-intermediate", f.shared_intermediate, true);
  check_range("--experts", f.experts, W, 1 << 16, "at least --world");
  if (f.experts % W != 0) {
    EPX_THROW(ConfigError, fmt::format("--experts = {}, expected a multiple of --world = {} "
                                       "(every rank holds E/W experts)",
                                       f.experts, W));
  }
  check_range("--topk", f.topk, 1, std::min(kMaxTopk, f.experts), "at most min(32, --experts)");
  for (const std::string& name : split_list(f.backends, "--backends")) {
    const Backend b = parse_backend_flag(name, "--backends");
    if (std::find(p.backends.begin(), p.backends.end(), b) != p.backends.end()) {
      EPX_THROW(ConfigError, fmt::format("--backends = '{}' lists {} twice, expected each "
                                         "backend once",
                                         f.backends, name));
    }
    p.backends.push_back(b);
  }
  if (f.weights == "auto") {
    p.weights = WeightsMode::kAuto;
  } else if (f.weights == "distinct") {
    p.weights = WeightsMode::kDistinct;
  } else if (f.weights == "shared") {
    p.weights = WeightsMode::kShared;
  } else {
    EPX_THROW(ConfigError,
              fmt::format("--weights = '{}', expected one of auto, distinct, shared", f.weights));
  }

  // DeepSeek-R1 routing (sigmoid, best 4 of 8 groups) where the expert count allows it,
  // otherwise one group (plain sigmoid top-k).
  ref::moe::MoeShape& s = p.shape;
  s.hidden = f.hidden;
  s.intermediate = f.intermediate;
  s.num_experts = f.experts;
  s.topk = f.topk;
  s.shared_intermediate = f.shared_intermediate;
  s.scoring = ref::moe::Scoring::kSigmoidGrouped;
  s.routed_scaling = 2.5f;
  const bool grouped = f.experts % 8 == 0 && f.experts / 8 >= 2 && f.topk <= 4 * (f.experts / 8);
  s.num_groups = grouped ? 8 : 1;
  s.topk_groups = grouped ? 4 : 1;
  s.validate();

  EpConfig& cfg = p.cfg;
  cfg.world_size = W;
  cfg.hidden = f.hidden;
  cfg.num_experts = f.experts;
  cfg.topk = f.topk;
  cfg.max_tokens_per_rank = p.workload.chunk_size;
  try {
    cfg.dtype = parse_dispatch_dtype(f.dtype);
  } catch (const ConfigError&) {
    EPX_THROW(ConfigError,
              fmt::format("--dtype = '{}', expected one of bf16, fp8, bf16-to-fp8", f.dtype));
  }
  try {
    cfg.layout = parse_output_layout(f.layout);
  } catch (const ConfigError&) {
    EPX_THROW(ConfigError, fmt::format("--layout = '{}', expected token or expert", f.layout));
  }
  const EnvSettings env = read_env();  // throws ConfigError naming the variable
  if (env.timeout_ms) cfg.timeout_ms = *env.timeout_ms;
  cfg.validate();  // anything the checks above missed, named by field
  p.launch = launch_from_env();
  p.layers = f.layers;
  p.seed = f.seed;
  p.json_path = f.json_path;
  if (f.graph_scope != "rank" && f.graph_scope != "world") {
    EPX_THROW(ConfigError,
              fmt::format("--graph-scope = '{}', expected rank or world", f.graph_scope));
  }
  if (f.graph_scope == "world" && !f.cuda_graph)
    EPX_THROW(ConfigError, "--graph-scope = 'world', expected only with --cuda-graph");
  p.world_graphs = f.graph_scope == "world";
  for (const auto& [flag, value] : {std::pair{"--graph-split", &f.graph_split},
                                     std::pair{"--graph-experts", &f.graph_experts}}) {
    if (!value->empty() && !f.cuda_graph) {
      EPX_THROW(ConfigError,
                fmt::format("{} = '{}', expected only with --cuda-graph", flag, *value));
    }
  }
  if (!f.graph_split.empty() && f.graph_split != "expert" && f.graph_split != "none") {
    EPX_THROW(ConfigError,
              fmt::format("--graph-split = '{}', expected expert or none", f.graph_split));
  }
  if (f.graph_split == "expert" && p.world_graphs) {
    EPX_THROW(ConfigError, "--graph-split = 'expert', expected only with --graph-scope rank");
  }
  p.split_graphs = f.graph_split != "none" && !p.world_graphs;
  if (f.graph_experts.empty() || f.graph_experts == "auto") {
    p.graph_experts = W > 1 ? CaptureExperts::kAllRows : CaptureExperts::kSwitch;
  } else if (f.graph_experts == "switch" || f.graph_experts == "all-rows") {
    p.graph_experts = f.graph_experts == "switch" ? CaptureExperts::kSwitch : CaptureExperts::kAllRows;
  } else {
    EPX_THROW(ConfigError, fmt::format("--graph-experts = '{}', expected auto, switch or all-rows",
                                       f.graph_experts));
  }
  const int largest = largest_decode_bucket(p.workload);
  if (f.graph_buckets.empty()) {
    p.graph_buckets = decode_buckets(largest);
  } else {
    if (!f.cuda_graph)
      EPX_THROW(ConfigError, "--graph-buckets = '" + f.graph_buckets + "', expected only with --cuda-graph");
    // Integers in [1, largest], each once (named when not), then ascending.
    p.graph_buckets = parse_int_list(
        f.graph_buckets, "--graph-buckets", 1, largest,
        fmt::format("the smaller of --chunk-size, --max-batched-tokens and {}", kMaxGraphBatch));
    if (!std::is_sorted(p.graph_buckets.begin(), p.graph_buckets.end())) {
      EPX_THROW(ConfigError,
                fmt::format("--graph-buckets = '{}', expected ascending batch sizes", f.graph_buckets));
    }
  }
  return p;
}

[[maybe_unused]] std::string backend_names(const std::vector<Backend>& backends) {
  std::string out;
  for (Backend b : backends) out += (out.empty() ? "" : ",") + std::string(to_string(b));
  return out;
}

#if EPX_HAVE_CUDA

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string one_line(std::string s, size_t max = 160) {
  for (char& c : s)
    if (c == '\n') c = ' ';
  if (s.size() > max) s = s.substr(0, max - 3) + "...";
  return s;
}

// fn(i) for i in [0, n) on up to `threads` host threads; rethrows the first exception (by index).
void parallel_for(int n, int threads, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(size_t(std::max(n, 0)));
  std::atomic<int> next{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < std::min(n, std::max(threads, 1)); ++t) {
    pool.emplace_back([&] {
      for (int i = next++; i < n; i = next++) {
        try {
          fn(i);
        } catch (...) {
          errors[size_t(i)] = std::current_exception();
        }
      }
    });
  }
  for (auto& t : pool) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// One persistent host thread per rank: run(fn) releases every thread on fn(rank) and returns when
// all have finished (MoeLayer::forward synchronises its stream after each dispatch, and a dispatch
// completes only once every rank has dispatched, so each rank needs its own thread). Threads are
// kept across steps so that a step's time holds no thread creation.
class RankThreads {
 public:
  explicit RankThreads(int n) : errors_(size_t(n)) {
    for (int r = 0; r < n; ++r) threads_.emplace_back([this, r] { loop(r); });
  }
  ~RankThreads() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    start_.notify_all();
    for (auto& t : threads_) t.join();
  }
  RankThreads(const RankThreads&) = delete;
  RankThreads& operator=(const RankThreads&) = delete;

  // After every rank has finished, rethrows the cause of a failure: the first rank's error that
  // is not a consequence of another rank's (a peer's TimeoutError, PeerError or StateError names
  // the rank that stopped, not why it stopped), else the first error by rank.
  void run(const std::function<void(int)>& fn) {
    {
      std::lock_guard<std::mutex> lock(m_);
      fn_ = &fn;
      pending_ = int(threads_.size());
      ++generation_;
    }
    start_.notify_all();
    std::unique_lock<std::mutex> lock(m_);
    done_.wait(lock, [&] { return pending_ == 0; });
    fn_ = nullptr;
    std::exception_ptr first, cause;
    int failed = 0;
    for (auto& e : errors_) failed += e != nullptr;
    for (size_t r = 0; r < errors_.size(); ++r) {
      const std::exception_ptr e = errors_[r];
      if (!e) continue;
      if (!first) first = e;
      std::string what;
      try {
        std::rethrow_exception(e);
      } catch (const TimeoutError& x) {
        what = x.what();
      } catch (const PeerError& x) {
        what = x.what();
      } catch (const StateError& x) {
        what = x.what();
      } catch (const std::exception& x) {
        what = x.what();
        if (!cause) cause = e;
      } catch (...) {
        what = "unknown exception";
        if (!cause) cause = e;
      }
      // Every rank's error when several fail: the wait graph they draw names the rank that
      // stopped and the call it stopped in.
      if (failed > 1) fmt::print(stderr, "  rank {}: {}\n", r, what);
    }
    for (auto& x : errors_) x = nullptr;
    if (cause) std::rethrow_exception(cause);
    if (first) std::rethrow_exception(first);
  }

 private:
  void loop(int r) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* fn = nullptr;
      {
        std::unique_lock<std::mutex> lock(m_);
        start_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        fn = fn_;
      }
      std::exception_ptr err;
      try {
        (*fn)(r);
      } catch (...) {
        err = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(m_);
      errors_[size_t(r)] = err;
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex m_;
  std::condition_variable start_, done_;
  const std::function<void(int)>* fn_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::vector<std::exception_ptr> errors_;
  std::vector<std::thread> threads_;
};

// One rank's device state: stream, activations, MoE layers, decode graphs.
struct Rank {
  int index = 0;
  int device = 0;
  cudaStream_t stream = nullptr;
  void* x = nullptr;        // [2 * max_batched_tokens][H] bf16: input rows, a window per step
  void* y = nullptr;        // [max_batched_tokens][H] bf16: every layer's output
  void* x_graph = nullptr;  // [largest decode bucket][H] bf16: the decode graphs' input
  std::vector<std::unique_ptr<MoeLayer>> layers;  // one per --layers, or one reused
  // decode bucket -> every layer's forward: one graph, or the pieces of --graph-split expert
  std::map<int, std::vector<cudaGraphExec_t>> graphs;
  std::vector<double> launch_s;  // host time of each replayed step's cudaGraphLaunch calls
  // Split graphs: events around the pieces of a replayed step, and each piece's GPU time (s)
  // per replay: the time from the end of the previous piece, waits for peers included.
  std::vector<cudaEvent_t> piece_events;
  std::vector<std::vector<double>> piece_s;
  Rank() = default;
  Rank(const Rank&) = delete;
  Rank& operator=(const Rank&) = delete;
  void destroy_graphs() noexcept {
    for (auto& [bucket, pieces] : graphs)
      for (cudaGraphExec_t exec : pieces) (void)cudaGraphExecDestroy(exec);
    graphs.clear();
  }
  ~Rank() {
    if (stream) (void)cudaStreamSynchronize(stream);
    destroy_graphs();
    for (cudaEvent_t e : piece_events) (void)cudaEventDestroy(e);
    layers.clear();
    if (x) (void)cudaFree(x);
    if (y) (void)cudaFree(y);
    if (x_graph) (void)cudaFree(x_graph);
    if (stream) (void)cudaStreamDestroy(stream);
  }
};

// What one rank runs in one engine step.
struct RankStep {
  int tokens = 0;
  int num_chunks = 1;    // the same on every rank
  size_t first_row = 0;  // rows [first_row, first_row + tokens) of Rank::x
  int graph_bucket = 0;  // > 0: replay the decode graph of this bucket (tokens <= bucket)
};

// The smallest bucket holding `tokens` (>= 1), or 0 when none does.
int decode_bucket(const std::vector<int>& buckets, int tokens) {
  for (int b : buckets)
    if (b >= std::max(tokens, 1)) return b;
  return 0;
}

// A host call that takes longer than this while enqueueing a step is reported (stderr).
constexpr double kSlowEnqueueMs = 100.0;

// One rank's part of one engine step: every MoE layer on the rank's tokens, then the stream
// drained (and the All2All's device status polled). A decode graph step copies the rank's tokens
// into the graph's input (rows beyond them are dummy tokens: whatever the buffer holds, routed
// and computed like the others, outputs ignored) and replays the graph of its bucket.
void run_step(Rank& rank, All2All& a2a, int num_layers, const RankStep& step, size_t row_bytes) {
  EPX_CUDA_CHECK(cudaSetDevice(rank.device));
  const void* x = static_cast<const uint8_t*>(rank.x) + step.first_row * row_bytes;
  if (step.graph_bucket > 0) {
    const auto t0 = std::chrono::steady_clock::now();
    if (step.tokens > 0) {
      EPX_CUDA_CHECK(cudaMemcpyAsync(rank.x_graph, x, size_t(step.tokens) * row_bytes,
                                     cudaMemcpyDeviceToDevice, rank.stream));
    }
    const auto t1 = std::chrono::steady_clock::now();
    const std::vector<cudaGraphExec_t>& pieces = rank.graphs.at(step.graph_bucket);
    const bool timed = pieces.size() > 1 && rank.piece_events.size() == pieces.size() + 1;
    if (timed) EPX_CUDA_CHECK(cudaEventRecord(rank.piece_events[0], rank.stream));
    // Enqueueing must not wait for the device: peers spin until this rank's kernels run.
    double launch_ms = 0;  // the cudaGraphLaunch calls alone
    for (size_t i = 0; i < pieces.size(); ++i) {
      const auto l0 = std::chrono::steady_clock::now();
      EPX_CUDA_CHECK(cudaGraphLaunch(pieces[i], rank.stream));
      launch_ms +=
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - l0).count();
      if (timed) EPX_CUDA_CHECK(cudaEventRecord(rank.piece_events[i + 1], rank.stream));
    }
    const double copy_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
    rank.launch_s.push_back(launch_ms / 1e3);
    if (copy_ms + launch_ms > kSlowEnqueueMs) {
      fmt::print(stderr, "  rank {}: enqueueing the bucket-{} graph blocked the host {:.0f} ms "
                 "(input copy {:.0f} ms, cudaGraphLaunch {:.0f} ms)\n",
                 rank.index, step.graph_bucket, copy_ms + launch_ms, copy_ms, launch_ms);
    }
    a2a.synchronize(rank.stream);
    if (timed) {
      rank.piece_s.resize(pieces.size());
      for (size_t i = 0; i < pieces.size(); ++i) {
        float ms = 0;
        EPX_CUDA_CHECK(cudaEventElapsedTime(&ms, rank.piece_events[i], rank.piece_events[i + 1]));
        rank.piece_s[i].push_back(ms / 1e3);
      }
    }
    return;
  }
  for (int l = 0; l < num_layers; ++l) {
    MoeLayer& layer = *rank.layers[rank.layers.size() == 1 ? 0 : size_t(l)];
    layer.forward(x, step.tokens, rank.y, a2a, rank.stream, step.num_chunks);
  }
  a2a.synchronize(rank.stream);
}

// Ends the capture of `s`, instantiates its graph and uploads it on `s`.
cudaGraphExec_t end_capture(cudaStream_t s) {
  cudaGraphExec_t exec = testing::end_capture_and_instantiate(s);
  const cudaError_t up = cudaGraphUpload(exec, s);
  if (up != cudaSuccess) (void)cudaGraphExecDestroy(exec);
  EPX_CUDA_CHECK(up);
  return exec;
}

// Ends the capture of `s` after a failure, dropping whatever it recorded.
void abandon_capture(cudaStream_t s) noexcept {
  cudaGraph_t g = nullptr;
  (void)cudaStreamEndCapture(s, &g);
  if (g) (void)cudaGraphDestroy(g);
  (void)cudaGetLastError();
}

// Captures this rank's decode graphs per bucket: every layer's forward of `bucket` tokens of
// x_graph in one chunk (capture only records: no rank waits for another). One graph, or with
// `split` 2 x layers + 1 pieces: each layer's expert stage in a graph of its own, apart from
// dispatch and combine (MoeLayer::set_capture_split).
// Resets the capture settings of a rank's layers when it goes (a split hook refers to the
// rank's graphs, which outlive no backend).
struct CaptureSettingsReset {
  std::vector<std::unique_ptr<MoeLayer>>& layers;
  ~CaptureSettingsReset() {
    for (auto& layer : layers) {
      layer->set_capture_split({});
      try {
        layer->set_capture_token_bound(0);  // may allocate (once): never throw from here
      } catch (...) {
      }
    }
  }
};

void capture_decode_graphs(Rank& rank, All2All& a2a, int num_layers,
                           const std::vector<int>& buckets, bool split) {
  EPX_CUDA_CHECK(cudaSetDevice(rank.device));
  const CaptureSettingsReset reset{rank.layers};
  for (int b : buckets) {
    std::vector<cudaGraphExec_t>& pieces = rank.graphs[b];  // destroy_graphs() frees them
    for (auto& layer : rank.layers) {
      layer->set_capture_token_bound(b);
      if (!split) continue;
      layer->set_capture_split([&pieces](cudaStream_t s) {
        pieces.push_back(end_capture(s));
        EPX_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      });
    }
    EPX_CUDA_CHECK(cudaStreamBeginCapture(rank.stream, cudaStreamCaptureModeThreadLocal));
    try {
      for (int l = 0; l < num_layers; ++l) {
        MoeLayer& layer = *rank.layers[rank.layers.size() == 1 ? 0 : size_t(l)];
        layer.forward(rank.x_graph, b, rank.y, a2a, rank.stream, 1);
      }
    } catch (...) {
      abandon_capture(rank.stream);
      throw;
    }
    pieces.push_back(end_capture(rank.stream));
  }
  // Timing events around the pieces (the same count for every bucket), made once.
  const size_t events = split ? size_t(2 * num_layers + 2) : 0;
  while (rank.piece_events.size() < events) {
    cudaEvent_t e = nullptr;
    EPX_CUDA_CHECK(cudaEventCreate(&e));
    rank.piece_events.push_back(e);
  }
}

// --graph-scope world: per bucket one graph holding every rank's decode forward, each on its
// rank's stream as a branch forked from and joined into `main`, replayed with one launch.
struct WorldGraphs {
  cudaStream_t main = nullptr;
  cudaEvent_t fork = nullptr;
  std::vector<cudaEvent_t> joins;
  std::map<int, cudaGraphExec_t> graphs;  // decode bucket -> every rank's forward
  std::vector<double> launch_s;           // host time of each timed replay's cudaGraphLaunch
  WorldGraphs() = default;
  WorldGraphs(const WorldGraphs&) = delete;
  WorldGraphs& operator=(const WorldGraphs&) = delete;
  ~WorldGraphs() {
    if (main) (void)cudaStreamSynchronize(main);
    for (auto& [b, exec] : graphs) (void)cudaGraphExecDestroy(exec);
    for (cudaEvent_t e : joins)
      if (e) (void)cudaEventDestroy(e);
    if (fork) (void)cudaEventDestroy(fork);
    if (main) (void)cudaStreamDestroy(main);
  }
};

void capture_world_graphs(WorldGraphs& wg, std::vector<std::unique_ptr<Rank>>& ranks,
                          std::vector<std::unique_ptr<All2All>>& group, int num_layers,
                          const std::vector<int>& buckets) {
  const int W = int(ranks.size());
  EPX_CUDA_CHECK(cudaSetDevice(ranks[0]->device));
  EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&wg.main, cudaStreamNonBlocking));
  EPX_CUDA_CHECK(cudaEventCreateWithFlags(&wg.fork, cudaEventDisableTiming));
  wg.joins.assign(size_t(W), nullptr);
  for (int r = 0; r < W; ++r) {
    EPX_CUDA_CHECK(cudaSetDevice(ranks[size_t(r)]->device));
    EPX_CUDA_CHECK(cudaEventCreateWithFlags(&wg.joins[size_t(r)], cudaEventDisableTiming));
  }
  for (int b : buckets) {
    for (auto& r : ranks) {  // before the capture: the bound may allocate a staging buffer
      EPX_CUDA_CHECK(cudaSetDevice(r->device));
      for (auto& layer : r->layers) layer->set_capture_token_bound(b);
    }
    EPX_CUDA_CHECK(cudaSetDevice(ranks[0]->device));
    EPX_CUDA_CHECK(cudaStreamBeginCapture(wg.main, cudaStreamCaptureModeThreadLocal));
    try {
      EPX_CUDA_CHECK(cudaEventRecord(wg.fork, wg.main));
      for (int r = 0; r < W; ++r) {
        Rank& rank = *ranks[size_t(r)];
        EPX_CUDA_CHECK(cudaSetDevice(rank.device));
        EPX_CUDA_CHECK(cudaStreamWaitEvent(rank.stream, wg.fork, 0));
        for (int l = 0; l < num_layers; ++l) {
          MoeLayer& layer = *rank.layers[rank.layers.size() == 1 ? 0 : size_t(l)];
          layer.forward(rank.x_graph, b, rank.y, *group[size_t(r)], rank.stream, 1);
        }
        EPX_CUDA_CHECK(cudaEventRecord(wg.joins[size_t(r)], rank.stream));
        EPX_CUDA_CHECK(cudaStreamWaitEvent(wg.main, wg.joins[size_t(r)], 0));
      }
    } catch (...) {
      abandon_capture(wg.main);
      throw;
    }
    EPX_CUDA_CHECK(cudaSetDevice(ranks[0]->device));
    wg.graphs[b] = end_capture(wg.main);
  }
  for (auto& r : ranks)
    for (auto& layer : r->layers) layer->set_capture_token_bound(0);
}

// One decode step of every rank as one replay (--graph-scope world): each rank's input rows into
// its x_graph on `main`, one launch, then the device drained and every rank's status polled.
void run_world_step(WorldGraphs& wg, std::vector<std::unique_ptr<Rank>>& ranks,
                    const std::vector<RankStep>& steps, size_t row_bytes, RankThreads& threads,
                    std::vector<std::unique_ptr<All2All>>& group) {
  EPX_CUDA_CHECK(cudaSetDevice(ranks[0]->device));
  for (size_t r = 0; r < ranks.size(); ++r) {
    const RankStep& st = steps[r];
    if (st.tokens == 0) continue;
    const void* x = static_cast<const uint8_t*>(ranks[r]->x) + st.first_row * row_bytes;
    EPX_CUDA_CHECK(cudaMemcpyAsync(ranks[r]->x_graph, x, size_t(st.tokens) * row_bytes,
                                   cudaMemcpyDeviceToDevice, wg.main));
  }
  const auto t0 = std::chrono::steady_clock::now();
  EPX_CUDA_CHECK(cudaGraphLaunch(wg.graphs.at(steps[0].graph_bucket), wg.main));
  wg.launch_s.push_back(seconds_since(t0));
  EPX_CUDA_CHECK(cudaStreamSynchronize(wg.main));
  threads.run([&](int r) { group[size_t(r)]->poll(); });
}

void drain(std::vector<std::unique_ptr<Rank>>& ranks) noexcept {
  for (auto& r : ranks) {
    (void)cudaSetDevice(r->device);
    (void)cudaStreamSynchronize(r->stream);
  }
  (void)cudaGetLastError();
}

struct BackendResult {
  Backend backend{};
  bool cuda_graph = false;    // decode steps replayed as CUDA graphs
  int graph_steps = 0;        // steps run as graph replays
  double capture_s = 0;       // capture + instantiation of every rank's decode graphs
  std::string status = "ok";  // ok | unavailable | error
  std::string message;
  serve::LatencyReport latency;
  int steps = 0;
  int prefill_steps = 0;  // steps with prefill tokens
  serve::Summary step_s;
  serve::Summary launch_s;    // cuda_graph: host time of cudaGraphLaunch, every rank's replays
  std::vector<serve::Summary> piece_s;  // split graphs: GPU time of each piece, every rank's replays
  double warmup_s = 0;
};

MoeShape to_layer_shape(const ref::moe::MoeShape& s) {
  MoeShape m;
  m.hidden = s.hidden;
  m.intermediate = s.intermediate;
  m.num_experts = s.num_experts;
  m.topk = s.topk;
  m.num_groups = s.num_groups;
  m.topk_groups = s.topk_groups;
  m.routed_scaling = s.routed_scaling;
  m.shared_intermediate = s.shared_intermediate;
  m.scoring = MoeScoring::kSigmoidGrouped;
  return m;
}

size_t free_device_bytes(int device) {
  EPX_CUDA_CHECK(cudaSetDevice(device));
  size_t free = 0, total = 0;
  EPX_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return free;
}

// Builds every rank's layers: one per --layers with distinct weights (seed + layer), or one
// shared by all layers. kAuto builds the first layer everywhere, measures what it took, and
// builds the rest only if they fit next to the backends' buffers. Returns the distinct count.
int build_layers(const ServePlan& p, const InProcessWorld& world,
                 std::vector<std::unique_ptr<Rank>>& ranks, std::string& note) {
  const int W = p.workload.world;
  const MoeShape shape = to_layer_shape(p.shape);
  const int threads = int(std::max(1u, std::thread::hardware_concurrency()));
  auto build = [&](int first_layer, int num_layers) {
    // Host generation of the weights is the slow, single-threaded part: one task per
    // (rank, layer), all built before any forward (moe.hpp).
    for (auto& r : ranks) r->layers.resize(size_t(first_layer + num_layers));
    parallel_for(W * num_layers, threads, [&](int i) {
      const int r = i % W, l = first_layer + i / W;
      EpConfig ep = p.cfg;
      ep.rank = r;
      EPX_CUDA_CHECK(cudaSetDevice(world.device_of(r)));
      auto layer = std::make_unique<MoeLayer>(shape, p.seed + uint64_t(l), ep, world.sm_budget(r));
      layer->set_capture_experts(p.graph_experts);  // eager forwards ignore it
      ranks[size_t(r)]->layers[size_t(l)] = std::move(layer);
    });
  };
  const int dev = world.device_of(0);
  const size_t before = free_device_bytes(dev);
  build(0, 1);
  const size_t after = free_device_bytes(dev);
  const size_t per_layer = before > after ? before - after : 0;
  int distinct = p.weights == WeightsMode::kShared ? 1 : p.layers;
  if (p.weights == WeightsMode::kAuto && p.layers > 1) {
    size_t reserve = size_t(2) << 30;  // CUDA / cuBLASLt workspaces and slack
    for (int r = 0; r < W; ++r) {
      EpConfig ep = p.cfg;
      ep.rank = r;
      size_t most = 0;
      for (Backend b : p.backends) most = std::max(most, buffer_bytes(b, ep));
      reserve += most;
    }
    const size_t room = after > reserve ? after - reserve : 0;
    if (size_t(p.layers - 1) * per_layer > room) distinct = 1;
  }
  if (distinct > 1) build(1, distinct - 1);
  note = distinct > 1 ? fmt::format(
                            "{} layers with distinct weights ({:.1f} GiB of device memory per "
                            "layer over all ranks)",
                            distinct, double(per_layer) / double(1 << 30))
                      : fmt::format(
                            "{} layer(s) sharing one MoeLayer per rank (weights reused by every "
                            "layer{}; {:.1f} GiB per layer over all ranks)",
                            p.layers,
                            p.weights == WeightsMode::kShared ? ", --weights shared"
                                                              : ": distinct layers do not fit",
                            double(per_layer) / double(1 << 30));
  return distinct;
}

BackendResult run_backend(const ServePlan& p, Backend backend, bool cuda_graph,
                          const InProcessWorld& world, std::vector<std::unique_ptr<Rank>>& ranks,
                          RankThreads& threads) {
  BackendResult br;
  br.backend = backend;
  br.cuda_graph = cuda_graph;
  const std::string tag =
      fmt::format("serve-bench [{}{}]", to_string(backend), cuda_graph ? ", cuda graph" : "");
  const serve::Workload& w = p.workload;
  const int W = w.world;
  const size_t row_bytes = size_t(p.shape.hidden) * 2;
  std::vector<std::unique_ptr<All2All>> group;
  try {
    group = make_all2all_group(backend, p.cfg, world, p.launch.launch);
  } catch (const UnsupportedError& e) {
    br.status = "unavailable";
    br.message = e.what();
  } catch (const Error& e) {
    br.status = "error";
    br.message = e.what();
  }
  if (br.status != "ok") {
    fmt::print(stderr, "{}: {}: {}\n", tag, br.status, one_line(br.message));
    return br;
  }

  std::vector<RankStep> steps(static_cast<size_t>(W));
  // Declared before the try block: its graphs hold the group's All2All, drained below.
  WorldGraphs world_graphs;
  auto run_all = [&] {
    if (p.world_graphs && steps[0].graph_bucket > 0) {
      run_world_step(world_graphs, ranks, steps, row_bytes, threads, group);
      return;
    }
    threads.run([&](int r) {
      run_step(*ranks[size_t(r)], *group[size_t(r)], p.layers, steps[size_t(r)], row_bytes);
    });
  };
  try {
    // Warm-up, untimed: a full prefill step, one chunk, one token (first-use costs of the
    // GEMM shapes and the backend).
    const auto t_warm = std::chrono::steady_clock::now();
    const int chunk = w.chunk_size;
    for (const int n : {w.max_batched_tokens, std::min(chunk, w.max_batched_tokens), 1}) {
      for (auto& s : steps) s = RankStep{n, (n + chunk - 1) / chunk, 0};
      run_all();
    }
    // Decode graphs: captured per rank, then each replayed once on every rank (untimed).
    const std::vector<int>& buckets = p.graph_buckets;
    if (cuda_graph) {
      const auto t_capture = std::chrono::steady_clock::now();
      if (p.world_graphs) {
        capture_world_graphs(world_graphs, ranks, group, p.layers, buckets);
      } else {
        threads.run([&](int r) {
          capture_decode_graphs(*ranks[size_t(r)], *group[size_t(r)], p.layers, buckets,
                                p.split_graphs);
        });
      }
      br.capture_s = seconds_since(t_capture);
      for (const int b : buckets) {
        for (auto& s : steps) s = RankStep{b, 1, 0, b};
        run_all();
      }
    }
    br.warmup_s = seconds_since(t_warm);

    for (auto& r : ranks) {  // the timed steps' replays only
      r->launch_s.clear();
      r->piece_s.clear();
    }
    world_graphs.launch_s.clear();
    serve::Scheduler sched(w);
    std::vector<double> step_s;
    const auto t0 = std::chrono::steady_clock::now();
    auto last_progress = t0;
    while (!sched.done()) {
      const serve::StepPlan& plan = sched.plan_step();
      // A window of the input rows that moves every step: the same tokens are not routed alike
      // step after step.
      const size_t first_row = size_t(sched.steps()) * 7919 % (size_t(w.max_batched_tokens) + 1);
      // A decode-only step within one chunk replays every rank's graph of the bucket that holds
      // the largest rank's batch; anything else runs eagerly.
      const int most = *std::max_element(plan.tokens.begin(), plan.tokens.end());
      const int bucket = cuda_graph && !plan.has_prefill() && plan.num_chunks == 1
                             ? decode_bucket(buckets, most)
                             : 0;
      for (int r = 0; r < W; ++r)
        steps[size_t(r)] = RankStep{plan.tokens[size_t(r)], plan.num_chunks, first_row, bucket};
      br.prefill_steps += plan.has_prefill();
      br.graph_steps += bucket > 0;
      const auto s0 = std::chrono::steady_clock::now();
      run_all();
      const auto s1 = std::chrono::steady_clock::now();
      step_s.push_back(std::chrono::duration<double>(s1 - s0).count());
      sched.finish_step(std::chrono::duration<double>(s1 - t0).count());
      if (std::chrono::duration<double>(s1 - last_progress).count() >= kProgressEveryS) {
        last_progress = s1;
        fmt::print(stderr, "{}: step {}, {}/{} output tokens, {:.1f} s\n", tag, sched.steps(),
                   sched.output_tokens(), sched.total_output_tokens(), seconds_since(t0));
      }
    }
    br.steps = sched.steps();
    br.step_s = serve::summarize_values(std::move(step_s));
    std::vector<double> launches = world_graphs.launch_s;
    for (auto& r : ranks) launches.insert(launches.end(), r->launch_s.begin(), r->launch_s.end());
    br.launch_s = serve::summarize_values(std::move(launches));
    for (size_t i = 0; !ranks.empty() && i < ranks[0]->piece_s.size(); ++i) {
      std::vector<double> ms;
      for (auto& r : ranks)
        if (i < r->piece_s.size()) ms.insert(ms.end(), r->piece_s[i].begin(), r->piece_s[i].end());
      br.piece_s.push_back(serve::summarize_values(std::move(ms)));
    }
    br.latency = serve::latency_report(sched.requests());
    fmt::print(stderr, "{}: done, {} steps ({} graph replays), {:.1f} s (warm-up {:.1f} s{})\n",
               tag, br.steps, br.graph_steps, br.latency.end_s, br.warmup_s,
               cuda_graph ? fmt::format(", of which capture {:.1f} s", br.capture_s) : "");
  } catch (const Error& e) {
    br.status = "error";
    br.message = e.what();
    fmt::print(stderr, "{}: error: {}\n", tag, one_line(br.message));
  }
  drain(ranks);
  // The graphs hold this backend's All2All: gone with it.
  for (auto& r : ranks) {
    (void)cudaSetDevice(r->device);
    r->destroy_graphs();
  }
  return br;
}

// ---- output ------------------------------------------------------------------------------------

void print_table(const std::vector<BackendResult>& results) {
  constexpr int kName = 31;  // "allgather_reducescatter (graph)"
  fmt::print("\n{:<{}} {:>9} {:>8} {:>8} {:>8} {:>10} {:>9} {:>10} {:>6} {:>8}\n", "backend", kName,
             "ITL mean", "P25", "P50", "P75", "TTFT mean", "TTFT P50", "out tok/s", "steps",
             "total");
  fmt::print("{:<{}} {:>9} {:>8} {:>8} {:>8} {:>10} {:>9} {:>10} {:>6} {:>8}\n", "", kName, "ms", "ms",
             "ms", "ms", "ms", "ms", "", "", "s");
  bool any_graph = false;
  for (const BackendResult& br : results) {
    const std::string name =
        fmt::format("{}{}", to_string(br.backend), br.cuda_graph ? " (graph)" : "");
    any_graph |= br.cuda_graph;
    if (br.status != "ok") {
      fmt::print("{:<{}} {}: {}\n", name, kName, br.status, one_line(br.message, 100));
      continue;
    }
    const serve::LatencyReport& l = br.latency;
    fmt::print("{:<{}} {:9.2f} {:8.2f} {:8.2f} {:8.2f} {:10.1f} {:9.1f} {:10.0f} {:6} {:8.2f}\n",
               name, kName, 1e3 * l.itl_s.mean, 1e3 * l.itl_s.p25, 1e3 * l.itl_s.p50, 1e3 * l.itl_s.p75,
               1e3 * l.ttft_s.mean, 1e3 * l.ttft_s.p50, l.output_tokens_per_s, br.steps, l.end_s);
  }
  fmt::print(
      "\nITL = gaps between consecutive output tokens of a request, pooled over requests; "
      "TTFT from submission (t = 0);\npercentiles by linear interpolation between closest "
      "ranks (numpy's default).\n");
  if (!any_graph) return;
  fmt::print(
      "(graph) rows: decode-only steps within one chunk replay per-rank CUDA graphs captured "
      "per batch bucket (every rank padded to the bucket of the largest rank's batch); prefill "
      "and mixed steps run eagerly. The padding tokens are routed and computed like real ones, "
      "so a graph step does up to the bucket's work on every rank.\n");
  for (const BackendResult& br : results) {
    if (!br.cuda_graph || br.status != "ok") continue;
    fmt::print("  {}: {} of {} steps replayed, capture + instantiation {:.2f} s, host time of one "
               "rank's cudaGraphLaunch calls of a step P50 {:.3f} ms, max {:.3f} ms\n",
               to_string(br.backend), br.graph_steps, br.steps, br.capture_s,
               1e3 * br.launch_s.p50, 1e3 * br.launch_s.max);
    if (br.piece_s.empty()) continue;
    std::string pieces;
    for (size_t i = 0; i < br.piece_s.size(); ++i) {
      pieces += fmt::format("{}{} {:.2f}", i ? ", " : "", serve::graph_piece_name(int(i), int(br.piece_s.size())),
                            1e3 * br.piece_s[i].p50);
    }
    fmt::print("    GPU time per piece of a step, P50 over ranks and replays, ms: {}\n", pieces);
  }
}

nlohmann::json summary_json(const serve::Summary& s) {
  return {{"count", s.count},   {"mean", 1e3 * s.mean}, {"p25", 1e3 * s.p25},
          {"p50", 1e3 * s.p50}, {"p75", 1e3 * s.p75},   {"max", 1e3 * s.max}};
}

nlohmann::json make_json(const ServePlan& p, const InProcessWorld& world, const GpuInfo& gpu,
                         const std::string& weights_note, int distinct_layers,
                         const std::vector<BackendResult>& results) {
  using nlohmann::json;
  const serve::Workload& w = p.workload;
  json doc;
  doc["schema"] = "epx-serve-bench/1";
  doc["commit"] = git_commit();
  doc["timestamp_utc"] = utc_timestamp();
  doc["machine"] = machine_json(gpu);
  doc["world"] = {{"kind", "in_process"},
                  {"ranks", w.world},
                  {"gpus_used", 1},
                  {"sm_budget_per_rank", world.sm_budget(0)}};
  doc["shape"] = {{"hidden", p.shape.hidden},
                  {"intermediate", p.shape.intermediate},
                  {"experts", p.shape.num_experts},
                  {"topk", p.shape.topk},
                  {"groups", p.shape.num_groups},
                  {"topk_groups", p.shape.topk_groups},
                  {"shared_intermediate", p.shape.shared_intermediate},
                  {"dtype", to_string(p.cfg.dtype)},
                  {"layout", to_string(p.cfg.layout)},
                  {"layers", p.layers},
                  {"distinct_layer_weights", distinct_layers},
                  {"weights", weights_note}};
  doc["workload"] = {
      {"num_prompts", w.num_prompts},
      {"isl", w.isl},
      {"osl", w.osl},
      {"concurrency", w.concurrency},
      {"max_batched_tokens_per_rank", w.max_batched_tokens},
      {"chunk_size", w.chunk_size},
      {"preset", p.preset_note.empty() ? json(nullptr) : json(p.preset_note)},
      {"seed", p.seed},
      {"timeout_ms", p.cfg.timeout_ms},
      {"launch_configs", p.launch.origin},
      {"simulated", "MoE layers only (no attention, no dense layers)"},
      {"percentiles", "linear interpolation between closest ranks (numpy default)"},
      {"warmup",
       "3 untimed steps per backend (full budget, one chunk, one token)"
       "; with cuda_graph also the capture and one replay per bucket"},
      {"cuda_graph", p.cuda_graph},
      {"graph_buckets", p.cuda_graph
                            ? json(p.graph_buckets)
                            : json(nullptr)},
      {"graph_scope", p.cuda_graph ? json(p.world_graphs ? "world" : "rank") : json(nullptr)},
      {"graph_split", p.cuda_graph ? json(p.split_graphs ? "expert" : "none") : json(nullptr)},
      {"graph_experts",
       p.cuda_graph
           ? json(p.graph_experts == CaptureExperts::kSwitch ? "switch" : "all-rows")
           : json(nullptr)}};
  json records = json::array();
  for (const BackendResult& br : results) {
    json rec = {{"backend", to_string(br.backend)},
                {"mode", br.cuda_graph ? "cuda_graph" : "eager"},
                {"status", br.status}};
    if (br.status != "ok") {
      rec["message"] = br.message;
    } else {
      const serve::LatencyReport& l = br.latency;
      rec["itl_ms"] = summary_json(l.itl_s);
      rec["ttft_ms"] = summary_json(l.ttft_s);
      rec["step_ms"] = summary_json(br.step_s);
      rec["output_tokens"] = l.output_tokens;
      rec["output_tokens_per_s"] = l.output_tokens_per_s;
      rec["total_s"] = l.end_s;
      rec["steps"] = br.steps;
      rec["prefill_steps"] = br.prefill_steps;
      rec["warmup_s"] = br.warmup_s;
      if (br.cuda_graph) {
        rec["graph_launch_ms"] = summary_json(br.launch_s);
        if (!br.piece_s.empty()) {
          json pieces = json::array();
          for (size_t i = 0; i < br.piece_s.size(); ++i) {
            json piece = summary_json(br.piece_s[i]);
            piece["piece"] = serve::graph_piece_name(int(i), int(br.piece_s.size()));
            pieces.push_back(piece);
          }
          rec["graph_piece_ms"] = pieces;
        }
        rec["graph_steps"] = br.graph_steps;
        rec["capture_s"] = br.capture_s;
      }
    }
    records.push_back(rec);
  }
  doc["results"] = records;
  return doc;
}

bool run_serve_bench(const ServePlan& plan) {
  ServePlan p = plan;
  const auto t_start = std::chrono::steady_clock::now();
  // Before any CUDA call (moe.hpp: cuBLASLt loads its kernels lazily, and a lazy load waits for
  // the other ranks' spinning kernels).
  const char* loading = std::getenv("CUDA_MODULE_LOADING");
  std::string env_note = "CUDA_MODULE_LOADING=EAGER (set by epx serve-bench)";
  if (loading == nullptr) {
    ::setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  } else {
    env_note = fmt::format("CUDA_MODULE_LOADING={} (from the environment){}", loading,
                               std::string(loading) == "EAGER"
                                   ? ""
                                   : "; WARNING: not EAGER, a lazy kernel load may deadlock");
  }
  // One hardware work queue per rank stream: `epx` sets 32 unless the environment gives a value.
  const char* connections = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  env_note += fmt::format(", CUDA_DEVICE_MAX_CONNECTIONS={}", connections ? connections : "8");
  require_gpu("epx serve-bench");
  const serve::Workload& w = p.workload;
  const int W = w.world;
  InProcessWorld world(W);
  const GpuInfo gpu = gpu_info(world.device_of(0));
  if (p.launch.origin == "backend defaults" && world.ranks_on_device(world.device_of(0)) > 1) {
    // Ranks that share a GPU run their GEMMs between their own dispatch and combine while the
    // others' blocks spin. At 8 ranks, 16 blocks per op (8 x 16 = 128 of 132 SMs) used to stop
    // there: the GEMMs' 4-block clusters, gone since fp8_gemm plans without one (16 blocks then
    // passed the small shape three times, docs/perf-notes.md). Half the SM budget stays the
    // default until the full budget has been measured on the R1 shape.
    const int blocks = std::max(1, world.sm_budget(0) / 2);
    p.launch.launch.dispatch.num_blocks = p.launch.launch.combine.num_blocks = blocks;
    p.launch.origin = fmt::format(
        "{} blocks per op (half the SM budget; EPX_CONFIG_PATH overrides), backend warps", blocks);
  }
  fmt::print(
      "epx serve-bench: {} in-process ranks on {} ({} SMs, {} blocks per rank), "
      "backends {}, commit {}\n",
      W, gpu.name, gpu.sm_count, world.sm_budget(0), backend_names(p.backends), git_commit());
  fmt::print(
      "  MoE: H {}, I {}, E {}, top-{} ({} of {} groups), shared I {}, dtype {}, layout "
      "{}, {} layer(s), seed {}\n",
      p.shape.hidden, p.shape.intermediate, p.shape.num_experts, p.shape.topk, p.shape.topk_groups,
      p.shape.num_groups, p.shape.shared_intermediate, to_string(p.cfg.dtype),
      to_string(p.cfg.layout), p.layers, p.seed);
  fmt::print(
      "  workload: {} prompts, ISL {}, OSL {}, concurrency {}, {} batched tokens per rank "
      "per step, chunk {} (max_tokens_per_rank), all submitted at t = 0, round robin "
      "over ranks\n",
      w.num_prompts, w.isl, w.osl, w.concurrency, w.max_batched_tokens, w.chunk_size);
  if (!p.preset_note.empty()) fmt::print("  {}\n", p.preset_note);
  fmt::print("  simulated: the MoE layers only; attention and dense layers are not simulated\n");
  if (p.cuda_graph) {
    fmt::print(
        "  --cuda-graph: every backend runs eager, then with decode-only steps as CUDA graph "
        "replays (buckets {}; {}; {})\n",
        fmt::join(p.graph_buckets, ","),
        p.world_graphs   ? "one graph of every rank per bucket, one launch per step"
        : p.split_graphs ? "per-rank graphs, each launched from its rank's thread; each layer's "
                           "expert stage in a graph of its own, 2 x layers + 1 launches per step"
                         : "per-rank graphs, each launched from its rank's thread, one per step",
        p.graph_experts == CaptureExperts::kSwitch
            ? "experts: a SWITCH node each picks the GEMM rows from the received count"
            : "experts: no conditional nodes, every local expert's GEMMs at the most rows it "
              "can receive");
  }
  fmt::print("  launch shapes: {}, timeout {} ms, {}\n", p.launch.origin, p.cfg.timeout_ms,
             env_note);
  std::fflush(stdout);
  if (!p.json_path.empty()) {  // fail now, not after the run
    std::ofstream probe(p.json_path);
    if (!probe) EPX_THROW(InputError, fmt::format("--json = '{}' cannot be written", p.json_path));
  }

  // Streams and activations: 2 x budget rows per rank (a window of the budget moves through
  // them), tiled from a generated block.
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::unique_ptr<Rank>> ranks;
  for (int r = 0; r < W; ++r) ranks.push_back(std::make_unique<Rank>());
  const size_t row_bytes = size_t(p.shape.hidden) * 2;
  const int pool_rows = 2 * w.max_batched_tokens;
  parallel_for(W, W, [&](int r) {
    Rank& rk = *ranks[size_t(r)];
    rk.index = r;
    rk.device = world.device_of(r);
    EPX_CUDA_CHECK(cudaSetDevice(rk.device));
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&rk.stream, cudaStreamNonBlocking));
    EPX_CUDA_CHECK(cudaMalloc(&rk.x, size_t(pool_rows) * row_bytes));
    EPX_CUDA_CHECK(cudaMalloc(&rk.y, size_t(w.max_batched_tokens) * row_bytes));
    if (p.cuda_graph) {
      const size_t rows = size_t(std::min(w.chunk_size, w.max_batched_tokens));
      EPX_CUDA_CHECK(cudaMalloc(&rk.x_graph, rows * row_bytes));
      EPX_CUDA_CHECK(cudaMemset(rk.x_graph, 0, rows * row_bytes));
    }
    const int block = std::min(pool_rows, 1024);
    const std::vector<uint16_t> host =
        ref::moe::make_moe_input(p.shape, block, p.seed * 1000003ULL + uint64_t(r) + 1);
    for (int row = 0; row < pool_rows; row += block) {
      const size_t n = size_t(std::min(block, pool_rows - row));
      EPX_CUDA_CHECK(cudaMemcpy(static_cast<uint8_t*>(rk.x) + size_t(row) * row_bytes, host.data(),
                                n * row_bytes, cudaMemcpyHostToDevice));
    }
  });
  std::string weights_note;
  const int distinct = build_layers(p, world, ranks, weights_note);
  fmt::print("  weights: {}; activations and layers ready in {:.1f} s\n", weights_note,
             seconds_since(t0));
  std::fflush(stdout);

  RankThreads threads(W);
  std::vector<BackendResult> results;
  for (Backend b : p.backends) {
    results.push_back(run_backend(p, b, false, world, ranks, threads));
    if (p.cuda_graph) results.push_back(run_backend(p, b, true, world, ranks, threads));
  }

  print_table(results);
  if (!p.json_path.empty()) {
    std::ofstream out(p.json_path);
    out << make_json(p, world, gpu, weights_note, distinct, results).dump(2) << "\n";
    out.close();
    if (!out) EPX_THROW(InputError, fmt::format("--json = '{}' could not be written", p.json_path));
    fmt::print("wrote {}\n", p.json_path);
  }
  bool ok = true;  // an unavailable backend is reported, not a failure
  for (const BackendResult& br : results) ok &= br.status == "ok" || br.status == "unavailable";
  fmt::print("{} ({:.0f} s)\n", ok ? "done" : "done, with erroneous backends (exit 1)",
             seconds_since(t_start));
  return ok;
}

#endif  // EPX_HAVE_CUDA

}  // namespace

void add_serve_bench(CLI::App& app, int& exit_code) {
  auto f = std::make_shared<ServeFlags>();
  CLI::App* c = app.add_subcommand(
      "serve-bench",
      "inter-token latency of a simulated serving workload (chunked prefill + decode of N "
      "requests over W data-parallel ranks, DeepSeek-R1-shaped MoE layers) per backend; only "
      "the MoE layers are simulated (honours EPX_CONFIG_PATH and EPX_TIMEOUT_MS)");
  serve::Workload& w = f->workload;
  std::vector<CLI::Option*> workload_opts = {
      c->add_option("--world", w.world, "data-parallel ranks, in-process, all on GPU 0 (1..32)"),
      c->add_option("--num-prompts", w.num_prompts, "requests, all submitted at t = 0"),
      c->add_option("--isl", w.isl, "input (prompt) tokens per request"),
      c->add_option("--osl", w.osl, "output tokens per request"),
      c->add_option("--concurrency", w.concurrency, "requests in flight over all ranks"),
      c->add_option("--max-batched-tokens", w.max_batched_tokens,
                    "token budget per rank per step (decodes first, then prefill chunks)"),
      c->add_option("--chunk-size", w.chunk_size,
                    "DP chunk = the All2All's max_tokens_per_rank; a rank's tokens beyond it go "
                    "in further chunks")};
  for (CLI::Option* o : workload_opts) o->capture_default_str();
  c->add_option("--backends", f->backends,
                "comma list of naive | allgather_reducescatter | low_latency")
      ->capture_default_str();
  c->add_option("--hidden", f->hidden, "hidden size H (multiple of 512)")->capture_default_str();
  c->add_option("--intermediate", f->intermediate, "routed experts' I (multiple of 512)")
      ->capture_default_str();
  c->add_option("--experts", f->experts, "global experts E (multiple of --world)")
      ->capture_default_str();
  c->add_option("--topk", f->topk, "experts per token K")->capture_default_str();
  c->add_option("--shared-intermediate", f->shared_intermediate,
                "shared expert's I (0 = none, else a multiple of 512)")
      ->capture_default_str();
  c->add_option("--layers", f->layers, "MoE layers per step")->capture_default_str();
  c->add_option("--weights", f->weights,
                "auto | distinct | shared: one MoeLayer per layer, or one per rank reused by "
                "every layer (auto: distinct when they fit in device memory)")
      ->capture_default_str();
  c->add_option("--dtype", f->dtype, "dispatch wire dtype: bf16 | fp8 | bf16-to-fp8")
      ->capture_default_str();
  c->add_option("--layout", f->layout, "token | expert (dispatch output layout)")
      ->capture_default_str();
  c->add_option("--seed", f->seed, "seed of weights and activations")->capture_default_str();
  c->add_option("--json", f->json_path, "also write the results as JSON to FILE");
  c->add_option("--preset", f->preset, preset_help());
  c->add_flag("--cuda-graph", f->cuda_graph,
              "run every backend twice, eager then with decode-only steps (one chunk) replayed "
              "as CUDA graphs captured per batch bucket (--graph-buckets, --graph-scope; "
              "batches padded with dummy tokens); prefill and mixed steps stay eager");
  c->add_option("--graph-scope", f->graph_scope,
                "with --cuda-graph: rank (every rank captures and replays its own graphs from its "
                "own thread, as engines do) | world (one graph per bucket holding every rank's "
                "forward as parallel branches, replayed from one thread)")
      ->capture_default_str();
  c->add_option("--graph-split", f->graph_split,
                "with --cuda-graph and --graph-scope rank: expert (each layer's expert stage in a "
                "graph of its own, apart from dispatch and combine, as an engine that runs other "
                "work between them would capture; the default) | none (one graph per step)");
  c->add_option("--graph-experts", f->graph_experts,
                "with --cuda-graph: switch (a SWITCH node per local expert picks its GEMM rows "
                "from the received count) | all-rows (no conditional nodes: every local expert's "
                "GEMMs at the most rows it can receive) | auto (all-rows when ranks share the "
                "GPU: graphs with SWITCH nodes have stopped there, from 20 ranks and once at 8; "
                "the default)");
  c->add_option("--graph-buckets", f->graph_buckets,
                "with --cuda-graph: the decode batch sizes captured, ascending comma list "
                "(default 1, 2, 4, ... up to the largest); larger decode batches run eagerly");
  c->callback([f, workload_opts, &exit_code] {
    std::map<std::string, bool> given;
    for (CLI::Option* o : workload_opts)
      if (o->count() > 0 && o->get_name() != "--world") given[o->get_name()] = true;
    const ServePlan plan = validate(*f, given);
#if EPX_HAVE_CUDA
    exit_code = run_serve_bench(plan) ? 0 : 1;
#else
    (void)plan;
    (void)exit_code;
    EPX_THROW(UnsupportedError, "epx serve-bench needs an NVIDIA GPU and a CUDA build of epx");
#endif
  });
}

}  // namespace epx::cli
