// CPU dispatch and combine (DESIGN §4), written for clarity: one pass per receiving rank in
// (source rank, source index) order, which is also the documented row order. The passes of
// different ranks are independent and run on threads of their own (a check of 16384 tokens per
// rank at the R1 shape moves gigabytes through them).

#include "reference/reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "core/logfmt.hpp"
#include "epx/error.hpp"

namespace epx::ref {
namespace {

// One source rank's rows as they go on the wire, computed once per dispatch.
struct WireRows {
  std::vector<uint8_t> x;     // [N][wire_row_bytes]
  std::vector<float> scales;  // [N][H/128], fp8 wires only
};

// LogFMT blocks are 128 values: a row must hold whole blocks.
void check_format(const EpConfig& cfg, CombineFormat format) {
  EPX_CHECK(format != CombineFormat::kLogFMT || cfg.hidden % logfmt::kBlockValues == 0, InputError,
            "hidden (LogFMT combine)", cfg.hidden, "a multiple of 128");
}

void check_inputs(const EpConfig& cfg, const std::vector<RankInput>& inputs) {
  cfg.validate();
  EPX_CHECK(static_cast<int>(inputs.size()) == cfg.world_size, InputError, "inputs.size()",
            inputs.size(), "world_size = " + std::to_string(cfg.world_size));
  for (size_t s = 0; s < inputs.size(); ++s) {
    const RankInput& in = inputs[s];
    const std::string who = "inputs[" + std::to_string(s) + "]";
    const size_t n = static_cast<size_t>(in.num_tokens);
    const size_t elems = n * static_cast<size_t>(cfg.hidden);
    EPX_CHECK(in.num_tokens >= 0 && in.num_tokens <= cfg.max_tokens_per_rank, InputError,
              who + ".num_tokens", in.num_tokens,
              "in [0, max_tokens_per_rank = " + std::to_string(cfg.max_tokens_per_rank) + "]");
    EPX_CHECK(
        in.routing.num_tokens == in.num_tokens && in.routing.topk == cfg.topk &&
            in.routing.ids.size() == n * cfg.topk && in.routing.weights.size() == n * cfg.topk,
        InputError, who + ".routing",
        "[" + std::to_string(in.routing.num_tokens) + "][" + std::to_string(in.routing.topk) + "]",
        "[" + std::to_string(n) + "][topk = " + std::to_string(cfg.topk) + "]");
    if (!in.rank_mask.empty() || !in.expert_counts.empty()) {
      EPX_CHECK(in.rank_mask.size() == n * cfg.world_size, InputError, who + ".rank_mask.size()",
                in.rank_mask.size(), "num_tokens * world_size = " + std::to_string(n * cfg.world_size));
      EPX_CHECK(in.expert_counts.size() == static_cast<size_t>(cfg.num_experts), InputError,
                who + ".expert_counts.size()", in.expert_counts.size(),
                "num_experts = " + std::to_string(cfg.num_experts) + " with a rank mask");
    }
    if (cfg.input_fp8()) {
      EPX_CHECK(in.x_fp8.size() == elems, InputError, who + ".x_fp8.size()", in.x_fp8.size(),
                std::to_string(elems));
      EPX_CHECK(in.scales.size() == n * cfg.num_scale_groups(), InputError, who + ".scales.size()",
                in.scales.size(), std::to_string(n * cfg.num_scale_groups()));
    } else {
      EPX_CHECK(in.x_bf16.size() == elems, InputError, who + ".x_bf16.size()", in.x_bf16.size(),
                std::to_string(elems));
    }
  }
}

WireRows wire_rows(const EpConfig& cfg, const RankInput& in) {
  WireRows w;
  const size_t elems = static_cast<size_t>(in.num_tokens) * cfg.hidden;
  switch (cfg.dtype) {
    case DispatchDtype::kBF16:
      // bf16 bits, little-endian, as they sit in device memory.
      w.x.resize(elems * 2);
      for (size_t i = 0; i < elems; ++i) {
        w.x[2 * i] = static_cast<uint8_t>(in.x_bf16[i] & 0xFF);
        w.x[2 * i + 1] = static_cast<uint8_t>(in.x_bf16[i] >> 8);
      }
      break;
    case DispatchDtype::kFP8:
      w.x = in.x_fp8;
      w.scales = in.scales;
      break;
    case DispatchDtype::kBF16ToFP8:
      w.x.resize(elems);
      w.scales.resize(static_cast<size_t>(in.num_tokens) * cfg.num_scale_groups());
      quantize_fp8(in.x_bf16.data(), in.num_tokens, cfg.hidden, w.x.data(), w.scales.data(),
                   cfg.round_scale);
      break;
  }
  return w;
}

template <typename T>
void append_row(std::vector<T>& dst, const std::vector<T>& src, size_t row, size_t width) {
  dst.insert(dst.end(), src.begin() + static_cast<std::ptrdiff_t>(row * width),
             src.begin() + static_cast<std::ptrdiff_t>((row + 1) * width));
}

const int32_t* ids_of(const RankInput& in, int n, int topk) {
  return in.routing.ids.data() + static_cast<size_t>(n) * topk;
}

// Row `row` of a received wire buffer as floats: fp8 dequantised with its scales, bf16 as is.
std::vector<float> wire_row_as_float(const EpConfig& cfg, const uint8_t* x, const float* scales) {
  std::vector<float> v(static_cast<size_t>(cfg.hidden));
  if (cfg.wire_fp8()) {
    dequantize_fp8(x, scales, 1, cfg.hidden, v.data());
  } else {
    for (int h = 0; h < cfg.hidden; ++h) {
      v[h] = bf16_to_float(static_cast<uint16_t>(x[2 * h] | (x[2 * h + 1] << 8)));
    }
  }
  return v;
}

// Index of token (s, n) in one flat array over all source ranks.
std::vector<int> token_offsets(const std::vector<RankInput>& inputs) {
  std::vector<int> offset(inputs.size() + 1, 0);
  for (size_t s = 0; s < inputs.size(); ++s) offset[s + 1] = offset[s] + inputs[s].num_tokens;
  return offset;
}

int checked_token(const std::vector<RankInput>& inputs, const std::vector<int>& offset,
                  int src_rank, int src_idx, const std::string& where) {
  EPX_CHECK(src_rank >= 0 && src_rank < static_cast<int>(inputs.size()), InputError,
            where + " src_rank", src_rank, "in [0, " + std::to_string(inputs.size()) + ")");
  EPX_CHECK(src_idx >= 0 && src_idx < inputs[src_rank].num_tokens, InputError, where + " src_idx",
            src_idx, "in [0, " + std::to_string(inputs[src_rank].num_tokens) + ")");
  return offset[src_rank] + src_idx;
}

}  // namespace

// ---- dispatch ------------------------------------------------------------------------------

std::vector<TokenMajorRecv> dispatch_token_major(const EpConfig& cfg,
                                                 const std::vector<RankInput>& inputs,
                                                 bool every_rank) {
  check_inputs(cfg, inputs);
  const int world = cfg.world_size;
  const int topk = cfg.topk;
  const int local = cfg.num_local_experts();
  const size_t row_bytes = static_cast<size_t>(cfg.wire_row_bytes());
  const size_t groups = cfg.wire_fp8() ? static_cast<size_t>(cfg.num_scale_groups()) : 0;

  std::vector<WireRows> wire(inputs.size());
  for_each_index(world, [&](int s) { wire[s] = wire_rows(cfg, inputs[s]); });

  std::vector<TokenMajorRecv> recv(static_cast<size_t>(world));
  for_each_index(world, [&](int r) {
    TokenMajorRecv& out = recv[r];
    out.expert_counts.assign(static_cast<size_t>(local), 0);
    for (int s = 0; s < world; ++s) {
      const RankInput& in = inputs[s];
      if (!in.rank_mask.empty()) {  // routing by rank: the sender's counts, rows without ids
        for (int e = 0; e < local; ++e) out.expert_counts[e] += in.expert_counts[r * local + e];
        const std::vector<int32_t> no_ids(static_cast<size_t>(topk), -1);
        const std::vector<float> no_weights(static_cast<size_t>(topk), 0.0f);
        for (int n = 0; n < in.num_tokens; ++n) {
          if (in.rank_mask[static_cast<size_t>(n) * world + r] == 0 && !every_rank) continue;
          append_row(out.x, wire[s].x, static_cast<size_t>(n), row_bytes);
          if (groups > 0) append_row(out.scales, wire[s].scales, static_cast<size_t>(n), groups);
          out.src_rank.push_back(s);
          out.src_idx.push_back(n);
          out.topk_ids.insert(out.topk_ids.end(), no_ids.begin(), no_ids.end());
          out.topk_weights.insert(out.topk_weights.end(), no_weights.begin(), no_weights.end());
          ++out.count;
        }
        continue;
      }
      for (int n = 0; n < in.num_tokens; ++n) {
        const int32_t* ids = ids_of(in, n, topk);
        if (!token_valid(ids, topk, cfg.num_experts)) continue;
        bool routed_here = false;
        for (int k = 0; k < topk; ++k) {
          if (ids[k] >= 0 && cfg.expert_rank(ids[k]) == r) {
            routed_here = true;
            ++out.expert_counts[ids[k] - r * local];
          }
        }
        if (!routed_here && !every_rank) continue;  // once per rank however many experts live here
        append_row(out.x, wire[s].x, static_cast<size_t>(n), row_bytes);
        if (groups > 0) append_row(out.scales, wire[s].scales, static_cast<size_t>(n), groups);
        out.src_rank.push_back(s);
        out.src_idx.push_back(n);
        append_row(out.topk_ids, in.routing.ids, static_cast<size_t>(n), topk);
        append_row(out.topk_weights, in.routing.weights, static_cast<size_t>(n), topk);
        ++out.count;
      }
    }
  });
  return recv;
}

std::vector<ExpertMajorRecv> dispatch_expert_major(const EpConfig& cfg,
                                                   const std::vector<RankInput>& inputs) {
  check_inputs(cfg, inputs);
  for (size_t s = 0; s < inputs.size(); ++s) {
    EPX_CHECK(inputs[s].rank_mask.empty(), InputError,
              "inputs[" + std::to_string(s) + "].rank_mask", "set",
              "empty for the expert-major layout (its rows are (token, expert) pairs: top-k ids)");
  }
  const int world = cfg.world_size;
  const int topk = cfg.topk;
  const int local = cfg.num_local_experts();
  const size_t row_bytes = static_cast<size_t>(cfg.wire_row_bytes());
  const size_t groups = cfg.wire_fp8() ? static_cast<size_t>(cfg.num_scale_groups()) : 0;

  std::vector<WireRows> wire(inputs.size());
  for_each_index(world, [&](int s) { wire[s] = wire_rows(cfg, inputs[s]); });

  std::vector<ExpertMajorRecv> recv(static_cast<size_t>(world));
  for_each_index(world, [&](int r) {
    ExpertMajorRecv& out = recv[r];
    out.count.assign(static_cast<size_t>(local), 0);
    out.x.resize(local);
    out.scales.resize(local);
    out.src_rank.resize(local);
    out.src_idx.resize(local);
    out.topk_slot.resize(local);
    out.weight.resize(local);
    // Visiting sources in (s, n) order appends to every expert's list in that order.
    for (int s = 0; s < world; ++s) {
      const RankInput& in = inputs[s];
      for (int n = 0; n < in.num_tokens; ++n) {
        const int32_t* ids = ids_of(in, n, topk);
        if (!token_valid(ids, topk, cfg.num_experts)) continue;
        for (int k = 0; k < topk; ++k) {
          if (ids[k] < 0 || cfg.expert_rank(ids[k]) != r) continue;
          const int e = ids[k] - r * local;
          append_row(out.x[e], wire[s].x, static_cast<size_t>(n), row_bytes);
          if (groups > 0) append_row(out.scales[e], wire[s].scales, static_cast<size_t>(n), groups);
          out.src_rank[e].push_back(s);
          out.src_idx[e].push_back(n);
          out.topk_slot[e].push_back(k);
          out.weight[e].push_back(in.routing.weights[static_cast<size_t>(n) * topk + k]);
          ++out.count[e];
        }
      }
    }
  });
  return recv;
}

// ---- combine -------------------------------------------------------------------------------

void ranks_in_highest_slot_order(const Routing& routing, int n, int experts_per_rank, int world,
                                 std::vector<int>& order) {
  // key[r] = the highest slot k of token n whose expert is on rank r, -1 where none is.
  std::vector<int> key(static_cast<size_t>(world), -1);
  const int32_t* ids = routing.ids.data() + static_cast<size_t>(n) * routing.topk;
  for (int k = 0; k < routing.topk; ++k)
    if (ids[k] >= 0) key[static_cast<size_t>(ids[k] / experts_per_rank)] = k;
  order.resize(static_cast<size_t>(world));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return key[a] < key[b]; });
}

std::vector<std::vector<uint16_t>> combine_token_major(
    const EpConfig& cfg, const std::vector<RankInput>& inputs,
    const std::vector<TokenMajorRecv>& recv, const std::vector<std::vector<uint16_t>>& partials,
    CombineFormat format, CombineExtrasRef* extras) {
  check_inputs(cfg, inputs);
  check_format(cfg, format);
  const int world = cfg.world_size;
  const size_t hidden = static_cast<size_t>(cfg.hidden);
  const size_t topk = static_cast<size_t>(cfg.topk);
  EPX_CHECK(recv.size() == inputs.size(), InputError, "recv.size()", recv.size(),
            "world_size = " + std::to_string(world));
  CombineExtrasRef none;
  CombineExtrasRef& ex = extras != nullptr ? *extras : none;
  const bool weights = !ex.topk_weights.empty();
  for (auto [v, name] : {std::pair{&ex.bias0, "bias0"}, std::pair{&ex.bias1, "bias1"}}) {
    if (v->empty()) continue;
    EPX_CHECK(v->size() == inputs.size(), InputError, std::string("extras.") + name + ".size()",
              v->size(), "world_size = " + std::to_string(world));
    for (int s = 0; s < world; ++s) {
      const size_t want = static_cast<size_t>(inputs[s].num_tokens) * hidden;
      EPX_CHECK((*v)[s].empty() || (*v)[s].size() == want, InputError,
                std::string("extras.") + name + "[" + std::to_string(s) + "].size()",
                (*v)[s].size(), "empty or num_tokens * hidden = " + std::to_string(want));
    }
  }
  if (weights) {
    EPX_CHECK(ex.topk_weights.size() == inputs.size(), InputError, "extras.topk_weights.size()",
              ex.topk_weights.size(), "world_size = " + std::to_string(world));
    for (int r = 0; r < world; ++r) {
      const size_t want = static_cast<size_t>(recv[r].count) * topk;
      EPX_CHECK(ex.topk_weights[r].size() == want, InputError,
                "extras.topk_weights[" + std::to_string(r) + "].size()", ex.topk_weights[r].size(),
                "count * topk = " + std::to_string(want));
    }
    ex.y_topk_weights.assign(static_cast<size_t>(world), {});
  }
  EPX_CHECK(partials.size() == inputs.size(), InputError, "partials.size()", partials.size(),
            "world_size = " + std::to_string(world));

  // row_of[r][token] = the row of recv[r] holding that token, -1 if r did not receive it.
  // Taken from the rows' metadata, so any row order (e.g. a non-deterministic backend's) works.
  const std::vector<int> offset = token_offsets(inputs);
  const int total = offset.back();
  std::vector<std::vector<int>> row_of(static_cast<size_t>(world),
                                       std::vector<int>(static_cast<size_t>(total), -1));
  for (int r = 0; r < world; ++r) {
    const std::string where = "recv[" + std::to_string(r) + "]";
    EPX_CHECK(recv[r].src_rank.size() == static_cast<size_t>(recv[r].count) &&
                  recv[r].src_idx.size() == static_cast<size_t>(recv[r].count),
              InputError, where + ".count", recv[r].count, "the number of metadata rows");
    EPX_CHECK(partials[r].size() == static_cast<size_t>(recv[r].count) * hidden, InputError,
              "partials[" + std::to_string(r) + "].size()", partials[r].size(),
              "count * hidden = " + std::to_string(static_cast<size_t>(recv[r].count) * hidden));
    for (int j = 0; j < recv[r].count; ++j) {
      const int t = checked_token(inputs, offset, recv[r].src_rank[j], recv[r].src_idx[j],
                                  where + " row " + std::to_string(j));
      EPX_CHECK(row_of[r][t] < 0, InputError, where + " row " + std::to_string(j),
                "a second copy of a token", "each token at most once per rank");
      row_of[r][t] = j;
    }
  }

  const bool highest_slot = cfg.combine_order == CombineOrder::kHighestSlot;
  for (int s = 0; highest_slot && s < world; ++s)
    EPX_CHECK(inputs[s].rank_mask.empty(), InputError, "inputs[" + std::to_string(s) + "].rank_mask",
              "set", "empty with combine_order highest_slot (the order follows the top-k ids)");
  std::vector<std::vector<uint16_t>> y(static_cast<size_t>(world));
  for_each_index(world, [&](int s) {
    std::vector<int> order(static_cast<size_t>(world));
    std::iota(order.begin(), order.end(), 0);
    std::vector<float> acc(hidden);
    std::vector<float> decoded(format == CombineFormat::kLogFMT ? hidden : 0);
    y[s].resize(static_cast<size_t>(inputs[s].num_tokens) * hidden);
    if (weights) ex.y_topk_weights[s].assign(static_cast<size_t>(inputs[s].num_tokens) * topk, 0.0f);
    for (int n = 0; n < inputs[s].num_tokens; ++n) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (const auto* b : {&ex.bias0, &ex.bias1}) {
        if (b->empty() || (*b)[s].empty()) continue;  // (none given, or none by rank s)
        const uint16_t* row = (*b)[s].data() + static_cast<size_t>(n) * hidden;
        for (size_t h = 0; h < hidden; ++h) acc[h] += bf16_to_float(row[h]);
      }
      // Rank order, or each rank at its highest top-k slot of the token (slots ascending): the
      // same bits on every backend either way.
      if (highest_slot) ranks_in_highest_slot_order(inputs[s].routing, n, cfg.num_local_experts(),
                                                    world, order);
      for (int i = 0; i < world; ++i) {
        const int r = order[i];
        const int j = row_of[r][offset[s] + n];
        if (j < 0) continue;
        if (weights) {
          float* w = ex.y_topk_weights[s].data() + static_cast<size_t>(n) * topk;
          const float* in = ex.topk_weights[r].data() + static_cast<size_t>(j) * topk;
          for (size_t k = 0; k < topk; ++k) w[k] += in[k];
        }
        const uint16_t* p = partials[r].data() + static_cast<size_t>(j) * hidden;
        if (format == CombineFormat::kLogFMT) {
          logfmt_round_trip_row(p, cfg.hidden, decoded.data());
          for (size_t h = 0; h < hidden; ++h) acc[h] += decoded[h];
        } else {
          for (size_t h = 0; h < hidden; ++h) acc[h] += bf16_to_float(p[h]);
        }
      }
      uint16_t* out = y[s].data() + static_cast<size_t>(n) * hidden;
      for (size_t h = 0; h < hidden; ++h) out[h] = bf16_from_float(acc[h]);
    }
  });
  return y;
}

std::vector<std::vector<uint16_t>> combine_expert_major(
    const EpConfig& cfg, const std::vector<RankInput>& inputs,
    const std::vector<ExpertMajorRecv>& recv,
    const std::vector<std::vector<std::vector<uint16_t>>>& out, CombineFormat format) {
  check_inputs(cfg, inputs);
  check_format(cfg, format);
  const int world = cfg.world_size;
  const int topk = cfg.topk;
  const int local = cfg.num_local_experts();
  const size_t hidden = static_cast<size_t>(cfg.hidden);
  EPX_CHECK(recv.size() == inputs.size(), InputError, "recv.size()", recv.size(),
            "world_size = " + std::to_string(world));
  EPX_CHECK(out.size() == inputs.size(), InputError, "out.size()", out.size(),
            "world_size = " + std::to_string(world));

  // slot_of[token * K + k] = row of expert e_k's list on its rank holding (token, k).
  const std::vector<int> offset = token_offsets(inputs);
  std::vector<int> slot_of(static_cast<size_t>(offset.back()) * topk, -1);
  for (int r = 0; r < world; ++r) {
    EPX_CHECK(recv[r].count.size() == static_cast<size_t>(local) &&
                  out[r].size() == static_cast<size_t>(local),
              InputError, "recv[" + std::to_string(r) + "] experts", recv[r].count.size(),
              "E/W = " + std::to_string(local));
    for (int e = 0; e < local; ++e) {
      const int expert = r * local + e;
      const int count = recv[r].count[e];
      const std::string where = "recv[" + std::to_string(r) + "] expert " + std::to_string(e);
      EPX_CHECK(recv[r].src_rank[e].size() == static_cast<size_t>(count) &&
                    recv[r].src_idx[e].size() == static_cast<size_t>(count),
                InputError, where + " count", count, "the number of metadata rows");
      EPX_CHECK(out[r][e].size() == static_cast<size_t>(count) * hidden, InputError,
                "out[" + std::to_string(r) + "][" + std::to_string(e) + "].size()",
                out[r][e].size(), "count * hidden");
      for (int i = 0; i < count; ++i) {
        const int s = recv[r].src_rank[e][i];
        const int t = checked_token(inputs, offset, s, recv[r].src_idx[e][i],
                                    where + " row " + std::to_string(i));
        const int32_t* ids = ids_of(inputs[s], recv[r].src_idx[e][i], topk);
        int k = 0;
        while (k < topk && ids[k] != expert) ++k;
        EPX_CHECK(k < topk, InputError, where + " row " + std::to_string(i),
                  "a token not routed to this expert", "only tokens that chose the expert");
        int& slot = slot_of[static_cast<size_t>(t) * topk + k];
        EPX_CHECK(slot < 0, InputError, where + " row " + std::to_string(i),
                  "a second copy of a token", "each (token, expert) once");
        slot = i;
      }
    }
  }

  std::vector<std::vector<uint16_t>> y(static_cast<size_t>(world));
  for_each_index(world, [&](int s) {
    std::vector<float> acc(hidden);
    std::vector<float> p(hidden);
    std::vector<uint16_t> p_bf16(format == CombineFormat::kLogFMT ? hidden : 0);
    const RankInput& in = inputs[s];
    y[s].resize(static_cast<size_t>(in.num_tokens) * hidden);
    for (int n = 0; n < in.num_tokens; ++n) {
      const int32_t* ids = ids_of(in, n, topk);
      const float* w = in.routing.weights.data() + static_cast<size_t>(n) * topk;
      const bool valid = token_valid(ids, topk, cfg.num_experts);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int r = 0; valid && r < world; ++r) {
        std::fill(p.begin(), p.end(), 0.0f);
        bool routed = false;  // rank r holds one of the token's experts: p_r crosses
        for (int k = 0; k < topk; ++k) {
          if (ids[k] < 0 || cfg.expert_rank(ids[k]) != r) continue;
          routed = true;
          const int slot = slot_of[static_cast<size_t>(offset[s] + n) * topk + k];
          EPX_CHECK(slot >= 0, InputError,
                    "recv[" + std::to_string(r) + "] expert " + std::to_string(ids[k] - r * local),
                    "no row for token (" + std::to_string(s) + ", " + std::to_string(n) + ")",
                    "one row per (token, expert)");
          const uint16_t* o =
              out[r][ids[k] - r * local].data() + static_cast<size_t>(slot) * hidden;
          for (size_t h = 0; h < hidden; ++h) p[h] = std::fmaf(w[k], bf16_to_float(o[h]), p[h]);
        }
        if (routed &&
            format == CombineFormat::kLogFMT) {  // p_r crosses as a LogFMT row of bf16(p_r)
          for (size_t h = 0; h < hidden; ++h) p_bf16[h] = bf16_from_float(p[h]);
          logfmt_round_trip_row(p_bf16.data(), cfg.hidden, p.data());
        }
        for (size_t h = 0; h < hidden; ++h) acc[h] += p[h];
      }
      uint16_t* dst = y[s].data() + static_cast<size_t>(n) * hidden;
      for (size_t h = 0; h < hidden; ++h) dst[h] = bf16_from_float(acc[h]);
    }
  });
  return y;
}

// ---- test helpers ------------------------------------------------------------------------

std::vector<uint16_t> identity_partials(const EpConfig& cfg, int rank, const TokenMajorRecv& recv) {
  const int topk = cfg.topk;
  const size_t hidden = static_cast<size_t>(cfg.hidden);
  const size_t row_bytes = static_cast<size_t>(cfg.wire_row_bytes());
  const size_t groups = static_cast<size_t>(cfg.num_scale_groups());
  std::vector<uint16_t> partials(static_cast<size_t>(recv.count) * hidden);
  std::vector<float> local_w(static_cast<size_t>(topk));
  for (int j = 0; j < recv.count; ++j) {
    const std::vector<float> v =
        wire_row_as_float(cfg, recv.x.data() + j * row_bytes,
                          cfg.wire_fp8() ? recv.scales.data() + j * groups : nullptr);
    const int32_t* ids = recv.topk_ids.data() + static_cast<size_t>(j) * topk;
    const float* w = recv.topk_weights.data() + static_cast<size_t>(j) * topk;
    // The row's weights of this rank's experts, in top-k order (the other slots add nothing).
    int num_local = 0;
    for (int k = 0; k < topk; ++k)
      if (ids[k] >= 0 && cfg.expert_rank(ids[k]) == rank) local_w[num_local++] = w[k];
    uint16_t* dst = partials.data() + j * hidden;
    for (size_t h = 0; h < hidden; ++h) {
      float acc = 0.0f;
      for (int i = 0; i < num_local; ++i) acc = std::fmaf(local_w[i], v[h], acc);
      dst[h] = bf16_from_float(acc);
    }
  }
  return partials;
}

std::vector<std::vector<uint16_t>> identity_expert_outputs(const EpConfig& cfg,
                                                           const ExpertMajorRecv& recv) {
  const size_t hidden = static_cast<size_t>(cfg.hidden);
  const size_t row_bytes = static_cast<size_t>(cfg.wire_row_bytes());
  const size_t groups = static_cast<size_t>(cfg.num_scale_groups());
  std::vector<std::vector<uint16_t>> out(recv.count.size());
  for (size_t e = 0; e < recv.count.size(); ++e) {
    out[e].resize(static_cast<size_t>(recv.count[e]) * hidden);
    for (size_t i = 0; i < static_cast<size_t>(recv.count[e]); ++i) {
      const std::vector<float> v =
          wire_row_as_float(cfg, recv.x[e].data() + i * row_bytes,
                            cfg.wire_fp8() ? recv.scales[e].data() + i * groups : nullptr);
      for (size_t h = 0; h < hidden; ++h) out[e][i * hidden + h] = bf16_from_float(v[h]);
    }
  }
  return out;
}

std::vector<float> token_as_float(const EpConfig& cfg, const RankInput& in, int n) {
  const size_t hidden = static_cast<size_t>(cfg.hidden);
  const size_t groups = static_cast<size_t>(cfg.num_scale_groups());
  std::vector<float> v(hidden);
  switch (cfg.dtype) {
    case DispatchDtype::kBF16:
      for (size_t h = 0; h < hidden; ++h) v[h] = bf16_to_float(in.x_bf16[n * hidden + h]);
      break;
    case DispatchDtype::kFP8:
      dequantize_fp8(in.x_fp8.data() + n * hidden, in.scales.data() + n * groups, 1, cfg.hidden,
                     v.data());
      break;
    case DispatchDtype::kBF16ToFP8: {
      std::vector<uint8_t> q(hidden);
      std::vector<float> scales(groups);
      quantize_fp8(in.x_bf16.data() + n * hidden, 1, cfg.hidden, q.data(), scales.data(),
                   cfg.round_scale);
      dequantize_fp8(q.data(), scales.data(), 1, cfg.hidden, v.data());
      break;
    }
  }
  return v;
}

}  // namespace epx::ref
