"""dispatch/combine on torch tensors, in-process ranks on one GPU, against the torch reference
(ref.py): every dtype and layout, CUDA-graph replays, torch.compile, bad tensors.

Ranks that share a GPU spin on each other, so every rank's dispatch is enqueued (each on its own
stream) before any expert stage, and every expert stage before any combine; the expert kernels
run once before the first round so that none loads while peers spin.
"""

import pytest

import epx
import ref

DTYPES = ["bf16", "fp8", "bf16-to-fp8"]
LAYOUTS = ["token", "expert"]


def small_config(**kw):
    base = dict(hidden=1024, num_experts=16, topk=4, max_tokens_per_rank=64, timeout_ms=5000)
    base.update(kw)
    return epx.EpConfig(**base)


class Ranks:
    """An in-process world of W ranks on one GPU, one stream each."""

    def __init__(self, cfg, world_size, backend="low_latency"):
        import torch

        self.torch = torch
        self.cfg = cfg.replace(world_size=world_size)
        self.world = epx.InProcessWorld(world_size)
        self.group = epx.make_group(self.cfg, self.world, backend)
        self.streams = [torch.cuda.Stream() for _ in range(world_size)]
        self.backend = backend

    def expert_stage(self, r, d):
        a = self.group[r]
        c = a.config
        if c.layout == "token":
            a.combine_buffer().copy_(ref.token_partials(
                c, r, d.recv_x, d.recv_scales, d.recv_topk_ids, d.recv_topk_weights))
        else:
            a.combine_buffer().copy_(ref.expert_outputs(c, r, d.expert_x, d.expert_scales))

    def round(self, inputs, outs=None):
        """One eager round; returns (dispatch outputs, y per rank)."""
        torch = self.torch
        main = torch.cuda.current_stream()
        for s in self.streams:
            s.wait_stream(main)
        ds = []
        for r, a in enumerate(self.group):
            x, ids, w, sc = inputs[r]
            with torch.cuda.stream(self.streams[r]):
                ds.append(a.dispatch(x, ids, w, sc))
        for r in range(len(self.group)):
            with torch.cuda.stream(self.streams[r]):
                self.expert_stage(r, ds[r])
        ys = []
        for r, a in enumerate(self.group):
            with torch.cuda.stream(self.streams[r]):
                ys.append(a.combine(a.combine_buffer(), out=None if outs is None else outs[r]))
        for s in self.streams:
            main.wait_stream(s)
        for a in self.group:
            a.synchronize()
        return ds, ys

    def warm_up_experts(self, device):
        # The expert stage's kernels load here, before any rank spins.
        torch = self.torch
        for r, a in enumerate(self.group):
            c = a.config
            cap, H, K, L = c.capacity, c.hidden, c.topk, c.num_local_experts
            x = torch.zeros(cap, H, dtype=torch.bfloat16, device=device)
            if c.wire_fp8:
                q, s = ref.quantize(x)
                ref.token_partials(c, r, q, s, torch.zeros(cap, K, dtype=torch.int32,
                                                            device=device),
                                   torch.zeros(cap, K, device=device))
                ref.expert_outputs(c, r, q.expand(L, cap, H).contiguous(),
                                   s.expand(L, cap, H // 128).contiguous())
            ref.token_partials(c, r, x, None, torch.zeros(cap, K, dtype=torch.int32,
                                                          device=device),
                               torch.zeros(cap, K, device=device))
            ref.expert_outputs(c, r, x.expand(L, cap, H).contiguous(), None)
            a.combine_buffer().zero_()
            ref.quantize(torch.ones(2, H, dtype=torch.bfloat16, device=device))
        torch.cuda.synchronize()


def check_dispatch(rk, inputs, ds):
    """Every rank received exactly the rows the contract says, compared order-insensitively."""
    torch = rk.torch
    cfg = rk.cfg
    every = rk.backend in ("naive", "allgather_reducescatter")  # every token to every rank
    for r, d in enumerate(ds):
        c = rk.group[r].config
        want = ref.expected_rows(cfg, inputs, r, every)
        m = int(d.recv_count.item())
        assert m == len(want), f"rank {r}: recv_count {m}, expected {len(want)}"
        src_rank, src_idx = d.recv_src_rank[:m].tolist(), d.recv_src_idx[:m].tolist()
        got = list(zip(src_rank, src_idx))
        if c.deterministic or rk.backend == "high_throughput":
            assert got == want, f"rank {r}: rows not in (source rank, source index) order"
        assert sorted(got) == want
        fields = ["recv_x", "recv_topk_ids", "recv_topk_weights"]
        if c.wire_fp8:
            fields.append("recv_scales")
        rows = dict(zip(fields, epx.sort_rows(d, fields)))
        for j, (q, i) in enumerate(want):
            x, ids, w, sc = inputs[q]
            wx, ws = ref.wire_rows(cfg, x[i:i + 1], None if sc is None else sc[i:i + 1])
            got_x = rows["recv_x"][j]
            want_x = wx[0].view(torch.uint8) if c.wire_fp8 else wx[0]
            assert torch.equal(got_x, want_x), f"rank {r} row {(q, i)}: x differs"
            if c.wire_fp8:
                assert torch.equal(rows["recv_scales"][j], ws[0]), f"rank {r}: scales differ"
            assert torch.equal(rows["recv_topk_ids"][j], ids[i].int())
            assert torch.equal(rows["recv_topk_weights"][j], w[i])
        L = c.num_local_experts
        counts = torch.zeros(L, dtype=torch.int32)
        for (q, i) in want:
            for e in inputs[q][1][i].tolist():
                if r * L <= e < (r + 1) * L:
                    counts[e - r * L] += 1
        assert torch.equal(d.expert_counts.cpu(), counts), f"rank {r}: expert_counts"
        if c.layout == "expert":
            for e in range(L):
                n_e = int(counts[e])
                pairs = sorted(zip(d.expert_src_rank[e, :n_e].tolist(),
                                   d.expert_src_idx[e, :n_e].tolist()))
                ge = r * L + e
                assert pairs == [(q, i) for (q, i) in want
                                 if ge in inputs[q][1][i].tolist()], f"rank {r} expert {e}"


def check_combine(rk, inputs, ys):
    torch = rk.torch
    for r, y in enumerate(ys):
        x, ids, w, sc = inputs[r]
        want = ref.combined(rk.cfg, x, ids, w, sc)
        torch.testing.assert_close(y.float(), want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_every_dtype_and_layout(gpu, dtype, layout):
    rk = Ranks(small_config(dtype=dtype, layout=layout), 2)
    rk.warm_up_experts(gpu)
    for seed, counts in enumerate([(64, 7), (0, 33), (1, 64)]):
        inputs = [ref.make_inputs(rk.cfg, r, counts[r], seed, gpu) for r in range(2)]
        ds, ys = rk.round(inputs)
        check_dispatch(rk, inputs, ds)
        check_combine(rk, inputs, ys)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_push_combine_equals_pull(gpu, layout):
    """combine='push' (each rank writes its partials into the token's rank) gives the bits of
    combine='pull' on the same inputs."""
    W = 3
    pull = Ranks(small_config(dtype="bf16-to-fp8", layout=layout, num_experts=24), W)
    push = Ranks(small_config(dtype="bf16-to-fp8", layout=layout, num_experts=24,
                              combine="push"), W)
    pull.warm_up_experts(gpu)
    push.warm_up_experts(gpu)
    for seed, counts in enumerate([(64, 0, 7), (1, 64, 33)]):
        inputs = [ref.make_inputs(pull.cfg, r, counts[r], seed, gpu) for r in range(W)]
        _, y_pull = pull.round(inputs)
        ds, y_push = push.round(inputs)
        check_dispatch(push, inputs, ds)
        check_combine(push, inputs, y_push)
        for a, b in zip(y_pull, y_push):
            assert pull.torch.equal(a, b)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_halves_on_one_stream_equal_the_whole_ops(gpu, layout):
    """Every rank's send half, then every rank's receive half, all on one stream: a send half
    never waits (else this would time out), and the results are those of the whole ops."""
    import torch

    rk = Ranks(small_config(dtype="bf16-to-fp8", layout=layout), 4)
    rk.warm_up_experts(gpu)
    inputs = [ref.make_inputs(rk.cfg, r, n, 5, gpu) for r, n in enumerate((64, 0, 17, 33))]
    _, whole = rk.round(inputs)
    whole = [y.clone() for y in whole]
    for r, a in enumerate(rk.group):
        a.dispatch_send(*inputs[r][:3], inputs[r][3])
    ds = [a.dispatch_recv() for a in rk.group]
    check_dispatch(rk, inputs, ds)
    for r in range(len(rk.group)):
        rk.expert_stage(r, ds[r])
    for a in rk.group:
        a.combine_send(a.combine_buffer())
    ys = [a.combine_recv() for a in rk.group]
    for a in rk.group:
        a.synchronize()
    for r in range(len(rk.group)):
        assert torch.equal(ys[r], whole[r]), f"rank {r}: halves differ from the whole ops"
    with pytest.raises(epx.StateError, match="dispatch_send"):
        rk.group[0].dispatch_recv()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_rounds_in_flight(gpu, layout):
    """rounds_in_flight=2: every rank dispatches round A, then round B, before combining A then
    B (each rank on its own stream); both rounds equal the torch reference."""
    import torch

    rk = Ranks(small_config(dtype="bf16-to-fp8", layout=layout, rounds_in_flight=2), 4)
    rk.warm_up_experts(gpu)
    rounds = [[ref.make_inputs(rk.cfg, r, n, seed, gpu) for r, n in enumerate((64, 0, 17, 33))]
              for seed in (7, 8)]
    main = torch.cuda.current_stream()
    for st in rk.streams:
        st.wait_stream(main)
    ds = [[], []]
    for r, a in enumerate(rk.group):
        with torch.cuda.stream(rk.streams[r]):
            for k in range(2):
                x, ids, w, sc = rounds[k][r]
                ds[k].append(a.dispatch(x, ids, w, sc))
    ys = [[], []]
    for k in range(2):
        for r, a in enumerate(rk.group):
            with torch.cuda.stream(rk.streams[r]):
                rk.expert_stage(r, ds[k][r])  # combine_buffer(): the oldest due round's
                ys[k].append(a.combine(a.combine_buffer()))
    for st in rk.streams:
        main.wait_stream(st)
    for a in rk.group:
        a.synchronize()
    for k in range(2):
        check_dispatch(rk, rounds[k], ds[k])
        check_combine(rk, rounds[k], ys[k])


@pytest.mark.parametrize("backend", ["naive", "allgather_reducescatter"])
def test_baseline_backends(gpu, backend):
    rk = Ranks(small_config(dtype="bf16", num_experts=24), 3, backend)  # 8 experts a rank
    rk.warm_up_experts(gpu)
    inputs = [ref.make_inputs(rk.cfg, r, n, 1, gpu) for r, n in enumerate((5, 0, 64))]
    ds, ys = rk.round(inputs)
    check_dispatch(rk, inputs, ds)
    check_combine(rk, inputs, ys)


@pytest.mark.parametrize("dtype", ["bf16-to-fp8", "bf16"])
def test_high_throughput_rows_in_order(gpu, dtype):
    # Rows through rings, always ordered; receive areas for the worst case (fixed shapes).
    rk = Ranks(small_config(dtype=dtype, worst_case_output=True), 4, "high_throughput")
    rk.warm_up_experts(gpu)
    for seed in (1, 2):
        inputs = [ref.make_inputs(rk.cfg, r, n, seed, gpu) for r, n in enumerate((64, 0, 7, 33))]
        ds, ys = rk.round(inputs)
        check_dispatch(rk, inputs, ds)  # in (source rank, source index) order
        check_combine(rk, inputs, ys)


def test_deterministic_order_and_int64_ids(gpu):
    import torch

    rk = Ranks(small_config(dtype="bf16", deterministic=True), 4)
    rk.warm_up_experts(gpu)
    inputs = [ref.make_inputs(rk.cfg, r, 40, 3, gpu, ids_dtype=torch.int64) for r in range(4)]
    ds, ys = rk.round(inputs)
    check_dispatch(rk, inputs, ds)  # checks (source rank, source index) order when deterministic
    check_combine(rk, inputs, ys)


def test_views_are_epx_memory_and_out_is_written(gpu):
    import torch

    rk = Ranks(small_config(dtype="bf16-to-fp8"), 2)
    rk.warm_up_experts(gpu)
    inputs = [ref.make_inputs(rk.cfg, r, 16, 5, gpu) for r in range(2)]
    outs = [torch.empty(16, rk.cfg.hidden, dtype=torch.bfloat16, device=gpu) for _ in range(2)]
    ds, ys = rk.round(inputs, outs)
    assert all(y is o for y, o in zip(ys, outs))
    d = ds[0]
    assert d.recv_x.dtype == torch.float8_e4m3fn and d.recv_x.shape == (rk.cfg.capacity, 1024)
    assert d.recv_scales.shape == (rk.cfg.capacity, 8)
    ds2, _ = rk.round(inputs)
    assert ds2[0].recv_x.data_ptr() == d.recv_x.data_ptr()  # the same memory every round
    check_combine(rk, inputs, ys)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_graph_replays_with_fresh_inputs(gpu, layout):
    """1000 replays of captured rounds, fresh inputs copied in before each, equal to the torch
    reference every time and bit-equal to an eager round on the same inputs every 100th."""
    import torch

    W, n = 2, 32
    rk = Ranks(small_config(dtype="bf16-to-fp8", layout=layout), W)
    rk.warm_up_experts(gpu)
    static = [ref.make_inputs(rk.cfg, r, n, 0, gpu) for r in range(W)]
    rk.round(static)  # eager first: views made, kernels loaded
    ys = [None] * W
    graphs = [torch.cuda.CUDAGraph() for _ in range(W)]
    # Capture only records: each rank's whole round is captured on its own stream in turn.
    for r, a in enumerate(rk.group):
        x, ids, w, sc = static[r]
        with torch.cuda.graph(graphs[r], stream=rk.streams[r]):
            d = a.dispatch(x, ids, w, sc)
            rk.expert_stage(r, d)
            ys[r] = a.combine(a.combine_buffer())
    main = torch.cuda.current_stream()
    for it in range(1000):
        fresh = [ref.make_inputs(rk.cfg, r, n, 100 + it, gpu) for r in range(W)]
        for r in range(W):
            for dst, src in zip(static[r][:3], fresh[r][:3]):
                dst.copy_(src)
        for s in rk.streams:
            s.wait_stream(main)
        for r in range(W):
            with torch.cuda.stream(rk.streams[r]):
                graphs[r].replay()
        for s in rk.streams:
            main.wait_stream(s)
        check_combine(rk, fresh, ys)
        if it % 100 == 0:
            replayed = [y.clone() for y in ys]
            _, eager = rk.round(fresh)
            for r in range(W):
                assert torch.equal(eager[r], replayed[r]), f"replay {it} rank {r} != eager"
    for a in rk.group:
        a.synchronize()


def test_torch_compile_fullgraph(gpu):
    """A compiled dispatch -> expert -> combine (one rank: the compiler's kernels load while
    nothing spins), equal to eager; the custom ops show in the graph."""
    import torch

    cfg = small_config(dtype="bf16-to-fp8", world_size=1)
    world = epx.InProcessWorld(1)
    (a,) = epx.make_group(cfg, world)

    def step(x, ids, w):
        d = a.dispatch(x, ids, w)
        buf = a.combine_buffer()
        buf.copy_(ref.token_partials(a.config, 0, d.recv_x, d.recv_scales, d.recv_topk_ids,
                                     d.recv_topk_weights))
        return a.combine(buf)

    compiled = torch.compile(step, fullgraph=True)
    for seed in range(3):
        x, ids, w, _ = ref.make_inputs(cfg, 0, 48, seed, gpu)
        y_c = compiled(x, ids, w)
        y_e = step(x, ids, w)
        a.synchronize()
        # The compiler may fuse the expert stage's f32 sums in another order: not bit-equal.
        torch.testing.assert_close(y_c, y_e, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(y_c.float(), ref.combined(cfg, x, ids, w, None),
                                   rtol=3e-2, atol=3e-2)
    # The ops themselves, traced with fake tensors.
    x, ids, w, _ = ref.make_inputs(cfg, 0, 8, 9, gpu)
    outs = torch.library.opcheck(torch.ops.epx.dispatch.default, (a.handle, x, ids, w, None),
                                 test_utils=("test_schema", "test_faketensor"))
    assert outs is not None
    a.synchronize()


@pytest.mark.parametrize(
    "change, name",
    [
        (lambda t, x, ids, w: (x.half(), ids, w), "x.dtype"),
        (lambda t, x, ids, w: (x.cpu(), ids, w), "x.device"),
        (lambda t, x, ids, w: (x[:, :512], ids, w), "x.shape"),
        (lambda t, x, ids, w: (t.cat([x, x], 1)[:, ::2], ids, w), "x.stride"),
        (lambda t, x, ids, w: (x, ids.t().contiguous().t(), w), "topk_ids.stride"),
        (lambda t, x, ids, w: (x, ids.short(), w), "topk_ids.dtype"),
        (lambda t, x, ids, w: (x, ids[:, :2].contiguous(), w), "topk_ids.shape"),
        (lambda t, x, ids, w: (x, ids, w.double()), "topk_weights.dtype"),
        (lambda t, x, ids, w: (x, ids, w[:-1]), "topk_weights.shape"),
        (lambda t, x, ids, w: (t.cat([x] * 9), t.cat([ids] * 9), t.cat([w] * 9)), "x.shape[0]"),
    ],
)
def test_bad_tensors_are_refused_by_name(gpu, change, name):
    import torch

    cfg = small_config(dtype="bf16", world_size=1)
    (a,) = epx.make_group(cfg, epx.InProcessWorld(1))
    x, ids, w, _ = ref.make_inputs(cfg, 0, 8, 0, gpu)
    bx, bids, bw = change(torch, x, ids, w)
    with pytest.raises(epx.InputError, match=name.replace("[", r"\[").replace("]", r"\]")):
        a.dispatch(bx, bids, bw)
    with pytest.raises(epx.InputError, match="x_scales"):
        a.dispatch(x, ids, w, x_scales=torch.ones(8, 8, device=gpu))
    # Nothing was launched: a good round still works.
    d = a.dispatch(x, ids, w)
    with pytest.raises(epx.InputError, match="expert_out.shape"):
        a.combine(a.combine_buffer()[:8])
    with pytest.raises(epx.InputError, match="out.shape"):
        a.combine(a.combine_buffer(), out=torch.empty(3, cfg.hidden, dtype=torch.bfloat16,
                                                      device=gpu))
    a.combine_buffer().copy_(ref.token_partials(cfg, 0, d.recv_x, None, d.recv_topk_ids,
                                                d.recv_topk_weights))
    y = a.combine(a.combine_buffer())
    a.synchronize()
    torch.testing.assert_close(y.float(), ref.combined(cfg, x, ids, w, None), rtol=3e-2,
                               atol=3e-2)


def test_fp8_input_needs_scales(gpu):
    cfg = small_config(dtype="fp8", world_size=1)
    (a,) = epx.make_group(cfg, epx.InProcessWorld(1))
    x, ids, w, sc = ref.make_inputs(cfg, 0, 4, 0, gpu)
    with pytest.raises(epx.InputError, match="x_scales = None"):
        a.dispatch(x, ids, w)
    with pytest.raises(epx.InputError, match="x_scales.shape"):
        a.dispatch(x, ids, w, sc[:, :3].contiguous())
    with pytest.raises(epx.InputError, match="x.dtype"):
        a.dispatch(x.float().bfloat16(), ids, w, sc)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_rank_that_stops_calling_is_masked(gpu, layout):
    """mask_failed_ranks: rank 1 of 2 never calls. Rank 0's first round masks it once its waits
    outlive timeout_ms and completes without it; the second skips it from the start and counts
    the (token, expert) pairs routed to its experts as dropped. Rank 0 receives only its own
    rows, and y sums only rank 0's experts. clear_mask() unmasks and zeroes the count."""
    import time

    import torch

    timeout_ms = 300
    rk = Ranks(small_config(dtype="bf16", layout=layout, mask_failed_ranks=True,
                            timeout_ms=timeout_ms), 2)
    rk.warm_up_experts(gpu)
    a, gone = rk.group
    assert (a.masked_ranks, a.dropped_pairs, a.masked_rank_list()) == (0, 0, [])
    L = a.config.num_local_experts
    inputs = [ref.make_inputs(rk.cfg, r, n, 11, gpu) for r, n in enumerate((40, 0))]
    x, ids, w, _ = inputs[0]
    to_gone = int((ids >= L).sum())  # rank 1 holds experts [L, 2L)
    assert to_gone > 0
    live_ids = torch.where(ids >= L, torch.full_like(ids, -1), ids)
    elapsed = []
    for rnd in range(2):
        start = time.monotonic()
        d = a.dispatch(x, ids, w)
        rk.expert_stage(0, d)
        y = a.combine(a.combine_buffer())
        a.synchronize()
        elapsed.append(time.monotonic() - start)
        assert a.masked_ranks == 1 << 1, f"round {rnd}: masked_ranks = {a.masked_ranks:#x}"
        assert a.masked_rank_list() == [1]
        # Round 0 masked rank 1 while waiting for it: its dispatch had sent before that.
        assert a.dropped_pairs == (0 if rnd == 0 else to_gone), f"round {rnd}"
        check_dispatch(rk, inputs, [d])  # rank 1 "had" no tokens: only rank 0's rows
        torch.testing.assert_close(y.float(), ref.combined(rk.cfg, x, live_ids, w, None),
                                   rtol=3e-2, atol=3e-2)
    assert elapsed[0] >= 0.9 * timeout_ms / 1000, elapsed
    assert elapsed[1] < timeout_ms / 1000, f"round 1 waited for the masked rank: {elapsed}"
    assert (gone.masked_ranks, gone.dropped_pairs) == (0, 0)  # it never ran a kernel
    a.clear_mask()
    assert (a.masked_ranks, a.dropped_pairs, a.masked_rank_list()) == (0, 0, [])
    a.synchronize()
    assert (a.masked_ranks, a.dropped_pairs) == (0, 0)


def test_high_throughput_by_rank_and_combine_extras(gpu):
    # Rank 1 routes by a rank mask with its own per-expert counts (DeepEP's dispatch without
    # top-k) while its peers route by ids; combine sums each row's top-k weights back per token
    # and starts from bias rows. Rows ordered, sums in f32 in rank order: exact equality.
    import torch

    W = 3  # (24 experts: 8 a rank)
    rk = Ranks(small_config(dtype="bf16", worst_case_output=True, num_experts=24), W,
               "high_throughput")
    c = rk.cfg
    L, K, H, cap = c.num_experts // W, c.topk, c.hidden, rk.group[0].config.capacity
    inputs = [ref.make_inputs(c, r, n, 4, gpu) for r, n in enumerate((64, 21, 0))]
    mask_of = lambda ids: torch.stack([((ids >= q * L) & (ids < (q + 1) * L)).any(1)  # noqa
                                       for q in range(W)], 1)
    counts1 = torch.bincount(inputs[1][1][inputs[1][1] >= 0].long(),
                             minlength=c.num_experts).int()
    main = torch.cuda.current_stream()
    for s in rk.streams:
        s.wait_stream(main)
    ds = []
    for r, a in enumerate(rk.group):
        x, ids, w, sc = inputs[r]
        with torch.cuda.stream(rk.streams[r]):
            ds.append(a.dispatch_by_rank(x, mask_of(ids), counts1) if r == 1
                      else a.dispatch(x, ids, w, sc))
    g = torch.Generator(device=gpu).manual_seed(9)
    biases = [torch.randn(inputs[r][0].shape[0], H, device=gpu, generator=g).bfloat16()
              for r in range(W)]
    w_in = [(torch.arange(cap, device=gpu)[:, None] * 0.5 + torch.arange(K, device=gpu)
             + 0.25 * r).float().contiguous() for r in range(W)]
    got = []
    for r, a in enumerate(rk.group):
        with torch.cuda.stream(rk.streams[r]):
            a.combine_buffer().copy_(ds[r].recv_x)
            got.append(a.combine_with(a.combine_buffer(), topk_weights=w_in[r],
                                      bias=(biases[r], None) if r != 2 else None))
    for s in rk.streams:
        main.wait_stream(s)
    for a in rk.group:
        a.synchronize()
    for r, d in enumerate(ds):
        m = int(d.recv_count.item())
        want = ref.expected_rows(c, inputs, r, False)
        assert list(zip(d.recv_src_rank[:m].tolist(), d.recv_src_idx[:m].tolist())) == want
        from_1 = d.recv_src_rank[:m] == 1
        assert (d.recv_topk_ids[:m][from_1] == -1).all()
        assert (d.recv_topk_weights[:m][from_1] == 0).all()
        local = torch.zeros(L, dtype=torch.int32)
        for q in range(W):
            ids = inputs[q][1]
            local += torch.bincount(ids[ids >= 0].long(), minlength=c.num_experts)[
                r * L:(r + 1) * L].int().cpu()
        assert torch.equal(d.expert_counts.cpu(), local), f"rank {r}: expert_counts"
    for s in range(W):
        x = inputs[s][0]
        n = x.shape[0]
        y = biases[s].float().clone() if s != 2 else torch.zeros(n, H, device=gpu)
        yw = torch.zeros(n, K, device=gpu)
        for r, d in enumerate(ds):
            m = int(d.recv_count.item())
            for j in range(m):
                if int(d.recv_src_rank[j]) == s:
                    i = int(d.recv_src_idx[j])
                    y[i] += d.recv_x[j].float()
                    yw[i] += w_in[r][j]
        assert torch.equal(got[s][0], y.bfloat16()), f"rank {s}: y"
        assert torch.equal(got[s][1], yw), f"rank {s}: summed weights"
