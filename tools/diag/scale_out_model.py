#!/usr/bin/env python3
"""Cost model of epx beyond one node: the tables of docs/scale-out.md.

Python 3 standard library only. Every figure printed here is derived from the constants below;
what is an assumption (link fractions, per-message latency) is named as such. Routing fractions
for uniform top-k are exact (hypergeometric); those of DeepSeek-R1's group-limited router, and
the per-node partial counts of both, come from a seeded Monte-Carlo (--samples, --seed).

  python3 tools/diag/scale_out_model.py            # the doc's tables
  python3 tools/diag/scale_out_model.py --samples 200000 --rdma-fraction 0.8
"""

import argparse
import math
import random

# DeepSeek-R1 shape (its config: hidden 7168, 256 routed experts, 8 per token, 8 groups, 4 kept).
H, E, K = 7168, 256, 8
N_GROUPS, TOPK_GROUPS = 8, 4
L = 8  # GPUs (ranks) per node

# Bytes per row on the wire.
DISPATCH_PAYLOAD = H + (H // 128) * 4      # fp8 row + 56 f32 scales = 7392
ROW_META = 4 + 4 + K * 4 + K * 4           # source rank, source index, topk ids, topk weights = 72
DISPATCH_ROW = DISPATCH_PAYLOAD + ROW_META  # 7464
COMBINE_ROW = H * 2                         # bf16 partial = 14336
COMBINE_F32_ROW = H * 4                     # f32 block sum = 28672

MB = 1e6
ALPHA_S = HOST_SYNC_S = 0.0  # set from the flags in main()
MIB = 1 << 20


def exact_uniform(world, nodes):
    """Expected distinct ranks and nodes reached by a token with K distinct uniform experts."""
    miss = lambda per: math.comb(E - per, K) / math.comb(E, K)
    return world * (1 - miss(E // world)), nodes * (1 - miss(E // nodes))


def route_uniform(rng):
    return rng.sample(range(E), K)


def route_grouped(rng):
    # R1's router on random logits: sigmoid scores, a group's score is the sum of its best two,
    # the best TOPK_GROUPS groups are kept, then the best K experts among the kept groups.
    s = [1.0 / (1.0 + math.exp(-rng.gauss(0.0, 1.0))) for _ in range(E)]
    per = E // N_GROUPS
    gscore = []
    for g in range(N_GROUPS):
        a, b = sorted(s[g * per:(g + 1) * per])[-2:]
        gscore.append((a + b, g))
    kept = [g for _, g in sorted(gscore)[-TOPK_GROUPS:]]
    cand = [e for g in kept for e in range(g * per, (g + 1) * per)]
    return sorted(cand, key=lambda e: s[e])[-K:]


def monte_carlo(router, world, nodes, samples, seed):
    """Per token: ranks reached, nodes reached, sum over reached nodes of min(ranks there, 2)."""
    rng = random.Random(seed)
    per_rank, per_node = E // world, E // nodes
    tot_r = tot_n = tot_m2 = 0
    for _ in range(samples):
        experts = router(rng)
        ranks = {e // per_rank for e in experts}
        count = {}
        for r in ranks:
            count[r * per_rank // per_node] = count.get(r * per_rank // per_node, 0) + 1
        tot_r += len(ranks)
        tot_n += len(count)
        tot_m2 += sum(min(c, 2) for c in count.values())
    return tot_r / samples, tot_n / samples, tot_m2 / samples


def routing_stats(args):
    out = {}
    for world in (16, 64):
        nodes = world // L
        for name, router in (("uniform", route_uniform), ("grouped", route_grouped)):
            r, n, m2 = monte_carlo(router, world, nodes, args.samples, args.seed)
            if name == "uniform":
                r, n = exact_uniform(world, nodes)  # exact; the Monte-Carlo only for min(c, 2)
            off = (nodes - 1) / nodes  # the origin's node is independent of its routing
            out[(world, name)] = dict(
                nodes=nodes, ranks=r, nodes_reached=n, off_ranks=r * (world - L) / world,
                off_nodes=n * off, off_min2=m2 * off, nvl_rows=r * (L - 1) / L)
    return out


def paths(t):
    """The paths of the cost model; the host API path depends on the regime (decode or prefill)."""
    host = "host API, fixed messages" if t <= 1024 else "host API, counts first"
    return [("dispatch", "GIN rail, per-node dedup"), ("dispatch", "GIN direct, per-rank dedup"),
            ("dispatch", host), ("dispatch", FLAT_DISPATCH),
            ("combine", "GIN rail, rank partials (exact)"), ("combine", "GIN rail, block sums"),
            ("combine", "GIN rail, node sums bf16"),
            ("combine", host + ", rank partials (exact)"),
            ("combine", host + ", node sums bf16"), ("combine", FLAT_COMBINE)] + (
                [("dispatch", EXACT_DISPATCH), ("combine", EXACT_COMBINE)] if t > 1024 else [])


# The collective engine as built (src/backends/collective): NCCL's all-gather of every rank's
# fixed-size pack (NCCL's rings cross each node boundary once per pack: a node takes in each
# remote pack once, over its L NICs), and grouped send/recv of fixed blocks of T partial rows
# from every rank to every rank. RDMA: what a node must take in, per GPU; NVLink: the rest of
# what each GPU receives.
FLAT_DISPATCH = "flat engine: NCCL all-gather of fixed packs"
FLAT_COMBINE = "flat engine: fixed blocks to every rank (exact)"
# high_throughput without worst-case output on that engine (prefill): the counts read on the
# host once per dispatch, then each token's slot sent once per node it goes to (to the rail
# peer there, which relays it to the ranks of its node it goes to: per-node dedup, the host
# API's counts-first dispatch), and each partial straight back to its token's rank, by grouped
# send/recv of exact sizes.
EXACT_DISPATCH = "exact engine: counts first, once per node, relayed in the node"
EXACT_COMBINE = "exact engine: the partials of those rows (exact)"


def bytes_of(op, path, s, t, nodes):
    """(RDMA bytes, NVLink bytes, staged?, extra seconds) per GPU per direction for one path."""
    row = DISPATCH_ROW if op == "dispatch" else COMBINE_ROW
    if path == FLAT_DISPATCH:  # W - 1 packs a GPU: N - 1 through its NIC, the rest NVLink
        return t * (nodes - 1) * row, t * (nodes * L - nodes) * row, True, 0.0
    if path == FLAT_COMBINE:  # T rows to each of W - 1 ranks, W - L of them on other nodes
        return t * (nodes * L - L) * row, t * (L - 1) * row, True, 0.0
    if path == EXACT_DISPATCH:  # each remote node once, then on within it: the same bytes
        return bytes_of(op, "host API, counts first", s, t, nodes)
    if path == EXACT_COMBINE:  # the ranks reached, by where they are
        own_node = t * s["ranks"] * (L - 1) / (nodes * L) * row
        return t * s["off_ranks"] * row, own_node, True, 0.0
    nvl = 0.0 if "direct" in path else t * s["nvl_rows"] * row
    fixed, counts = "fixed" in path, "counts first" in path
    staged = fixed or counts
    extra = (ALPHA_S + HOST_SYNC_S) if counts and op == "dispatch" else 0.0
    if op == "dispatch":
        if "direct" in path:
            return t * s["off_ranks"] * row, nvl, False, 0.0
        rows = t * (nodes - 1) if fixed else t * s["off_nodes"]
        return rows * row, nvl, staged, extra
    if "rank partials" in path:
        rows = t * (nodes - 1) * min(K, L) if fixed else t * s["off_ranks"]
    elif "block sums" in path:
        rows = t * s["off_min2"]
    else:
        rows = t * (nodes - 1) if fixed else t * s["off_nodes"]
    return rows * row, nvl, staged, extra


def table(header, rows):
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=50000, help="Monte-Carlo tokens per case")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rdma-gbs", type=float, default=50.0, help="NIC line rate per direction")
    ap.add_argument("--rdma-fraction", type=float, default=0.9, help="assumed achievable share")
    ap.add_argument("--nvlink-gbs", type=float, default=450.0)
    ap.add_argument("--nvlink-fraction", type=float, default=0.8, help="assumed achievable share")
    ap.add_argument("--alpha-us", type=float, default=3.0, help="assumed latency per rail step")
    ap.add_argument("--host-sync-us", type=float, default=20.0,
                    help="assumed cost of the host read of counts (prefill path)")
    ap.add_argument("--ring-rows", type=int, default=256, help="high_throughput rows per rail peer")
    args = ap.parse_args()
    b_rdma = args.rdma_gbs * args.rdma_fraction * 1e9
    b_nvl = args.nvlink_gbs * args.nvlink_fraction * 1e9
    alpha = args.alpha_us * 1e-6
    global ALPHA_S, HOST_SYNC_S
    ALPHA_S, HOST_SYNC_S = alpha, args.host_sync_us * 1e-6
    st = routing_stats(args)

    print(f"# inputs: H {H}, E {E}, top-{K}, {L} GPUs per node; dispatch row {DISPATCH_ROW} B "
          f"({DISPATCH_PAYLOAD} payload + {ROW_META} metadata), combine row {COMBINE_ROW} B; "
          f"RDMA {args.rdma_gbs:g} GB/s x {args.rdma_fraction:g}, "
          f"NVLink {args.nvlink_gbs:g} GB/s x "
          f"{args.nvlink_fraction:g}, {args.alpha_us:g} us per rail step; Monte-Carlo "
          f"{args.samples} tokens, seed {args.seed}\n")

    print("## Routing: per token, expected destinations")
    rows = []
    for (world, name), s in st.items():
        rows.append([f"EP{world} ({s['nodes']}x{L})", name, f"{s['ranks']:.2f}",
                     f"{s['nodes_reached']:.2f}", f"{s['off_ranks']:.2f}", f"{s['off_nodes']:.2f}",
                     f"{s['off_ranks'] / s['ranks']:.3f}", f"{s['off_min2']:.2f}"])
    table(["world", "routing", "ranks reached", "nodes reached", "off-node ranks",
           "off-node nodes", "off-node share of ranks", "off-node sum min(c,2)"], rows)

    print("## Per case: bytes per GPU per direction, time lower bound, DeepEP's logical GB/s")
    print("(u = uniform top-8, g = R1 group-limited; pipelined paths: alpha + max(RDMA, NVLink);")
    print(" host-API paths are staged: alpha + RDMA + NVLink, plus one more alpha and the host")
    print(" read for counts first)\n")
    for world in (16, 64):
        nodes = world // L
        for t in (128, 4096):
            print(f"### EP{world} ({nodes}x{L}), {t} tokens per rank")
            rows = []
            for op, path in paths(t):
                cells = []
                for name in ("uniform", "grouped"):
                    s = st[(world, name)]
                    rdma, nvl, staged, extra = bytes_of(op, path, s, t, nodes)
                    link = rdma / b_rdma
                    stages = link + nvl / b_nvl if staged else max(link, nvl / b_nvl)
                    bound = alpha + extra + stages
                    logical = t * s["nodes_reached"] * (DISPATCH_PAYLOAD if op == "dispatch"
                                                        else COMBINE_ROW)
                    cells += [f"{rdma / MB:.2f}", f"{nvl / MB:.1f}", f"{bound * 1e6:.0f}",
                              f"{logical / bound / 1e9:.0f}"]
                rows.append([op, path] + cells)
            table(["op", "path", "RDMA MB u", "NVLink MB u", "bound us u", "logical GB/s u",
                   "RDMA MB g", "NVLink MB g", "bound us g", "logical GB/s g"], rows)

    print("## Memory per rank (one round in flight), MiB")
    rows = []
    for world in (16, 64):
        nodes = world // L
        for t in (128, 4096):
            recv = world * t * (DISPATCH_ROW + COMBINE_ROW)         # token-major rows + partials
            rail_d = 2 * (nodes - 1) * t * DISPATCH_ROW              # send + receive, per peer
            host_c = 2 * (nodes - 1) * t * min(K, L) * COMBINE_ROW   # per peer, worst case
            gin_c = 2 * t * K * COMBINE_ROW                          # slots (token, k), any peer
            ht = 2 * (nodes - 1) * args.ring_rows * (DISPATCH_ROW + COMBINE_ROW)
            rows.append([f"EP{world}", str(t), f"{recv / MIB:.0f}", f"{rail_d / MIB:.0f}",
                         f"{host_c / MIB:.0f}", f"{gin_c / MIB:.0f}",
                         f"{(recv + rail_d + host_c) / MIB:.0f}",
                         f"{(recv + rail_d + gin_c) / MIB:.0f}", f"{ht / MIB:.0f}"])
    table(["world", "max tok/rank", "node receive area", "rail dispatch",
           "rail combine, host API", "rail combine, GIN", "low_latency, host API",
           "low_latency, GIN", f"high_throughput rail rings ({args.ring_rows} rows)"], rows)

if __name__ == "__main__":
    main()
