#include "testing/harness.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <memory>

#include "testing/harness_internal.hpp"
#include "testing/threads.hpp"
#include "testing/identity_expert.hpp"
#include "testing/graph_capture.hpp"
#include "epx/all2all.hpp"
#include "epx/error.hpp"
#include "epx/world.hpp"

namespace epx::testing {

using namespace internal;  // the pieces shared with run_check_ipc (harness_internal.hpp)

namespace {

// Resident set of this process: the second field of /proc/self/statm, in pages (0 where there
// is no /proc).
size_t host_rss_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  unsigned long size = 0, resident = 0;
  const int got = std::fscanf(f, "%lu %lu", &size, &resident);
  std::fclose(f);
  return got == 2 ? size_t(resident) * size_t(::sysconf(_SC_PAGESIZE)) : 0;
}

// Device memory in use (total - free) summed over `devices`, and the host's resident set; the
// current device is left as it was.
MemorySample sample_memory(int64_t replays, const std::vector<int>& devices) {
  MemorySample m;
  m.replays = replays;
  int current = 0;
  EPX_CUDA_CHECK(cudaGetDevice(&current));
  for (int d : devices) {
    size_t free_bytes = 0, total_bytes = 0;
    EPX_CUDA_CHECK(cudaSetDevice(d));
    EPX_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    m.device_bytes += total_bytes - free_bytes;
  }
  EPX_CUDA_CHECK(cudaSetDevice(current));
  m.host_rss_bytes = host_rss_bytes();
  return m;
}

double in_mib(size_t bytes) { return double(bytes) / double(1 << 20); }

}  // namespace

struct Checker::State {
  CheckOptions o;
  EpConfig cfg;
  std::vector<int> counts;
  std::vector<InputSet> sets;
};

Checker::Checker(const CheckOptions& options) : s_(std::make_unique<State>()) {
  require_gpu("epx check");
  validate_check_options(options);
  State& st = *s_;
  st.o = options;
  const CheckOptions& o = st.o;
  st.cfg = o.cfg;
  st.cfg.rank = 0;
  st.counts = resolve_token_counts(o, st.cfg);
  st.sets = make_sets(o, st.cfg, st.counts);
  if (o.log)
    o.log(fmt::format("reference ready: {} input set(s), tokens per rank {}", st.sets.size(),
                      fmt::join(st.counts, ",")));
}

Checker::~Checker() = default;
Checker::Checker(Checker&&) noexcept = default;
Checker& Checker::operator=(Checker&&) noexcept = default;

const std::vector<int>& Checker::tokens() const { return s_->counts; }

CheckReport run_check(const CheckOptions& o) { return Checker(o).run(o.launch); }

CheckReport Checker::run(const LaunchConfigs& launch) const {
  const CheckOptions& o = s_->o;
  const EpConfig& cfg = s_->cfg;
  const std::vector<int>& counts = s_->counts;
  const std::vector<InputSet>& sets = s_->sets;
  const int W = cfg.world_size;
  const int pool = int(sets.size());
  CheckReport rep;
  rep.tokens = counts;

  auto say = [&](const std::string& s) {
    if (o.log) o.log(s);
  };

  // The options passed validate_check_options() in the constructor.
  const bool one_stream = o.one_launch || o.halves;
  // Rounds in flight: each call is R rounds interleaved, every dispatch before the combines
  // (dispatch A, dispatch B, expert A, combine A, expert B, combine B), each on its own inputs.
  const int R = cfg.rounds_in_flight;
  std::vector<int> devices;
  for (int g = 0; g < o.gpus; ++g) devices.push_back(g);
  InProcessWorld world(W, devices);
  auto group = make_all2all_group(o.backend, cfg, world, launch);
  rep.buffer_bytes = group[0]->symmetric_bytes();

  for (int r = 0; r < W; ++r) {
    EPX_CUDA_CHECK(cudaSetDevice(world.device_of(r)));
    preload_identity_expert();
  }
  const size_t H = cfg.hidden, K = cfg.topk, G = cfg.num_scale_groups();
  const size_t maxT = cfg.max_tokens_per_rank;
  // rb[k * W + r]: rank r's inputs and output of the k-th round of a call; rank r's stream is
  // rb[r].stream.
  std::vector<RankBuffers> rb(size_t(R) * W);
  for (size_t i = 0; i < rb.size(); ++i) {
    const int r = int(i % W);
    EPX_CUDA_CHECK(cudaSetDevice(world.device_of(r)));
    if (i < size_t(W)) EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&rb[i].stream, cudaStreamNonBlocking));
    EPX_CUDA_CHECK(cudaMalloc(&rb[i].x, maxT * H * 2));
    EPX_CUDA_CHECK(cudaMalloc(&rb[i].scales, std::max<size_t>(1, maxT * G) * sizeof(float)));
    EPX_CUDA_CHECK(cudaMalloc(&rb[i].ids, maxT * K * sizeof(int64_t)));
    EPX_CUDA_CHECK(cudaMalloc(&rb[i].weights, maxT * K * sizeof(float)));
    EPX_CUDA_CHECK(cudaMalloc(&rb[i].y, maxT * H * 2));
    if (o.pool_expert_out) {
      // As many rows as any round's combine buffer (token-major or expert-major).
      const size_t rows = size_t(cfg.capacity()) *
                          (cfg.layout == OutputLayout::kExpertMajor ? cfg.num_local_experts() : 1);
      EPX_CUDA_CHECK(cudaMallocAsync(&rb[i].pool_out, rows * H * 2, rb[size_t(r)].stream));
      EPX_CUDA_CHECK(cudaStreamSynchronize(rb[size_t(r)].stream));
    }
  }
  auto io = [&](int r, int k) -> RankBuffers& { return rb[size_t(k) * W + r]; };
  // The side streams (they only record conditional bodies) after every rank stream: streams
  // take hardware queues in turn, and each rank stream needs its own (InProcessWorld).
  for (int r = 0; r < W && o.conditional; ++r) {
    EPX_CUDA_CHECK(cudaSetDevice(world.device_of(r)));
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&rb[r].side, cudaStreamNonBlocking));
  }
  struct Cleanup {
    std::vector<RankBuffers>& rb;
    ~Cleanup() {
      for (auto& b : rb) {
        if (b.stream) (void)cudaStreamSynchronize(b.stream);
        (void)cudaFree(b.x);
        (void)cudaFree(b.scales);
        (void)cudaFree(b.ids);
        (void)cudaFree(b.weights);
        (void)cudaFree(b.y);
        if (b.pool_out) (void)cudaFree(b.pool_out);  // waits for the device
        if (b.stream) (void)cudaStreamDestroy(b.stream);
        if (b.side) (void)cudaStreamDestroy(b.side);
      }
    }
  } cleanup{rb};

  auto upload_round = [&](int r, const InputSet& s, RankBuffers& b) {
    const RankInput& in = s.in[r];
    const size_t n = in.num_tokens;
    cudaStream_t st = rb[r].stream;
    if (n == 0) return;
    if (cfg.input_fp8()) {
      EPX_CUDA_CHECK(cudaMemcpyAsync(b.x, in.x_fp8.data(), n * H, cudaMemcpyHostToDevice, st));
      EPX_CUDA_CHECK(cudaMemcpyAsync(b.scales, in.scales.data(), n * G * sizeof(float),
                                     cudaMemcpyHostToDevice, st));
    } else {
      EPX_CUDA_CHECK(cudaMemcpyAsync(b.x, in.x_bf16.data(), n * H * 2, cudaMemcpyHostToDevice, st));
    }
    if (o.ids_int64) {
      EPX_CUDA_CHECK(cudaMemcpyAsync(b.ids, s.ids64[r].data(), n * K * sizeof(int64_t),
                                     cudaMemcpyHostToDevice, st));
    } else {
      EPX_CUDA_CHECK(cudaMemcpyAsync(b.ids, in.routing.ids.data(), n * K * sizeof(int32_t),
                                     cudaMemcpyHostToDevice, st));
    }
    EPX_CUDA_CHECK(cudaMemcpyAsync(b.weights, in.routing.weights.data(), n * K * sizeof(float),
                                   cudaMemcpyHostToDevice, st));
    EPX_CUDA_CHECK(cudaMemsetAsync(b.y, 0xff, n * H * 2, st));  // poison: every row must be written
  };
  // The input sets of call `c` (one per round) and their upload.
  auto set_of = [&](int64_t c, int k) -> const InputSet& { return sets[size_t((c * R + k) % pool)]; };
  auto upload = [&](int r, int64_t c) {
    for (int k = 0; k < R; ++k) upload_round(r, set_of(c, k), io(r, k));
  };
  std::vector<DispatchResult> results(size_t(R) * W);  // [round][rank]
  auto result_of = [&](int r, int k) -> DispatchResult& { return results[size_t(k) * W + r]; };
  // Rank r's dispatch arguments of round k: its buffers, as upload() fills them.
  auto input_of = [&](int r, int k) {
    const RankBuffers& b = io(r, k);
    return DispatchInput{.num_tokens = counts[r],
                         .x = b.x,
                         .x_scales = cfg.input_fp8() ? b.scales : nullptr,
                         .topk_ids = b.ids,
                         .ids_type = o.ids_int64 ? IdType::kInt64 : IdType::kInt32,
                         .topk_weights = b.weights};
  };
  // `cut` (capturing with graph_split): ends the graph being captured and begins the next.
  auto enqueue = [&](int r, bool capturing, const std::function<void()>& cut = {}) {
    All2All& a = *group[r];
    cudaStream_t st = rb[r].stream;
    for (int k = 0; k < R; ++k) result_of(r, k) = a.dispatch(input_of(r, k), st);
    if (cut) cut();
    for (int k = 0; k < R; ++k) {
      const DispatchResult& d = result_of(r, k);
      void* out = o.pool_expert_out ? io(r, k).pool_out : d.combine_buffer;
      if (capturing && o.conditional) {
        capture_identity_expert_switch(a.config(), d, out, st, rb[r].side);
      } else {
        launch_identity_expert(a.config(), d, out, st);
      }
      if (cut) cut();
      a.combine(out, io(r, k).y, st);
    }
  };
  // one_launch / halves: the ranks of GPU g (r % gpus == g) on their first rank's stream, in one
  // kernel per op or as every rank's send half then every rank's receive half; the inputs were
  // uploaded on each rank's own stream (synchronised first).
  const int num_gpus = std::min(o.gpus, W);
  auto enqueue_gpu = [&](int gpu) {
    std::vector<All2All*> ranks;
    for (int r = gpu; r < W; r += num_gpus) ranks.push_back(group[r].get());
    auto rank_at = [&](size_t i) { return gpu + int(i) * num_gpus; };
    cudaStream_t st = rb[gpu].stream;
    EPX_CUDA_CHECK(cudaSetDevice(world.device_of(gpu)));
    for (int k = 0; k < R; ++k) {
      std::vector<DispatchInput> ins;
      for (size_t i = 0; i < ranks.size(); ++i) ins.push_back(input_of(rank_at(i), k));
      std::vector<DispatchResult> res;
      if (o.halves) {
        for (size_t i = 0; i < ranks.size(); ++i) ranks[i]->dispatch_send(ins[i], st);
        for (size_t i = 0; i < ranks.size(); ++i) res.push_back(ranks[i]->dispatch_recv(st));
      } else {
        res = dispatch_group(ranks, ins, st);
      }
      for (size_t i = 0; i < ranks.size(); ++i) result_of(rank_at(i), k) = res[i];
    }
    for (int k = 0; k < R; ++k) {
      std::vector<const void*> outs;
      std::vector<void*> ys;
      for (size_t i = 0; i < ranks.size(); ++i) {
        const DispatchResult& d = result_of(rank_at(i), k);
        void* out = o.pool_expert_out ? io(rank_at(i), k).pool_out : d.combine_buffer;
        launch_identity_expert(ranks[i]->config(), d, out, st);
        outs.push_back(out);
        ys.push_back(io(rank_at(i), k).y);
      }
      if (o.halves) {
        for (size_t i = 0; i < ranks.size(); ++i) ranks[i]->combine_send(outs[i], st);
        for (size_t i = 0; i < ranks.size(); ++i) ranks[i]->combine_recv(ys[i], st);
      } else {
        combine_group(ranks, outs, ys, st);
      }
    }
  };
  auto sync_all = [&] {
    for (int r = 0; r < W; ++r) EPX_CUDA_CHECK(cudaStreamSynchronize(rb[r].stream));
  };
  Comparer cmp(rep, o.max_report);
  // Waits for every rank's work of a call; a device error (timeout, bad input, peer) becomes a
  // mismatch.
  auto finish = [&]() -> bool {
    try {
      if (one_stream) sync_all();
      for (int r = 0; r < W; ++r) group[r]->synchronize(rb[r].stream);
    } catch (const Error& e) {
      cmp.add(std::string("device error: ") + e.what());
      for (int r = 0; r < W; ++r) (void)cudaStreamSynchronize(rb[r].stream);
      return false;
    }
    return true;
  };
  auto finish_and_compare = [&](int64_t call) -> bool {
    if (!finish()) return false;
    if (o.corrupt_rank >= 0 && o.corrupt_rank < W && counts[o.corrupt_rank] > 0) {
      // flip the low bit of the first element of y[0] on that rank
      uint16_t v = 0;
      EPX_CUDA_CHECK(cudaMemcpy(&v, rb[o.corrupt_rank].y, 2, cudaMemcpyDeviceToHost));
      v ^= 1;
      EPX_CUDA_CHECK(cudaMemcpy(rb[o.corrupt_rank].y, &v, 2, cudaMemcpyHostToDevice));
    }
    for (int k = 0; k < R; ++k) {
      const InputSet& s = set_of(call, k);
      const std::string round = R > 1 ? fmt::format(" (round {} of the call)", k) : "";
      for (int r = 0; r < W; ++r) {
        compare_dispatch(group[r]->config(), o.backend, r, result_of(r, k), s, cmp);
        const size_t n = size_t(counts[r]) * H;
        cmp.eq(download<uint16_t>(io(r, k).y, n), s.y[r].data(), n, int(H),
               fmt::format("rank {} combine y{}", r, round));
      }
    }
    ++rep.calls;
    return rep.ok;
  };
  // Replay i (0-based) of the graph: every verify_every-th and the last are compared, the
  // others only finished (their device status checked).
  auto finish_replay = [&](int i) {
    ++rep.replays;
    const bool verify = (i + 1) % o.verify_every == 0 || i + 1 == o.graph_replays;
    if (verify) {
      finish_and_compare(o.iters + i);
    } else {
      finish();
    }
    if (o.verify_every == 1 && (i + 1) % 100 == 0)
      say(fmt::format("graph: {} replay(s) checked", i + 1));
  };
  // Memory in use before the first replay, after every tenth of them and after the last (or
  // the one that failed).
  const int64_t sample_step = std::max<int64_t>(1, (int64_t(o.graph_replays) + 9) / 10);
  auto sample = [&](int64_t done) {
    if (!rep.memory.empty() && rep.memory.back().replays == done) return;
    const MemorySample& m = rep.memory.emplace_back(sample_memory(done, devices));
    say(fmt::format("memory after {} of {} replay(s): device {:.1f} MiB in use, host RSS {:.1f} "
                    "MiB",
                    done, o.graph_replays, in_mib(m.device_bytes), in_mib(m.host_rss_bytes)));
  };
  auto sample_after = [&](int i) {
    if ((i + 1) % sample_step == 0 || i + 1 == o.graph_replays || !rep.ok) sample(i + 1);
  };

  // Runs fn(r) for every rank: one host thread per rank with rank_threads (or when a rank's
  // dispatch waits on the host for its peers: high_throughput sizing its receive area per call),
  // else in turn.
  const bool host_waits = o.backend == Backend::kHighThroughput && !cfg.worst_case_output;
  auto each_rank = [&](const std::function<void(int)>& fn) {
    if (!o.rank_threads && !host_waits) {
      for (int r = 0; r < W; ++r) fn(r);
      return;
    }
    run_on_threads(W, [&](int r) { return world.device_of(r); }, fn);
  };

  // Eager calls.
  for (int it = 0; it < o.iters && rep.ok; ++it) {
    for (int r = 0; r < W; ++r) upload(r, it);
    if (one_stream && host_waits && num_gpus > 1) {
      // Each GPU's group waits on the host for the other GPUs' counts: one thread per GPU.
      sync_all();
      run_on_threads(num_gpus, [&](int g) { return world.device_of(g); }, enqueue_gpu);
    } else if (one_stream) {
      sync_all();
      for (int g = 0; g < num_gpus; ++g) enqueue_gpu(g);
    } else {
      each_rank([&](int r) { enqueue(r, false); });
    }
    finish_and_compare(it);
  }
  if (o.iters > 0)
    say(fmt::format("eager{}: {} call(s) checked",
                    o.one_launch ? " (one launch per GPU)" : o.halves ? " (halves, one stream)" : "",
                    rep.calls));

  // Graph replays, one launch per GPU: one graph per GPU.
  if (one_stream && o.graph_replays > 0 && rep.ok) {
    std::vector<cudaGraphExec_t> execs;
    struct Execs {
      std::vector<cudaGraphExec_t>& e;
      std::function<void()> drain;
      ~Execs() {
        drain();
        for (cudaGraphExec_t x : e) (void)cudaGraphExecDestroy(x);
      }
    } guard{execs, [&] {
              for (auto& b : rb)
                if (b.stream) (void)cudaStreamSynchronize(b.stream);
            }};
    for (int g = 0; g < num_gpus; ++g) {
      EPX_CUDA_CHECK(cudaSetDevice(world.device_of(g)));
      execs.push_back(capture_graph(rb[g].stream, [&] { enqueue_gpu(g); }));
    }
    const int64_t before = rep.calls;
    sample(0);
    for (int i = 0; i < o.graph_replays && rep.ok; ++i) {
      for (int r = 0; r < W; ++r) upload(r, o.iters + i);
      sync_all();
      for (int g = 0; g < num_gpus; ++g) {
        EPX_CUDA_CHECK(cudaSetDevice(world.device_of(g)));
        EPX_CUDA_CHECK(cudaGraphLaunch(execs[size_t(g)], rb[g].stream));
      }
      finish_replay(i);
      sample_after(i);
    }
    say(fmt::format("graph ({}): {} replay(s), {} checked",
                    o.one_launch ? "one launch per GPU" : "halves, one stream", rep.replays,
                    rep.calls - before));
    return rep;
  }

  // Graph replays.
  if (o.graph_replays > 0 && rep.ok) {
    // Per rank graph_execs executable graphs, each one capture cut into pieces (one, or three with
    // graph_split) replayed in order; one capture each (a graph with conditional nodes
    // instantiates once). Destroyed on the way out, after the streams are drained.
    struct Graphs {
      std::vector<std::vector<std::vector<cudaGraphExec_t>>> execs;
      std::vector<RankBuffers>& rb;
      ~Graphs() {
        for (size_t r = 0; r < execs.size(); ++r) {
          (void)cudaStreamSynchronize(rb[r].stream);
          for (auto& pieces : execs[r])
            for (cudaGraphExec_t e : pieces) (void)cudaGraphExecDestroy(e);
        }
      }
    } graphs{std::vector<std::vector<std::vector<cudaGraphExec_t>>>(size_t(W)), rb};
    each_rank([&](int r) {
      if (o.mixed && r == 0) return;
      cudaStream_t st = rb[r].stream;
      auto end_piece = [&](std::vector<cudaGraphExec_t>& pieces) {
        pieces.push_back(end_capture_and_instantiate(st));
      };
      for (int k = 0; k < o.graph_execs; ++k) {
        std::vector<cudaGraphExec_t>& pieces = graphs.execs[size_t(r)].emplace_back();
        EPX_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        std::function<void()> cut;
        if (o.graph_split) {
          cut = [&] {
            end_piece(pieces);
            EPX_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
          };
        }
        try {
          enqueue(r, true, cut);
          end_piece(pieces);
        } catch (...) {  // end the open capture so that the cleanup's stream calls work
          abandon_capture(st);
          throw;
        }
      }
    });
    const int64_t before = rep.calls;
    sample(0);
    for (int i = 0; i < o.graph_replays && rep.ok; ++i) {
      for (int r = 0; r < W; ++r) upload(r, o.iters + i);
      each_rank([&](int r) {
        if (!graphs.execs[size_t(r)].empty()) {
          for (cudaGraphExec_t e : graphs.execs[size_t(r)][size_t(i % o.graph_execs)])
            EPX_CUDA_CHECK(cudaGraphLaunch(e, rb[r].stream));
        } else {
          enqueue(r, false);
        }
      });
      finish_replay(i);
      sample_after(i);
    }
    say(fmt::format("graph{}: {} replay(s), {} checked", o.mixed ? " (rank 0 eager)" : "",
                    rep.replays, rep.calls - before));
  }
  return rep;
}

}  // namespace epx::testing
