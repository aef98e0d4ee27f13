#include "testing/harness.hpp"

#include <fmt/format.h>

#include <cstring>
#include <functional>
#include <future>
#include <memory>

#include "testing/harness_internal.hpp"
#include "testing/identity_expert.hpp"
#include "testing/graph_capture.hpp"
#include "epx/all2all.hpp"
#include "epx/error.hpp"
#include "epx/world.hpp"

namespace epx::testing {

using namespace internal;  // the pieces shared with run_check_ipc (harness_internal.hpp)

struct Checker::State {
  CheckOptions o;
  EpConfig cfg;
  std::vector<int> counts;
  std::vector<InputSet> sets;
};

Checker::Checker(const CheckOptions& options) : s_(std::make_unique<State>()) {
  require_gpu("epx check");
  State& st = *s_;
  st.o = options;
  const CheckOptions& o = st.o;
  st.cfg = o.cfg;
  st.cfg.rank = 0;
  st.cfg.validate();
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

  const bool one_stream = o.one_launch || o.halves;
  EPX_CHECK(!one_stream || (!o.mixed && !o.conditional && !o.rank_threads &&
                            o.graph_execs == 1 && !o.graph_split && !(o.one_launch && o.halves)),
            InputError, o.halves ? "halves" : "one_launch", "with mixed, a graph variant or each other",
            "one stream per GPU: plain eager calls and one captured graph per GPU");
  // Ordered rows exchange counts in the send half: one stream for all ranks would deadlock.
  EPX_CHECK(!o.halves || (!cfg.deterministic && o.backend != Backend::kNaive), InputError,
            "halves", "with ordered rows (deterministic or naive)",
            "unordered rows: the send half of ordered rows waits for every peer's counts");
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
  std::vector<RankBuffers> rb(W);
  for (int r = 0; r < W; ++r) {
    EPX_CUDA_CHECK(cudaSetDevice(world.device_of(r)));
    EPX_CUDA_CHECK(cudaStreamCreateWithFlags(&rb[r].stream, cudaStreamNonBlocking));
    EPX_CUDA_CHECK(cudaMalloc(&rb[r].x, maxT * H * 2));
    EPX_CUDA_CHECK(cudaMalloc(&rb[r].scales, std::max<size_t>(1, maxT * G) * sizeof(float)));
    EPX_CUDA_CHECK(cudaMalloc(&rb[r].ids, maxT * K * sizeof(int64_t)));
    EPX_CUDA_CHECK(cudaMalloc(&rb[r].weights, maxT * K * sizeof(float)));
    EPX_CUDA_CHECK(cudaMalloc(&rb[r].y, maxT * H * 2));
  }
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
        (void)cudaStreamSynchronize(b.stream);
        (void)cudaFree(b.x);
        (void)cudaFree(b.scales);
        (void)cudaFree(b.ids);
        (void)cudaFree(b.weights);
        (void)cudaFree(b.y);
        (void)cudaStreamDestroy(b.stream);
        if (b.side) (void)cudaStreamDestroy(b.side);
      }
    }
  } cleanup{rb};

  auto upload = [&](int r, const InputSet& s) {
    const RankInput& in = s.in[r];
    const size_t n = in.num_tokens;
    cudaStream_t st = rb[r].stream;
    if (n == 0) return;
    if (cfg.input_fp8()) {
      EPX_CUDA_CHECK(cudaMemcpyAsync(rb[r].x, in.x_fp8.data(), n * H, cudaMemcpyHostToDevice, st));
      EPX_CUDA_CHECK(cudaMemcpyAsync(rb[r].scales, in.scales.data(), n * G * sizeof(float),
                                     cudaMemcpyHostToDevice, st));
    } else {
      EPX_CUDA_CHECK(cudaMemcpyAsync(rb[r].x, in.x_bf16.data(), n * H * 2, cudaMemcpyHostToDevice, st));
    }
    if (o.ids_int64) {
      EPX_CUDA_CHECK(cudaMemcpyAsync(rb[r].ids, s.ids64[r].data(), n * K * sizeof(int64_t),
                                     cudaMemcpyHostToDevice, st));
    } else {
      EPX_CUDA_CHECK(cudaMemcpyAsync(rb[r].ids, in.routing.ids.data(), n * K * sizeof(int32_t),
                                     cudaMemcpyHostToDevice, st));
    }
    EPX_CUDA_CHECK(cudaMemcpyAsync(rb[r].weights, in.routing.weights.data(), n * K * sizeof(float),
                                   cudaMemcpyHostToDevice, st));
    EPX_CUDA_CHECK(cudaMemsetAsync(rb[r].y, 0xff, n * H * 2, st));  // poison: every row must be written
  };
  std::vector<DispatchResult> results(W);
  // `cut` (capturing with graph_split): ends the graph being captured and begins the next.
  // Rank r's dispatch arguments: its buffers, as upload() fills them.
  auto input_of = [&](int r) {
    return DispatchInput{.num_tokens = counts[r],
                         .x = rb[r].x,
                         .x_scales = cfg.input_fp8() ? rb[r].scales : nullptr,
                         .topk_ids = rb[r].ids,
                         .ids_type = o.ids_int64 ? IdType::kInt64 : IdType::kInt32,
                         .topk_weights = rb[r].weights};
  };
  auto enqueue = [&](int r, bool capturing, const std::function<void()>& cut = {}) {
    All2All& a = *group[r];
    results[r] = a.dispatch(input_of(r), rb[r].stream);
    if (cut) cut();
    if (capturing && o.conditional) {
      capture_identity_expert_switch(a.config(), results[r], a.combine_buffer(), rb[r].stream,
                                     rb[r].side);
    } else {
      launch_identity_expert(a.config(), results[r], a.combine_buffer(), rb[r].stream);
    }
    if (cut) cut();
    a.combine(a.combine_buffer(), rb[r].y, rb[r].stream);
  };
  // one_launch / halves: the ranks of GPU g (r % gpus == g) on their first rank's stream, in one
  // kernel per op or as every rank's send half then every rank's receive half; the inputs were
  // uploaded on each rank's own stream (synchronised first).
  const int num_gpus = std::min(o.gpus, W);
  auto enqueue_gpu = [&](int gpu) {
    std::vector<All2All*> ranks;
    std::vector<DispatchInput> ins;
    std::vector<const void*> outs;
    std::vector<void*> ys;
    for (int r = gpu; r < W; r += num_gpus) {
      ranks.push_back(group[r].get());
      ins.push_back(input_of(r));
      outs.push_back(group[r]->combine_buffer());
      ys.push_back(rb[r].y);
    }
    cudaStream_t st = rb[gpu].stream;
    EPX_CUDA_CHECK(cudaSetDevice(world.device_of(gpu)));
    std::vector<DispatchResult> res;
    if (o.halves) {
      for (size_t i = 0; i < ranks.size(); ++i) ranks[i]->dispatch_send(ins[i], st);
      for (size_t i = 0; i < ranks.size(); ++i) res.push_back(ranks[i]->dispatch_recv(st));
    } else {
      res = dispatch_group(ranks, ins, st);
    }
    for (size_t i = 0; i < ranks.size(); ++i) {
      results[gpu + i * num_gpus] = res[i];
      launch_identity_expert(ranks[i]->config(), res[i], ranks[i]->combine_buffer(), st);
    }
    if (o.halves) {
      for (size_t i = 0; i < ranks.size(); ++i) ranks[i]->combine_send(outs[i], st);
      for (size_t i = 0; i < ranks.size(); ++i) ranks[i]->combine_recv(ys[i], st);
    } else {
      combine_group(ranks, outs, ys, st);
    }
  };
  auto sync_all = [&] {
    for (int r = 0; r < W; ++r) EPX_CUDA_CHECK(cudaStreamSynchronize(rb[r].stream));
  };
  Comparer cmp(rep, o.max_report);
  auto finish_and_compare = [&](const InputSet& s) -> bool {
    try {
      if (one_stream) sync_all();
      for (int r = 0; r < W; ++r) group[r]->synchronize(rb[r].stream);
    } catch (const Error& e) {
      cmp.add(std::string("device error: ") + e.what());
      for (int r = 0; r < W; ++r) (void)cudaStreamSynchronize(rb[r].stream);
      return false;
    }
    if (o.corrupt_rank >= 0 && o.corrupt_rank < W && counts[o.corrupt_rank] > 0) {
      // flip the low bit of the first element of y[0] on that rank
      uint16_t v = 0;
      EPX_CUDA_CHECK(cudaMemcpy(&v, rb[o.corrupt_rank].y, 2, cudaMemcpyDeviceToHost));
      v ^= 1;
      EPX_CUDA_CHECK(cudaMemcpy(rb[o.corrupt_rank].y, &v, 2, cudaMemcpyHostToDevice));
    }
    for (int r = 0; r < W; ++r) {
      compare_dispatch(group[r]->config(), r, results[r], s, cmp);
      const size_t n = size_t(counts[r]) * H;
      cmp.eq(download<uint16_t>(rb[r].y, n), s.y[r].data(), n, int(H),
             fmt::format("rank {} combine y", r));
    }
    ++rep.calls;
    return rep.ok;
  };

  // Eager calls.
  for (int it = 0; it < o.iters && rep.ok; ++it) {
    const InputSet& s = sets[it % pool];
    for (int r = 0; r < W; ++r) upload(r, s);
    if (one_stream) {
      sync_all();
      for (int g = 0; g < num_gpus; ++g) enqueue_gpu(g);
    } else {
      for (int r = 0; r < W; ++r) enqueue(r, false);
    }
    finish_and_compare(s);
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
              for (auto& b : rb) (void)cudaStreamSynchronize(b.stream);
            }};
    for (int g = 0; g < num_gpus; ++g) {
      EPX_CUDA_CHECK(cudaSetDevice(world.device_of(g)));
      execs.push_back(capture_graph(rb[g].stream, [&] { enqueue_gpu(g); }));
    }
    const int64_t before = rep.calls;
    for (int i = 0; i < o.graph_replays && rep.ok; ++i) {
      const InputSet& s = sets[(o.iters + i) % pool];
      for (int r = 0; r < W; ++r) upload(r, s);
      sync_all();
      for (int g = 0; g < num_gpus; ++g) {
        EPX_CUDA_CHECK(cudaSetDevice(world.device_of(g)));
        EPX_CUDA_CHECK(cudaGraphLaunch(execs[size_t(g)], rb[g].stream));
      }
      finish_and_compare(s);
      if ((i + 1) % 100 == 0) say(fmt::format("graph: {} replay(s) checked", i + 1));
    }
    say(fmt::format("graph ({}): {} replay(s) checked",
                    o.one_launch ? "one launch per GPU" : "halves, one stream", rep.calls - before));
    return rep;
  }

  // Graph replays.
  if (o.graph_replays > 0 && rep.ok) {
    // Runs fn(r) for every rank: one host thread per rank with rank_threads, else in turn.
    auto each_rank = [&](const std::function<void(int)>& fn) {
      if (!o.rank_threads) {
        for (int r = 0; r < W; ++r) fn(r);
        return;
      }
      std::vector<std::future<void>> done;
      for (int r = 0; r < W; ++r) {
        done.push_back(std::async(std::launch::async, [&, r] {
          EPX_CUDA_CHECK(cudaSetDevice(world.device_of(r)));
          fn(r);
        }));
      }
      for (auto& f : done) f.get();  // rethrows the first rank's exception
    };
    EPX_CHECK(o.graph_execs >= 1 && o.graph_execs <= 64, InputError, "graph_execs", o.graph_execs,
              "in [1, 64]");
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
    for (int i = 0; i < o.graph_replays && rep.ok; ++i) {
      const InputSet& s = sets[(o.iters + i) % pool];
      for (int r = 0; r < W; ++r) upload(r, s);
      each_rank([&](int r) {
        if (!graphs.execs[size_t(r)].empty()) {
          for (cudaGraphExec_t e : graphs.execs[size_t(r)][size_t(i % o.graph_execs)])
            EPX_CUDA_CHECK(cudaGraphLaunch(e, rb[r].stream));
        } else {
          enqueue(r, false);
        }
      });
      finish_and_compare(s);
      if ((i + 1) % 100 == 0) say(fmt::format("graph: {} replay(s) checked", i + 1));
    }
    say(fmt::format("graph{}: {} replay(s) checked", o.mixed ? " (rank 0 eager)" : "",
                    rep.calls - before));
  }
  return rep;
}

}  // namespace epx::testing
