"""DeepEP's normal (high-throughput) mode of epx.deep_ep.Buffer on the CPU, over the torch model of
epx's core in test_cpu_deep_ep_fake_core (ranks run as threads; the token-major rows of the
model are ordered by (source rank, source index), as high_throughput orders them).

What the mode must do, in our words: get_dispatch_layout counts tokens per rank (once per rank)
and per expert and says which ranks get each token; dispatch delivers each token once to every
rank that holds one of its experts, rows ordered by (source rank, source index), with the
token's top-k ids made local (-1 for experts elsewhere) and their weights (0 elsewhere), the
per-local-expert counts rounded up to expert_alignment, and a handle that sends the same routing
again (a cached dispatch, any wire); num_worst_tokens pads every output to that many rows with
id -1 and reads nothing back; combine sums, at each token's rank, the rows given back by the
ranks that got it (f32, rank order, rounded once), also after the object dispatched another
routing; fp8 rows travel with their scales whatever the scales' strides. Without top-k, dispatch
routes by is_token_in_rank alone and each receiver's per-expert counts are the senders'
num_tokens_per_expert summed; combine also sums the rows' top-k weights per token and starts its
sum from bias rows. What epx's core lacks is refused, naming the argument. Needs torch (skipped
without it); no GPU."""

import functools

import pytest

import epx

torch = pytest.importorskip("torch")

import test_cpu_deep_ep_fake_core as fake  # noqa: E402  (needs torch too)

H = 256  # two 1x128 scale blocks
TOPK = 3
# Where inputs() puts its tensors: the CPU here, the GPU when tests/python/test_gpu_deep_ep_normal.py
# runs the same scenarios on real epx objects.
DEVICE = torch.device("cpu")


def run_ranks(monkeypatch, world_size, body, **buffer_kwargs):
    """body(buffer, rank) on every rank of a Buffer in normal mode, each rank a thread."""
    import epx.deep_ep as deep_ep

    fabric = fake.Fabric(world_size)
    monkeypatch.setattr(deep_ep._normal, "All2All", fake.FakeAll2All)
    monkeypatch.setattr(deep_ep.Buffer, "_make_world",
                        staticmethod(lambda group, comm: fake.FakeWorld(fabric, group.rank())))

    def rank_main(rank):
        buffer = deep_ep.Buffer(fake.FakeGroup(rank, world_size), num_nvl_bytes=1 << 30,
                                explicitly_destroy=True, **buffer_kwargs)
        body(buffer, rank)
        buffer.destroy()

    fake.run_threads(fabric, world_size, rank_main)


def inputs(rank, num_experts, seed=0):
    """Rank `rank`'s tokens: x [N, H] bf16, topk_idx [N, K] int64 (distinct experts, some -1,
    one token routed nowhere), topk_weights [N, K] f32. Every rank can make every rank's."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    n = 5 + 3 * rank
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:TOPK] for _ in range(n)])
    idx[torch.rand(n, TOPK, generator=g) < 0.25] = -1
    idx[n // 2] = -1
    w = torch.randn(n, TOPK, generator=g)
    return x.to(DEVICE), idx.long().to(DEVICE), w.to(DEVICE)


def expected_rows(rank, world_size, num_experts, seed=0):
    """[(source rank, source index)] this rank receives, in order."""
    L = num_experts // world_size
    rows = []
    for q in range(world_size):
        _, idx, _ = inputs(q, num_experts, seed)
        for n in range(idx.shape[0]):
            if any(rank * L <= int(e) < (rank + 1) * L for e in idx[n]):
                rows.append((q, n))
    return rows


def fp8_of(x):
    """(fp8 rows, scales [N, H/128]) of bf16 x, the scales column-major as DeepEP's test makes
    them (x_e4m3[1].T.contiguous().T)."""
    blocks = x.float().view(x.shape[0], -1, 128)
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    q = (blocks * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(x.shape)
    scales = (amax / 448.0).T.contiguous().T
    assert not scales.is_contiguous()
    return q, scales


# ---- get_dispatch_layout ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_dispatch_layout_counts(dtype):
    import epx.deep_ep as deep_ep

    W, E = 3, 9
    b = deep_ep.Buffer(fake.FakeGroup(0, W))  # no NVLink bytes: no world, layout still works
    _, idx, _ = inputs(2, E)
    idx = idx.to(dtype)
    per_rank, per_rdma, per_expert, in_rank, event = b.get_dispatch_layout(idx, E)
    assert per_rdma is None and event.event is None
    L = E // W
    want_in_rank = torch.zeros(idx.shape[0], W, dtype=torch.bool)
    for n in range(idx.shape[0]):
        for e in idx[n].tolist():
            if e >= 0:
                want_in_rank[n, e // L] = True
    assert torch.equal(in_rank, want_in_rank) and in_rank.is_contiguous()
    assert per_rank.dtype == per_expert.dtype == torch.int32
    assert per_rank.tolist() == want_in_rank.sum(0).tolist()
    assert per_expert.tolist() == [int((idx == e).sum()) for e in range(E)]
    with pytest.raises(epx.InputError, match="num_experts = 8"):
        b.get_dispatch_layout(idx, 8)


# ---- dispatch and combine --------------------------------------------------------------------


def dispatch_of(buffer, rank, E, seed=0, x=None, **extra):
    """Rank `rank`'s dispatch of inputs(rank, E, seed) (x replaced when given), with the layout
    of get_dispatch_layout."""
    x0, idx, w = inputs(rank, E, seed)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, E)
    return buffer.dispatch(x0 if x is None else x, num_tokens_per_rank=per_rank,
                           is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                           topk_idx=idx, topk_weights=w, **extra)


def check_dispatch(rank, W, E, out, alignment=1):
    recv_x, recv_idx, recv_w, counts, handle, event = out
    rows = expected_rows(rank, W, E)
    L = E // W
    assert event.event is None
    assert recv_x.shape == (len(rows), H) and recv_x.dtype == torch.bfloat16
    assert recv_idx.dtype == torch.int64 and recv_idx.shape == (len(rows), TOPK)
    for j, (q, n) in enumerate(rows):
        xq, iq, wq = inputs(q, E)
        assert torch.equal(recv_x[j], xq[n])
        local = (iq[n] >= rank * L) & (iq[n] < (rank + 1) * L)
        assert recv_idx[j].tolist() == torch.where(local, iq[n] - rank * L, -1).tolist()
        assert recv_w[j].tolist() == torch.where(local, wq[n], 0.0).tolist()
    # per local expert: rows that use it, rounded up to the alignment
    raw = [int((recv_idx == e).sum()) for e in range(L)]
    assert counts == [-(-c // alignment) * alignment for c in raw]
    rank_prefix, chan, recv_chan, src_idx, in_rank, send_head = handle
    assert chan is None and recv_chan is None and send_head is None
    assert src_idx.tolist() == [n for _, n in rows]
    assert rank_prefix[:, rank].tolist() == [sum(1 for q, _ in rows if q <= i) for i in range(W)]
    assert (rank_prefix[:, [c for c in range(W) if c != rank]] == -1).all()
    return rows


def combine_reference(rank, W, E, give_back, start=None):
    """y of this rank's tokens: sum in f32, in rank order, of give_back(r, j, row) over the
    ranks r that got the token (j: its row there), from `start` (f32 [N, H], else 0), rounded
    once."""
    x, _, _ = inputs(rank, E)
    y = torch.zeros(x.shape[0], H, device=x.device) if start is None else start.clone()
    for r in range(W):
        for j, (q, n) in enumerate(expected_rows(r, W, E)):
            if q == rank:
                y[n] += give_back(r, j, inputs(q, E)[0][n]).float()
    return y.to(torch.bfloat16)


def partial(r, j, row):
    """What rank r gives back for its received row j: a value of its own."""
    return (row.float() * (r + 1) + j).to(torch.bfloat16)


def scenario_dispatch_combine_and_cached(buffer, rank, W, E):
    out = dispatch_of(buffer, rank, E)
    rows = check_dispatch(rank, W, E, out)
    recv_x, _, _, _, handle, _ = out
    # a cached dispatch sends the same routing again: the same rows, nothing else
    again = buffer.dispatch(inputs(rank, E)[0], handle=handle)
    assert again[1:5] == (None, None, None, None) and torch.equal(again[0], recv_x)
    given = torch.stack([partial(rank, j, recv_x[j]) for j in range(len(rows))]) \
        if rows else recv_x
    combined, weights, event = buffer.combine(given, handle)
    assert weights is None and event.event is None
    assert torch.equal(combined, combine_reference(rank, W, E, partial))
    # the handle's round outlives another routing on the same object
    dispatch_of(buffer, rank, E, seed=1)
    combined, _, _ = buffer.combine(given, handle)
    assert torch.equal(combined, combine_reference(rank, W, E, partial))
    # and repeated combines of one round are allowed
    combined, _, _ = buffer.combine(given, handle)
    assert torch.equal(combined, combine_reference(rank, W, E, partial))
    assert len(buffer._objects()) == 1  # one shape, one epx object


@pytest.mark.parametrize("W,E", [(2, 6), (3, 9)])
def test_dispatch_combine_and_cached_dispatch(monkeypatch, W, E):
    run_ranks(monkeypatch, W, functools.partial(scenario_dispatch_combine_and_cached, W=W, E=E))


def scenario_alignment_and_worst_tokens(buffer, rank, W=2, E=6):
    out = dispatch_of(buffer, rank, E, expert_alignment=4)
    check_dispatch(rank, W, E, out, alignment=4)
    recv_x, recv_idx, recv_w = out[:3]
    m = recv_x.shape[0]
    worst = 2 * buffer.max_tokens_per_rank + 3  # more than epx holds: padded rows
    wx, widx, ww, counts, handle, _ = dispatch_of(buffer, rank, E, num_worst_tokens=worst)
    assert counts == []
    assert wx.shape[0] == widx.shape[0] == ww.shape[0] == handle[3].shape[0] == worst
    assert torch.equal(wx[:m], recv_x) and torch.equal(widx[:m], recv_idx)
    assert torch.equal(ww[:m], recv_w)
    assert (widx[m:] == -1).all() and (ww[m:] == 0).all()
    # combine takes the padded rows (those past M are not read)
    given = torch.cat([wx[:m], torch.full((worst - m, H), float("nan"),
                                          dtype=torch.bfloat16, device=DEVICE)])
    combined, _, _ = buffer.combine(given, handle)
    assert torch.equal(combined, combine_reference(rank, W, E, lambda r, j, row: row))


def test_expert_alignment_and_worst_tokens(monkeypatch):
    run_ranks(monkeypatch, 2, scenario_alignment_and_worst_tokens, max_tokens_per_rank=16)


def scenario_fp8_strided_scales(buffer, rank, W=2, E=6):
    x, _, _ = inputs(rank, E)
    out = dispatch_of(buffer, rank, E, x=fp8_of(x))
    (rx, rs), recv_idx, _, _, handle, _ = out
    rows = expected_rows(rank, W, E)
    assert rx.dtype == torch.float8_e4m3fn and rs.dtype == torch.float32
    assert rs.shape == (len(rows), H // 128) and rs.is_contiguous()
    for j, (q, n) in enumerate(rows):
        qx, qs = fp8_of(inputs(q, E)[0])
        assert torch.equal(rx[j].view(torch.uint8), qx[n].view(torch.uint8))
        assert torch.equal(rs[j], qs[n])
    # the handle of an fp8 dispatch serves a bf16 cached dispatch (another epx object)
    bf16 = buffer.dispatch(x, handle=handle)[0]
    assert torch.equal(bf16, torch.stack([inputs(q, E)[0][n] for q, n in rows]))
    # and an fp8 cached dispatch of a bf16 handle
    h = dispatch_of(buffer, rank, E)[4]
    (cx, cs), *_ = buffer.dispatch(fp8_of(x), handle=h)
    assert torch.equal(cx.view(torch.uint8), rx.view(torch.uint8)) and torch.equal(cs, rs)
    assert len(buffer._objects()) == 2  # one object per wire
    combined, _, _ = buffer.combine(bf16, handle)
    assert torch.equal(combined, combine_reference(rank, W, E, lambda r, j, row: row))


def test_fp8_rows_with_strided_scales(monkeypatch):
    run_ranks(monkeypatch, 2, scenario_fp8_strided_scales)


def scenario_without_topk_and_extras(buffer, rank, W=3, E=9):
    L = E // W
    x, idx, w = inputs(rank, E)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, E)
    rows = expected_rows(rank, W, E)
    # Without top-k: routed by is_token_in_rank, the senders' expert counts summed.
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, expert_alignment=2)
    assert recv_idx is None and recv_w is None
    assert torch.equal(recv_x, torch.stack([inputs(q, E)[0][n] for q, n in rows]))
    every = sum(buffer.get_dispatch_layout(inputs(q, E)[1], E)[2] for q in range(W))
    assert counts == [-(-c // 2) * 2 for c in every[rank * L:(rank + 1) * L].tolist()]
    again = buffer.dispatch(x, handle=handle)[0]  # the same routing, cached
    assert torch.equal(again, recv_x)
    # combine starts each token's f32 sum from the bias rows, rounding once
    g = torch.Generator().manual_seed(50 + rank)
    b0 = torch.randn(x.shape[0], H, generator=g).to(torch.bfloat16).to(DEVICE)
    b1 = torch.randn(x.shape[0], H, generator=g).to(torch.bfloat16).to(DEVICE)
    given = torch.stack([partial(rank, j, recv_x[j]) for j in range(len(rows))])
    combined, weights, _ = buffer.combine(given, handle, bias=(b0, b1))
    want = combine_reference(rank, W, E, partial, start=b0.float() + b1.float())
    assert weights is None and torch.equal(combined, want)
    with pytest.raises(epx.InputError, match="topk_weights = a tensor, expected None"):
        buffer.combine(given, handle, topk_weights=torch.zeros(len(rows), 1, device=DEVICE))
    # With top-k: combine sums the rows' weights back (each rank kept its own experts'), so
    # every token gets its own weights where it has an expert.
    recv_x, recv_idx, recv_w, _, handle, _ = dispatch_of(buffer, rank, E)
    combined, weights, _ = buffer.combine(recv_x, handle, topk_weights=recv_w, bias=b0)
    assert torch.equal(weights, torch.where(idx >= 0, w, 0.0))
    assert torch.equal(combined, combine_reference(rank, W, E, lambda r, j, row: row,
                                                   start=b0.float()))


def test_dispatch_without_topk_and_combine_extras(monkeypatch):
    run_ranks(monkeypatch, 3, scenario_without_topk_and_extras)


# ---- refusals and checks ---------------------------------------------------------------------


def scenario_refusals(buffer, rank, W=2, E=6):
    x, idx, w = inputs(rank, E)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, E)
    with pytest.raises(epx.InputError, match="topk_weights = None, expected topk_idx"):
        buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, topk_idx=idx)
    with pytest.raises(NotImplementedError, match="int32"):
        buffer.dispatch((fp8_of(x)[0], torch.zeros(x.shape[0], 1, dtype=torch.int32,
                                                   device=DEVICE)),
                        num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    recv_x, _, recv_w, _, handle, _ = dispatch_of(buffer, rank, E)
    with pytest.raises(epx.InputError, match=r"topk_weights.shape"):
        buffer.combine(recv_x, handle, topk_weights=recv_w[:, :1].contiguous())
    with pytest.raises(epx.InputError, match=r"bias\[0\].shape"):
        buffer.combine(recv_x, handle,
                       bias=torch.zeros(x.shape[0] + 1, H, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(NotImplementedError, match="internode_dispatch"):
        buffer.internode_dispatch(x)
    with pytest.raises(NotImplementedError, match="internode_combine"):
        buffer.internode_combine(x, handle)
    # what DeepEP asserts
    with pytest.raises(epx.InputError, match="handle=...\\): topk_idx"):
        buffer.dispatch(x, handle=handle, topk_idx=idx)
    with pytest.raises(epx.InputError, match="is_token_in_rank = None"):
        buffer.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert,
                        topk_idx=idx, topk_weights=w)
    with pytest.raises(epx.InputError, match="x.shape\\[0\\] = 17"):
        buffer.dispatch(torch.zeros(17, H, dtype=torch.bfloat16, device=DEVICE), handle=handle)
    with pytest.raises(epx.InputError, match="x.shape = "):
        buffer.combine(recv_x[:-1], handle)
    # combine and the layout combine took nothing from a round that was not made
    combined, _, _ = buffer.combine(recv_x, handle)
    assert combined.shape == x.shape
    # a layout that is not topk_idx's: found after the (collective) dispatch
    wrong = per_rank.clone()
    wrong[0] += 1
    with pytest.raises(epx.InputError, match="differ from get_dispatch_layout"):
        buffer.dispatch(x, num_tokens_per_rank=wrong, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)


def test_missing_core_pieces_are_refused_by_name(monkeypatch):
    run_ranks(monkeypatch, 2, scenario_refusals, max_tokens_per_rank=16)


def test_config_and_buffer_without_nvl_bytes():
    import epx.deep_ep as deep_ep

    c = deep_ep.Config(24, 8, 256)
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == \
        (24, 8, 256, 6, 258)  # DeepEP rounds the RDMA receive size up to the send size
    assert c.get_nvl_buffer_size_hint(7168 * 2, 8) > 0 and c.get_rdma_buffer_size_hint(1, 8) == 0
    with pytest.raises(epx.InputError, match="num_max_nvl_chunked_send_tokens = 256"):
        deep_ep.Config(20, 256, 256)
    old = deep_ep.Buffer.num_sms
    try:
        deep_ep.Buffer.set_num_sms(32)
        for fn in (deep_ep.Buffer.get_dispatch_config, deep_ep.Buffer.get_combine_config):
            assert isinstance(fn(8), deep_ep.Config) and fn(8).num_sms == 32
    finally:
        deep_ep.Buffer.num_sms = old
    b = deep_ep.Buffer(fake.FakeGroup(0, 2))
    x, idx, w = inputs(0, 6)
    with pytest.raises(epx.ConfigError, match="num_nvl_bytes = 0, expected > 0"):
        b.dispatch(x, topk_idx=idx, topk_weights=w)
    with pytest.raises(epx.ConfigError, match="max_tokens_per_rank = 0"):
        deep_ep.Buffer(fake.FakeGroup(0, 2), max_tokens_per_rank=0)


def test_max_tokens_from_the_environment(monkeypatch):
    import epx.deep_ep as deep_ep

    monkeypatch.setenv("EPX_DEEP_EP_MAX_TOKENS", "96")
    assert deep_ep.Buffer(fake.FakeGroup(0, 2)).max_tokens_per_rank == 96
    assert deep_ep.Buffer(fake.FakeGroup(0, 2), max_tokens_per_rank=8).max_tokens_per_rank == 8
    monkeypatch.setenv("EPX_DEEP_EP_MAX_TOKENS", "many")
    with pytest.raises(epx.ConfigError, match="EPX_DEEP_EP_MAX_TOKENS = 'many'"):
        deep_ep.Buffer(fake.FakeGroup(0, 2))
