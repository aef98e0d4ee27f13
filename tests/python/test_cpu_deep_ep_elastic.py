"""DeepEP V2's ElasticBuffer (epx.deep_ep) on the CPU, over the torch model of epx's core in
test_cpu_deep_ep_fake_core (ranks run as threads; the model's token-major rows are ordered by
(source rank, source index) and its combine sums in the order of each rank's highest top-k slot,
as high_throughput does with combine_order 'highest_slot').

What the buffer must do without expansion, in our words: dispatch delivers each token once to
every rank that holds one of its experts, rows ordered by (source rank, source index), with the
token's ids made local (-1 for experts elsewhere) and its whole weight row; the handle holds the
prefix sums of the rows per source rank and of the aligned rows per local expert, the source of
each row (rank x T + index, and rank x K + the token's highest slot on this rank), where each of
this rank's tokens lands at each destination, the counts read on the host (only with the host
read: without it every output has the worst-case W x T rows, those past the count marked -1 or
0); a cached dispatch returns the same rows and the same handle; combine adds, per token, the f32
sum of the bias rows, then each rank's row at that rank's highest slot of the token, slots
ascending, rounded once; the weights come back as the owner's copy of each slot. What is not
served is refused by name. The expand mode (one row per (token, local slot), experts
contiguous and aligned) and the combines of an expand handle are checked bit for bit against
restatements of DeepEP's arithmetic (expected_expand, expand_combine_reference). The scenarios
are module-level functions (buffer, rank, ...) so that a GPU test can run them on real epx
objects. Needs torch (skipped without it); no GPU."""

import functools

import pytest

import epx

torch = pytest.importorskip("torch")

import test_cpu_deep_ep_fake_core as fake  # noqa: E402  (needs torch too)
import test_cpu_deep_ep_normal as normal  # noqa: E402

H, TOPK = normal.H, normal.TOPK
T_MAX = 16  # num_max_tokens_per_rank of the scenarios' buffers (inputs() makes at most 11)
# Where the scenarios put their tensors: the CPU here, the GPU when a GPU test runs them.
DEVICE = torch.device("cpu")


def inputs(rank, num_experts, seed=0):
    """Rank `rank`'s tokens (x, topk_idx int64 with some -1, topk_weights), as the normal mode's
    tests make them, on DEVICE."""
    return tuple(t.to(DEVICE) for t in normal.inputs(rank, num_experts, seed))


def owner_ranks(ids, W, E):
    """Per slot of one token's ids, the rank holding the expert (None for -1)."""
    L = E // W
    return [int(e) // L if 0 <= int(e) < E else None for e in ids]


def highest_slots(ids, W, E):
    """{rank: the highest slot of the token whose expert that rank holds}."""
    return {q: k for k, q in enumerate(owner_ranks(ids, W, E)) if q is not None}


def run_ranks(monkeypatch, world_size, body, **buffer_kwargs):
    """body(buffer, rank) on every rank of an ElasticBuffer, each rank a thread."""
    import epx.deep_ep as deep_ep

    fabric = fake.Fabric(world_size)
    monkeypatch.setattr(deep_ep._elastic, "All2All", fake.FakeAll2All)
    monkeypatch.setattr(deep_ep.ElasticBuffer, "_make_world",
                        staticmethod(lambda group: fake.FakeWorld(fabric, group.rank())))
    kwargs = dict(num_max_tokens_per_rank=T_MAX, hidden=H, explicitly_destroy=True)
    kwargs.update(buffer_kwargs)

    def rank_main(rank):
        buffer = deep_ep.ElasticBuffer(fake.FakeGroup(rank, world_size), **kwargs)
        body(buffer, rank)
        buffer.destroy()

    fake.run_threads(fabric, world_size, rank_main)


# ---- dispatch and its handle -------------------------------------------------------------------


def check_dispatch(rank, W, E, out, alignment=1, with_weights=True):
    """The rows, ids and weights of a dispatch with the host read, and its handle's fields."""
    recv_x, recv_idx, recv_w, handle, event = out
    rows = normal.expected_rows(rank, W, E)
    L, K = E // W, TOPK
    assert event.event is None
    assert recv_x.shape == (len(rows), H) and recv_x.dtype == torch.bfloat16
    assert recv_idx.shape == (len(rows), K) and recv_idx.dtype == torch.int64
    assert (recv_w is None) != with_weights
    for j, (q, n) in enumerate(rows):
        xq, iq, wq = inputs(q, E)
        assert torch.equal(recv_x[j], xq[n])
        local = (iq[n] >= rank * L) & (iq[n] < (rank + 1) * L)
        assert recv_idx[j].tolist() == torch.where(local, iq[n] - rank * L, -1).tolist()
        if with_weights:  # the whole row, as DeepEP V2 sends it
            assert torch.equal(recv_w[j], wq[n])
    raw = [int((recv_idx == e).sum()) for e in range(L)]
    aligned = [-(-c // alignment) * alignment for c in raw]
    h = handle
    assert (h.do_expand, h.num_experts, h.expert_alignment, h.num_max_tokens_per_rank) == \
        (False, E, alignment, T_MAX)
    assert h.num_recv_tokens == len(rows) and h.num_expanded_tokens == sum(aligned)
    assert h.num_recv_tokens_per_expert_list == aligned
    assert h.num_unaligned_recv_tokens_per_expert.tolist() == raw
    assert h.psum_num_recv_tokens_per_expert.dtype == torch.int32
    assert h.psum_num_recv_tokens_per_expert.tolist() == \
        [sum(aligned[:e + 1]) for e in range(L)]
    assert h.psum_num_recv_tokens_per_scaleup_rank.dtype == torch.int32
    assert h.psum_num_recv_tokens_per_scaleup_rank.tolist() == \
        [sum(1 for q, _ in rows if q <= i) for i in range(W)]
    meta = h.recv_src_metadata
    assert meta.dtype == torch.int32 and meta.shape == (len(rows), K + 2)
    for j, (q, n) in enumerate(rows):
        top = highest_slots(inputs(q, E)[1][n], W, E)[rank]
        assert meta[j].tolist() == [q * T_MAX + n, q * K + top] + [-1] * K
    # where this rank's tokens land: at each destination's highest slot, the token's place
    # among this rank's tokens sent there, offset by rank x T
    _, idx, _ = inputs(rank, E)
    sent = [0] * W
    want = torch.full((idx.shape[0], K), -1, dtype=torch.int32)
    for t in range(idx.shape[0]):
        for q, k in highest_slots(idx[t], W, E).items():
            want[t, k] = rank * T_MAX + sent[q]
        for q in highest_slots(idx[t], W, E):
            sent[q] += 1
    assert torch.equal(h.dst_buffer_slot_idx.cpu(), want)
    assert h.token_metadata_at_forward is None and h.channel_linked_list is None
    return rows


def scenario_dispatch_and_cached(buffer, rank, W, E):
    x, idx, w = inputs(rank, E)
    L = E // W
    stats = torch.zeros(L, dtype=torch.int32, device=DEVICE)
    out = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                          cumulative_local_expert_recv_stats=stats)
    check_dispatch(rank, W, E, out)
    recv_x, recv_idx, _, handle, _ = out
    assert stats.tolist() == [int((recv_idx == e).sum()) for e in range(L)]
    assert handle.topk_idx.data_ptr() != idx.data_ptr() and torch.equal(handle.topk_idx, idx)
    assert handle.num_sms == buffer.get_theoretical_num_sms(E, TOPK)
    # cached: the same rows, the same handle object, no weights unless given
    again = buffer.dispatch(x, handle=handle)
    assert again[3] is handle and again[2] is None
    assert torch.equal(again[0], recv_x) and torch.equal(again[1], recv_idx)
    assert torch.equal(buffer.dispatch(x, handle=handle, topk_weights=w)[2], out[2])
    # alignment, the caller's ids kept, previous_event with allocate_on_comm_stream, num_sms
    out = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, expert_alignment=4,
                          do_handle_copy=False, num_sms=6, allocate_on_comm_stream=True,
                          previous_event=buffer.capture() if DEVICE.type == "cuda" else None)
    check_dispatch(rank, W, E, out, alignment=4)
    assert out[3].topk_idx is idx and out[3].num_sms == 6
    # without weights
    check_dispatch(rank, W, E, buffer.dispatch(x, topk_idx=idx, num_experts=E),
                   with_weights=False)


@pytest.mark.parametrize("W,E", [(2, 6), (3, 9)])
def test_dispatch_handle_and_cached_dispatch(monkeypatch, W, E):
    run_ranks(monkeypatch, W, functools.partial(scenario_dispatch_and_cached, W=W, E=E))


def scenario_without_cpu_sync(buffer, rank, W=2, E=6):
    x, idx, w = inputs(rank, E)
    synced = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, expert_alignment=2)
    m = synced[0].shape[0]
    recv_x, recv_idx, recv_w, handle, _ = buffer.dispatch(
        x, topk_idx=idx, topk_weights=w, num_experts=E, expert_alignment=2, do_cpu_sync=False)
    worst = W * T_MAX  # every output at the worst case, nothing read back
    assert recv_x.shape[0] == recv_idx.shape[0] == recv_w.shape[0] == worst
    assert handle.recv_src_metadata.shape[0] == handle.num_recv_tokens == worst
    assert handle.num_recv_tokens_per_expert_list == []
    L = E // W
    assert handle.num_expanded_tokens == -(-(worst * min(TOPK, L) + (2 - 1) * L) // 2) * 2
    assert torch.equal(recv_x[:m], synced[0]) and torch.equal(recv_idx[:m], synced[1])
    assert torch.equal(recv_w[:m], synced[2])
    assert (recv_idx[m:] == -1).all() and (recv_w[m:] == 0).all()
    assert (handle.recv_src_metadata[m:] == -1).all()
    assert torch.equal(handle.recv_src_metadata[:m], synced[3].recv_src_metadata)
    for name in ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                 "num_unaligned_recv_tokens_per_expert", "dst_buffer_slot_idx"):
        assert torch.equal(getattr(handle, name), getattr(synced[3], name)), name
    # a cached dispatch keeps the handle's size; combine reads no row past the count, and
    # neither looks at the fields a caller may trim (DeepEP's test cuts recv_src_metadata)
    handle.recv_src_metadata = handle.recv_src_metadata[:m]
    assert buffer.dispatch(x, handle=handle)[0].shape[0] == worst
    given = torch.cat([recv_x[:m], torch.full((worst - m, H), float("nan"), dtype=torch.bfloat16,
                                              device=DEVICE)])
    combined, weights, _ = buffer.combine(given, handle, topk_weights=recv_w)
    assert torch.equal(combined, combine_reference(rank, W, E, lambda q, j, row: row))
    assert torch.equal(weights, torch.where(idx >= 0, w, 0.0))


def test_dispatch_without_cpu_sync(monkeypatch):
    run_ranks(monkeypatch, 2, scenario_without_cpu_sync)


# ---- combine -----------------------------------------------------------------------------------


def give_back(q, j, row):
    """What rank q gives back for its received row j: ranks 0 and 1 (mod 3) the row times 2^30
    and times -2^30, which cancel exactly; rank 2 the row plus j, which survives only where it
    is not added to 2^30 x the row before the cancellation: the order of the f32 sum shows."""
    scale = (2.0 ** 30, -(2.0 ** 30), 1.0)[q % 3]
    return (row.float() * scale + (j if q % 3 == 2 else 0)).to(torch.bfloat16)


def combine_reference(rank, W, E, give, biases=(), order="highest_slot"):
    """The tokens of `rank` as V2's combine makes them: a f32 accumulator starts at zero, takes
    each bias row in turn, then walks the token's top-k slots in ascending order and, at a slot
    that is the last one whose expert a rank holds, adds that rank's given-back row; the result
    is rounded to bf16 once. order='rank' adds the ranks in rank order instead (what the check
    must tell apart)."""
    x, idx, _ = inputs(rank, E)
    acc = torch.zeros(x.shape[0], H, device=DEVICE)
    for b in biases:
        acc += b.float()
    row_at = [{src: j for j, src in enumerate(normal.expected_rows(q, W, E))} for q in range(W)]
    for n in range(x.shape[0]):
        last = highest_slots(idx[n], W, E)
        ranks = sorted(last, key=last.get) if order == "highest_slot" else sorted(last)
        for q in ranks:
            acc[n] += give(q, row_at[q][(rank, n)], x[n]).float()
    return acc.to(torch.bfloat16)


def scenario_combine(buffer, rank, W=3, E=9):
    x, idx, w = inputs(rank, E)
    recv_x, _, recv_w, handle, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=w,
                                                   num_experts=E)
    given = torch.stack([give_back(rank, j, recv_x[j]) for j in range(recv_x.shape[0])])
    g = torch.Generator().manual_seed(70 + rank)
    b0, b1 = (torch.randn(x.shape[0], H, generator=g).to(torch.bfloat16).to(DEVICE)
              for _ in range(2))
    want = combine_reference(rank, W, E, give_back)
    # the data tells the two orders apart (on some rank's tokens), so the checks below can fail
    assert any(not torch.equal(combine_reference(q, W, E, give_back),
                               combine_reference(q, W, E, give_back, order="rank"))
               for q in range(W))
    combined, weights, event = buffer.combine(given, handle)
    assert weights is None and event.event is None and torch.equal(combined, want)
    for bias, biases in ((b0, (b0,)), ((b0, b1), (b0, b1)), ((b0, None), (b0,))):
        combined, weights, _ = buffer.combine(given, handle, topk_weights=recv_w, bias=bias)
        assert torch.equal(combined, combine_reference(rank, W, E, give_back, biases))
        # each slot's weight from the rank holding its expert, 0 where the id is -1
        assert torch.equal(weights, torch.where(idx >= 0, w, 0.0))
    # the handle's round outlives another routing on the same object, and repeats
    buffer.dispatch(inputs(rank, E, seed=1)[0], topk_idx=inputs(rank, E, seed=1)[1],
                    num_experts=E)
    for _ in range(2):
        combined, _, _ = buffer.combine(given, handle, bias=(b0, b1))
        assert torch.equal(combined, combine_reference(rank, W, E, give_back, (b0, b1)))
    assert len(buffer._objects) == 1  # one shape, one epx object


def test_combine_in_v2_order_with_bias_and_weights(monkeypatch):
    run_ranks(monkeypatch, 3, scenario_combine)


def scenario_fp8(buffer, rank, W=2, E=6):
    x, idx, w = inputs(rank, E)
    rows = normal.expected_rows(rank, W, E)
    for tma in (False, True):
        (rx, rs), _, _, handle, _ = buffer.dispatch(normal.fp8_of(x), topk_idx=idx,
                                                    topk_weights=w, num_experts=E,
                                                    use_tma_aligned_col_major_sf=tma)
        m = len(rows)
        assert rx.dtype == torch.float8_e4m3fn and rs.shape == (m, H // 128)
        assert rs.stride() == ((1, -(-m // 4) * 4) if tma else (H // 128, 1))
        for j, (q, n) in enumerate(rows):
            qx, qs = normal.fp8_of(inputs(q, E)[0])
            assert torch.equal(rx[j].view(torch.uint8), qx[n].view(torch.uint8))
            assert torch.equal(rs[j], qs[n])
    # the handle of an fp8 dispatch serves a bf16 cached dispatch (another epx object)
    bf16 = buffer.dispatch(x, handle=handle)[0]
    assert torch.equal(bf16, torch.stack([inputs(q, E)[0][n] for q, n in rows]))
    assert len(buffer._objects) == 2
    combined, _, _ = buffer.combine(bf16, handle)
    assert torch.equal(combined, combine_reference(rank, W, E, lambda q, j, row: row))


def test_fp8_rows_and_tma_aligned_scales(monkeypatch):
    run_ranks(monkeypatch, 2, scenario_fp8)


# ---- expand mode --------------------------------------------------------------------------------


def expected_expand(rank, W, E, alignment, seed=0):
    """The expand layout of `rank`'s rows, in our words: the (row, slot) pairs whose expert is
    here, grouped by local expert (rows in received order, slots ascending within a row); expert
    e's group starts where the groups before it end, each group's length rounded up to the
    alignment. Returns (rows, {(row, slot): expanded row}, [first row of each expert], [pairs of
    each expert], total expanded rows)."""
    rows = normal.expected_rows(rank, W, E, seed)
    L = E // W
    groups = [[] for _ in range(L)]
    for j, (q, n) in enumerate(rows):
        for k, e in enumerate(inputs(q, E, seed)[1][n].tolist()):
            if rank * L <= e < (rank + 1) * L:
                groups[e - rank * L].append((j, k))
    where, starts, at = {}, [], 0
    for group in groups:
        starts.append(at)
        where.update({pair: at + i for i, pair in enumerate(group)})
        at += -(-len(group) // alignment) * alignment
    return rows, where, starts, [len(g) for g in groups], at


def check_expand(rank, W, E, out, alignment, synced=True, zeroed=False):
    """An expand dispatch's rows, weights and handle (with the host read unless not `synced`:
    then every output has the worst-case size and only the rows' pairs are compared)."""
    recv_x, recv_idx, recv_w, h, _ = out
    rows, where, starts, counts, total = expected_expand(rank, W, E, alignment)
    L, K = E // W, TOPK
    size = total if synced else h.num_expanded_tokens
    assert recv_idx is None and h.do_expand
    assert recv_x.shape == (size, H) and recv_w.shape == (size,) and recv_w.dtype == torch.float32
    assert h.num_expanded_tokens == (total if synced else
                                     -(-(W * T_MAX * min(K, L) + (alignment - 1) * L)
                                       // alignment) * alignment)
    for (j, k), p in where.items():
        q, n = rows[j]
        xq, _, wq = inputs(q, E)
        assert torch.equal(recv_x[p], xq[n]) and recv_w[p] == wq[n, k]
    padding = torch.ones(size, dtype=torch.bool)
    padding[list(where.values())] = False
    if zeroed:
        assert (recv_x[padding.to(DEVICE)] == 0).all() and (recv_w[padding.to(DEVICE)] == 0).all()
    assert h.psum_num_recv_tokens_per_expert.dtype == torch.int32
    assert h.psum_num_recv_tokens_per_expert.tolist() == [s + c for s, c in zip(starts, counts)]
    assert h.num_unaligned_recv_tokens_per_expert.tolist() == counts
    assert h.num_recv_tokens_per_expert_list == \
        ([-(-c // alignment) * alignment for c in counts] if synced else [])
    assert h.psum_num_recv_tokens_per_scaleup_rank.tolist() == \
        [sum(1 for q, _ in rows if q <= i) for i in range(W)]
    meta = h.recv_src_metadata
    assert meta.shape == (len(rows) if synced else W * T_MAX, K + 2)
    for j, (q, n) in enumerate(rows):
        top = highest_slots(inputs(q, E)[1][n], W, E)[rank]
        assert meta[j].tolist() == [q * T_MAX + n, q * K + top] + \
            [where.get((j, k), -1) for k in range(K)]
    assert (meta[len(rows):] == -1).all()
    return where


def scenario_expand_dispatch(buffer, rank, W=3, E=9):
    x, idx, w = inputs(rank, E)
    L = E // W
    for alignment in (1, 4):
        stats = torch.zeros(L, dtype=torch.int32, device=DEVICE)
        out = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, do_expand=True,
                              expert_alignment=alignment,
                              cumulative_local_expert_recv_stats=stats)
        where = check_expand(rank, W, E, out, alignment)
        recv_x, _, recv_w, handle, _ = out
        assert stats.tolist() == handle.num_unaligned_recv_tokens_per_expert.tolist()
        plain = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                expert_alignment=alignment)[3]
        for name in ("psum_num_recv_tokens_per_scaleup_rank", "dst_buffer_slot_idx"):
            assert torch.equal(getattr(handle, name), getattr(plain, name)), name
        assert torch.equal(handle.recv_src_metadata[:, :2], plain.recv_src_metadata[:, :2])
        # cached: the same rows bit for bit (padding too), the same handle; zeroed padding
        again = buffer.dispatch(x, handle=handle, topk_weights=w, do_expand=True)
        assert again[3] is handle and again[1] is None
        assert torch.equal(again[0], recv_x) and torch.equal(again[2], recv_w)
        assert buffer.dispatch(x, handle=handle, do_expand=True)[2] is None
        zeroed = buffer.dispatch(x, handle=handle, topk_weights=w, do_expand=True,
                                 do_zero_padding=True)
        check_expand(rank, W, E, zeroed, alignment, zeroed=True)
        valid = list(where.values())
        assert torch.equal(zeroed[0][valid], recv_x[valid])
    # no host read: worst-case sizes, the same pairs
    out = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, do_expand=True,
                          expert_alignment=4, do_cpu_sync=False, do_zero_padding=True)
    check_expand(rank, W, E, out, 4, synced=False, zeroed=True)
    # fp8 rows with TMA-aligned column-major scales
    (rx, rs), _, _, handle, _ = buffer.dispatch(
        normal.fp8_of(x), topk_idx=idx, topk_weights=w, num_experts=E, do_expand=True,
        expert_alignment=4, use_tma_aligned_col_major_sf=True)
    rows, where, _, _, total = expected_expand(rank, W, E, 4)
    assert rx.shape == (total, H) and rs.shape == (total, H // 128)
    assert rs.stride() == (1, -(-total // 4) * 4)
    for (j, k), p in where.items():
        qx, qs = normal.fp8_of(inputs(rows[j][0], E)[0])
        assert torch.equal(rx[p].view(torch.uint8), qx[rows[j][1]].view(torch.uint8))
        assert torch.equal(rs[p], qs[rows[j][1]])


def test_expand_dispatch_and_cached(monkeypatch):
    run_ranks(monkeypatch, 3, scenario_expand_dispatch)


def give_slot(k, n, row):
    """What the owner of slot k of token n gives back for it: slot 0 the row times 2^30, slot 1
    times -2^30 (they cancel exactly when added in slot order), slot 2 the row plus (n + 1)/4,
    which survives only when added after both: the order of the f32 sum shows, and so does a
    rank's bf16 partial of slots 0 and 2 (the reduction within a rank)."""
    scale = (2.0 ** 30, -(2.0 ** 30), 1.0)[k % 3]
    return (row.float() * scale + (0 if k % 3 < 2 else (n + 1) / 4)).to(torch.bfloat16)


def expand_combine_reference(rank, W, E, give, biases=(), within_rank=True, order="slot",
                             seed=0):
    """`rank`'s tokens as V2's combine of an expand handle makes them, in our words: a f32 sum
    starts at zero and takes each bias row; with the reduction within ranks, each rank first sums
    the rows it gives back for the token, in slot order, in f32 from zero, rounds that to bf16,
    and the token's sum takes it at the rank's last slot of the token; without it, the sum takes
    every slot's row at its slot. Slots ascending; the result is rounded to bf16 once.
    order='reversed' walks the token's slots descending, order='reversed_within' a rank's
    (what the checks must tell apart)."""
    x, idx, _ = inputs(rank, E, seed)
    out = torch.zeros(x.shape[0], H)
    for n in range(x.shape[0]):
        acc = torch.zeros(H)
        for b in biases:
            acc += b[n].float().cpu()
        owners = owner_ranks(idx[n], W, E)
        last = highest_slots(idx[n], W, E)
        for k in (reversed(range(TOPK)) if order == "reversed" else range(TOPK)):
            q = owners[k]
            if q is None:
                continue
            if not within_rank:
                acc += give(k, n, x[n]).float().cpu()
            elif last[q] == k:
                part = torch.zeros(H)
                for k2 in (reversed(range(TOPK)) if order == "reversed_within" else range(TOPK)):
                    if owners[k2] == q:
                        part += give(k2, n, x[n]).float().cpu()
                acc += part.to(torch.bfloat16).float()
        out[n] = acc
    return out.to(torch.bfloat16).to(DEVICE)


def scenario_expand_combine(buffer, rank, W=3, E=9):
    # seed 10: token 3 of rank 0 has all its experts on one rank (a rank's sum of three rows
    # shows its order; of two it cannot)
    seed = 10
    x, idx, w = inputs(rank, E, seed)
    g = torch.Generator().manual_seed(90 + rank)
    b0, b1 = (torch.randn(x.shape[0], H, generator=g).to(torch.bfloat16).to(DEVICE)
              for _ in range(2))
    # the data tells the orders and the two reductions apart (on some rank's tokens), so the
    # checks below can fail
    refs = [expand_combine_reference(q, W, E, give_slot, seed=seed) for q in range(W)]
    for other in ({"order": "reversed"}, {"order": "reversed_within"}, {"within_rank": False},
                  {"within_rank": False, "order": "reversed"}):
        assert any(not torch.equal(refs[q], expand_combine_reference(q, W, E, give_slot,
                                                                     seed=seed, **other))
                   for q in range(W)), other
    for alignment, synced in ((4, True), (1, False)):
        recv_x, _, recv_w, handle, _ = buffer.dispatch(
            x, topk_idx=idx, topk_weights=w, num_experts=E, do_expand=True,
            expert_alignment=alignment, do_cpu_sync=synced)
        rows, where, _, _, _ = expected_expand(rank, W, E, alignment, seed)
        # padding rows are never read: NaN there would show
        given = torch.full((handle.num_expanded_tokens, H), float("nan"), dtype=torch.bfloat16,
                           device=DEVICE)
        for (j, k), p in where.items():
            given[p] = give_slot(k, rows[j][1], recv_x[p])
        for within_rank in (True, False):
            buffer.allow_multiple_reduction = within_rank
            for bias, biases in ((None, ()), ((b0, b1), (b0, b1))):
                combined, weights, _ = buffer.combine(given, handle, topk_weights=recv_w,
                                                      bias=bias)
                assert torch.equal(combined, expand_combine_reference(
                    rank, W, E, give_slot, biases, within_rank, seed=seed)), (within_rank, biases)
                # each slot's weight from the rank holding its expert, 0 where the id is -1
                assert torch.equal(weights, torch.where(idx >= 0, w, 0.0))
            combined, weights, _ = buffer.combine(given, handle, bias=b0)
            assert weights is None and torch.equal(combined, expand_combine_reference(
                rank, W, E, give_slot, (b0,), within_rank, seed=seed))
    buffer.allow_multiple_reduction = True


def test_expand_combine_with_and_without_reduction_within_ranks(monkeypatch):
    run_ranks(monkeypatch, 3, scenario_expand_combine)


# ---- refusals and checks -----------------------------------------------------------------------


def scenario_refusals(buffer, rank, W=2, E=6):
    import epx.deep_ep as deep_ep

    x, idx, w = inputs(rank, E)
    with pytest.raises(epx.InputError, match="do_zero_padding = True, expected False without "
                                             "do_expand"):
        buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, do_zero_padding=True)
    for name in ("engram_write", "engram_fetch", "pp_send", "pp_recv", "all_gather",
                 "create_agrs_session", "get_pp_buffer_size_hint"):
        with pytest.raises(NotImplementedError, match=f"ElasticBuffer.{name} is not provided"):
            getattr(buffer, name)(None)
    with pytest.raises(NotImplementedError, match="int32"):
        buffer.dispatch((normal.fp8_of(x)[0], torch.zeros(x.shape[0], 2, dtype=torch.int32,
                                                          device=DEVICE)),
                        topk_idx=idx, num_experts=E)
    # what DeepEP asserts, and bad values named with their bound
    with pytest.raises(epx.InputError, match="topk_idx = None"):
        buffer.dispatch(x, num_experts=E)
    with pytest.raises(epx.InputError, match="num_experts = 7, expected a positive multiple"):
        buffer.dispatch(x, topk_idx=idx, num_experts=7)
    with pytest.raises(epx.InputError, match="num_experts = None"):
        buffer.dispatch(x, topk_idx=idx)
    with pytest.raises(epx.InputError, match="expert_alignment = 0, expected an integer >= 1"):
        buffer.dispatch(x, topk_idx=idx, num_experts=E, expert_alignment=0)
    with pytest.raises(epx.InputError, match=r"x.shape\[0\] = 17, expected at most "
                                             r"num_max_tokens_per_rank = 16"):
        buffer.dispatch(torch.zeros(17, H, dtype=torch.bfloat16, device=DEVICE),
                        topk_idx=torch.zeros(17, TOPK, dtype=torch.int64, device=DEVICE),
                        num_experts=E)
    with pytest.raises(epx.InputError, match="num_max_tokens_per_rank = 0"):
        buffer.dispatch(x, topk_idx=idx, num_experts=E, num_max_tokens_per_rank=0)
    with pytest.raises(epx.InputError, match=r"topk_weights.shape"):
        buffer.dispatch(x, topk_idx=idx, topk_weights=w[:, :1].contiguous(), num_experts=E)
    with pytest.raises(epx.InputError, match="cumulative_local_expert_recv_stats.shape"):
        buffer.dispatch(x, topk_idx=idx, num_experts=E,
                        cumulative_local_expert_recv_stats=torch.zeros(
                            E, dtype=torch.int32, device=DEVICE))
    with pytest.raises(epx.InputError, match="allocate_on_comm_stream = True"):
        buffer.dispatch(x, topk_idx=idx, num_experts=E, previous_event=deep_ep.EventOverlap())
    recv_x, _, recv_w, handle, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=w,
                                                   num_experts=E)
    with pytest.raises(epx.InputError, match=r"handle=...\): topk_idx = a tensor"):
        buffer.dispatch(x, handle=handle, topk_idx=idx)
    with pytest.raises(epx.InputError, match="do_cpu_sync = True"):
        buffer.dispatch(x, handle=handle, do_cpu_sync=True)
    with pytest.raises(epx.InputError, match="expert_alignment = 2, expected the handle's 1"):
        buffer.dispatch(x, handle=handle, expert_alignment=2)
    with pytest.raises(epx.InputError, match=r"x.shape\[0\] = 1, expected the handle's"):
        buffer.dispatch(x[:1], handle=handle)
    with pytest.raises(epx.InputError, match="do_expand = True, expected the handle's False"):
        buffer.dispatch(x, handle=handle, do_expand=True)
    _, _, expanded_w, expanded, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=w,
                                                    num_experts=E, do_expand=True)
    with pytest.raises(epx.InputError, match="do_expand = False, expected the handle's True"):
        buffer.dispatch(x, handle=expanded)
    with pytest.raises(epx.InputError, match=r"topk_weights.shape = .*expanded rows"):
        buffer.combine(torch.zeros(expanded.num_expanded_tokens, H, dtype=torch.bfloat16,
                                   device=DEVICE), expanded, topk_weights=recv_w)
    with pytest.raises(epx.InputError, match=r"x.shape = .*expanded rows"):
        buffer.combine(recv_x, expanded, topk_weights=expanded_w)
    # the expand handle's combine, then the handle's round again
    buffer.combine(torch.zeros(expanded.num_expanded_tokens, H, dtype=torch.bfloat16,
                               device=DEVICE), expanded)
    with pytest.raises(epx.InputError, match="expected an EPHandle this buffer's dispatch"):
        buffer.combine(recv_x, deep_ep.EPHandle(False, E, 1, T_MAX, 0, idx, 0, 0, [], *[None] * 5))
    with pytest.raises(epx.InputError, match=r"x.shape = "):
        buffer.combine(recv_x[:-1], handle)
    with pytest.raises(epx.InputError, match=r"topk_weights.shape"):
        buffer.combine(recv_x, handle, topk_weights=recv_w[:, :1].contiguous())
    with pytest.raises(epx.InputError, match=r"bias\[1\].shape"):
        buffer.combine(recv_x, handle, bias=(None, torch.zeros(x.shape[0] + 1, H,
                                                               dtype=torch.bfloat16,
                                                               device=DEVICE)))
    with pytest.raises(epx.InputError, match="bias = 3 tensors"):
        buffer.combine(recv_x, handle, bias=(None, None, None))
    # nothing was sent by the refused calls: the round still combines
    combined, _, _ = buffer.combine(recv_x, handle)
    assert torch.equal(combined, combine_reference(rank, W, E, lambda q, j, row: row))


def test_what_is_not_served_is_refused_by_name(monkeypatch):
    run_ranks(monkeypatch, 2, scenario_refusals)


def test_construction_sizes_and_queries(monkeypatch, tmp_path):
    import epx.deep_ep as deep_ep

    monkeypatch.setattr(deep_ep.ElasticBuffer, "_make_world",
                        staticmethod(lambda group: fake.FakeWorld(fake.Fabric(1), 0)))
    group = fake.FakeGroup(1, 4)
    b = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=64, hidden=H, num_topk=TOPK)
    assert (b.rank_idx, b.num_ranks, b.group) == (1, 4, group)
    assert b.get_logical_domain_size() == (1, 4) == b.get_physical_domain_size()
    assert (b.num_scaleout_ranks, b.num_scaleup_ranks, b.scaleout_rank_idx,
            b.scaleup_rank_idx) == (1, 4, 0, 1)
    hint = deep_ep.ElasticBuffer.get_buffer_size_hint(group, 64, H, TOPK)
    assert b.num_bytes == hint and hint > 0 and hint % (2 << 20) == 0
    more = deep_ep.ElasticBuffer.get_buffer_size_hint(group, 4096, 7168, 8)
    assert more > hint
    assert deep_ep.ElasticBuffer(group, num_bytes=12345).num_bytes == 12345
    assert deep_ep.ElasticBuffer(group).num_bytes == 0  # no shape: epx sizes per shape
    assert b.get_theoretical_num_sms(256, 8) == 16 and b.get_theoretical_num_qps(16) == 0
    path = tmp_path / "launch.json"
    path.write_text('{"dispatch": {"num_blocks": 24}}')
    monkeypatch.setenv("EPX_CONFIG_PATH", str(path))
    assert b.get_theoretical_num_sms(256, 8) == 24
    assert deep_ep.topk_idx_t == torch.int64 and deep_ep.EPHandle is not None
    with pytest.raises(epx.StateError, match="explicitly_destroy = False"):
        b.destroy()
    with pytest.raises(NotImplementedError, match="num_cpu_bytes=4096"):
        deep_ep.ElasticBuffer(group, num_bytes=1 << 30, num_cpu_bytes=4096)
    with pytest.raises(epx.InputError, match="num_max_tokens_per_rank = -1"):
        deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=-1)
    with pytest.raises(epx.InputError, match="num_max_tokens_per_rank = 0, expected an integer "
                                             "in \\[1, "):
        deep_ep.ElasticBuffer.get_buffer_size_hint(group, 0, H)
    gone = deep_ep.ElasticBuffer(group, explicitly_destroy=True)
    gone.destroy()
    with pytest.raises(epx.StateError, match="ElasticBuffer.dispatch: the buffer was destroyed"):
        gone.dispatch(None)
