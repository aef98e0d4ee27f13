"""epx.deep_ep's own logic on the CPU, over a stand-in for epx's core: the GPU tests' scenarios
(test_gpu_deep_ep.run_scenario, test_gpu_deep_ep_shrink.run_shrink_scenario) on ranks run as
threads, where each All2All is a plain torch model of the contract epx's expert-major and
token-major dispatch and combine keep (DESIGN §4): expert rows ordered by (source rank, source
index) when deterministic, token-major rows in any order otherwise, garbage past the counts,
combine folding the weights carried at dispatch (with combine_format 'logfmt', each rank's
partial of a token rounded to bf16 and sent through ref.logfmt_round_trip), the token-major
combine with extras summing in rank order or, with combine_order 'highest_slot', each rank at
its highest top-k slot of the token, slots ascending (a round routed by a rank mask has no ids
and is refused then); and of masking (mask_failed_ranks): a peer that
has not posted a call's data within timeout_ms is masked, later calls neither wait for it nor
send to it (dropped pairs counted) nor add its partials.
Needs torch (skipped without it); no GPU."""

import threading
import time
import traceback

import pytest

import epx
import ref
import test_gpu_deep_ep as scenario
import test_gpu_deep_ep_shrink as shrink_scenario

torch = pytest.importorskip("torch")

# Without masking a peer that never posts is a hang: the fake gives up after this long.
HANG_S = 60


class Fabric:
    """What the ranks share: each object's posted data (key -> value) under one condition, and
    a barrier of every rank for the worlds' own barrier."""

    def __init__(self, world_size):
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=HANG_S)
        self.objects = {}
        self.cond = threading.Condition()
        self.aborted = False

    def post(self, shared, key, value):
        with self.cond:
            shared[key] = value
            self.cond.notify_all()

    def await_peers(self, shared, keys, timeout_s):
        """Waits until every key of `keys` (peer -> key) is posted or `timeout_s` passes;
        returns the peers whose key was not posted."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                if self.aborted:
                    raise RuntimeError("another rank failed")
                missing = {q for q, k in keys.items() if k not in shared}
                left = deadline - time.monotonic()
                if not missing or left <= 0:
                    return missing
                self.cond.wait(left)

    def abort(self):
        with self.cond:
            self.aborted = True
            self.cond.notify_all()
        self.barrier.abort()


class FakeWorld:
    def __init__(self, fabric, rank):
        self.fabric, self.rank, self.size = fabric, rank, fabric.world_size
        self.made = 0

    def barrier(self):
        self.fabric.barrier.wait()


class FakeConfig:
    def __init__(self, c, world_size, rank):
        for f in ("hidden", "num_experts", "topk", "max_tokens_per_rank", "dtype", "round_scale",
                  "layout", "deterministic", "mask_failed_ranks", "combine_format",
                  "timeout_ms"):
            setattr(self, f, getattr(c, f))
        self.combine_order = getattr(c, "combine_order", "rank")
        self.world_size, self.rank = world_size, rank
        self.capacity = world_size * c.max_tokens_per_rank
        self.num_local_experts = c.num_experts // world_size


class Result:
    pass


def garbage(*shape):
    return torch.randint(-5, 1 << 20, shape, dtype=torch.int32)


class FakeAll2All:
    """One rank's object; the ranks' objects of one creation share a dict in the fabric, where
    each call posts its data under (what, call number, rank)."""

    def __init__(self, cfg, world):
        self.world = world
        self.config = FakeConfig(cfg, world.size, world.rank)
        self.device = torch.device("cpu")
        with world.fabric.cond:
            self.shared = world.fabric.objects.setdefault(world.made, {})
        world.made += 1
        c = self.config
        shape = (c.num_local_experts, c.capacity) if c.layout == "expert" else (c.capacity,)
        self.buffer = torch.zeros(*shape, c.hidden, dtype=torch.bfloat16)
        self.rows = {}
        self.slots = {}
        self.num_tokens = 0
        self.dispatches = 0
        self.combines = 0
        self.masked_ranks = 0
        self.dropped_pairs = 0

    @classmethod
    def create(cls, cfg, world, backend=None):
        return cls(cfg, world)

    def combine_buffer(self):
        return self.buffer

    def clear_mask(self):
        self.masked_ranks = 0
        self.dropped_pairs = 0

    def _masked(self, q):
        return (self.masked_ranks >> q) & 1

    def _exchange(self, what, call, value):
        """Posts this rank's `value` of call `call` and waits for every unmasked peer's; with
        masking, a peer that does not post within timeout_ms is masked. Returns the posts of
        the unmasked ranks (this one included), by rank."""
        c, fabric = self.config, self.world.fabric
        fabric.post(self.shared, (what, call, c.rank), value)
        peers = {q: (what, call, q) for q in range(c.world_size)
                 if q != c.rank and not self._masked(q)}
        timeout_s = c.timeout_ms / 1000 if c.mask_failed_ranks else HANG_S
        missing = fabric.await_peers(self.shared, peers, timeout_s)
        if missing and not c.mask_failed_ranks:
            raise RuntimeError(f"rank {c.rank}: ranks {sorted(missing)} never came ({what})")
        for q in missing:
            self.masked_ranks |= 1 << q
        return {q: self.shared[(what, call, q)] for q in range(c.world_size)
                if not self._masked(q)}

    def dispatch_by_rank(self, x, rank_mask, expert_counts, x_scales=None):
        """The core's dispatch by rank mask (token layout): rows where rank_mask says, ids -1,
        weights 0, each receiver's expert counts summed from the senders' expert_counts."""
        c = self.config
        assert c.layout == "token"
        if c.combine_order == "highest_slot":  # as the core: the order follows the ids
            raise epx.InputError("rank_mask = set, expected null with combine_order "
                                 "highest_slot (the order follows the top-k ids)")
        none = torch.full((x.shape[0], c.topk), -1, dtype=torch.int64)
        return self.dispatch(x, none, torch.zeros(none.shape), x_scales,
                             by_rank=(rank_mask.clone(), expert_counts.clone()))

    def dispatch(self, x, ids, weights, x_scales=None, by_rank=None):
        c = self.config
        r, L, K = c.rank, c.num_local_experts, c.topk
        # Pairs whose expert's rank is masked now are not sent (counted).
        gone = [int(e) >= 0 and self._masked(int(e) // L) for e in ids.flatten()]
        self.dropped_pairs += sum(gone)
        self.dispatches += 1
        scales = None if x_scales is None else x_scales.clone()
        posted = self._exchange("in", self.dispatches,
                                (x.clone(), ids.clone(), weights.clone(), scales, by_rank))

        def goes_here(q, n):
            mask = posted[q][4]
            if mask is not None:
                return bool(mask[0][n, r])
            return any(r * L <= int(e) < (r + 1) * L for e in posted[q][1][n])

        rows = [(q, n) for q in sorted(posted) for n in range(posted[q][1].shape[0])
                if goes_here(q, n)]
        if not c.deterministic:
            order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(len(rows)))
            rows = [rows[i] for i in order.tolist()]
        d = Result()
        cap = c.capacity
        d.recv_count = torch.tensor([len(rows)], dtype=torch.int32)
        d.recv_src_rank, d.recv_src_idx = garbage(cap), garbage(cap)
        d.recv_topk_weights = torch.rand(cap, K) * 100
        for j, (q, n) in enumerate(rows):
            d.recv_src_rank[j], d.recv_src_idx[j] = q, n
            d.recv_topk_weights[j] = posted[q][2][n]
        fp8 = c.dtype in ("bf16-to-fp8", "fp8")
        H, G = c.hidden, c.hidden // 128
        quantize = ref.quantize_pow2 if c.round_scale else ref.quantize
        d.expert_counts = torch.zeros(L, dtype=torch.int32)
        if c.layout == "token":
            # Token-major rows (garbage past recv_count): x (fp8 wires: quantised, with its
            # scales), the token's full top-k row; combine adds each rank's row of a token.
            d.recv_x = torch.randn(cap, H).to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
            d.recv_scales = torch.rand(cap, G) if fp8 else None
            # past recv_count: ids as a stale row of an earlier round would hold them
            d.recv_topk_ids = torch.randint(-1, c.num_experts, (cap, K), dtype=torch.int32)
            self.rows = {}
            for q in sorted(posted):  # senders routing by rank bring their own counts
                if posted[q][4] is not None:
                    d.expert_counts += posted[q][4][1][r * L:(r + 1) * L].to(torch.int32)
            for j, (q, n) in enumerate(rows):
                xq, iq, _, sq, _ = posted[q]
                if sq is not None:  # fp8 in: rows and scales travel as they are
                    d.recv_x[j], d.recv_scales[j] = xq[n], sq[n]
                elif fp8:
                    d.recv_x[j], d.recv_scales[j] = (v[0] for v in quantize(xq[n:n + 1]))
                else:
                    d.recv_x[j] = xq[n]
                d.recv_topk_ids[j] = iq[n]
                self.rows[(q, n)] = j
                for e in iq[n].tolist():
                    if r * L <= e < (r + 1) * L:
                        d.expert_counts[e - r * L] += 1
        if c.layout == "expert":
            d.expert_x = torch.randn(L, cap, H).to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
            d.expert_scales = torch.rand(L, G, cap).transpose(1, 2) if fp8 else None
            d.expert_src_rank, d.expert_src_idx = garbage(L, cap), garbage(L, cap)
            d.expert_topk_slot = garbage(L, cap)
            self.slots = {}
            for q, n in rows:
                xq, iq, _, _, _ = posted[q]
                for k in range(K):
                    e = int(iq[n, k]) - r * L
                    if not 0 <= e < L:
                        continue
                    s = int(d.expert_counts[e])
                    d.expert_counts[e] += 1
                    if fp8:
                        qv, sv = quantize(xq[n:n + 1])
                        d.expert_x[e, s], d.expert_scales[e, s] = qv[0], sv[0]
                    else:
                        d.expert_x[e, s] = xq[n]
                    d.expert_src_rank[e, s], d.expert_src_idx[e, s] = q, n
                    d.expert_topk_slot[e, s] = k
                    self.slots[(q, n, k)] = (e, s)
        self.num_tokens = x.shape[0]
        self.inputs = (ids.clone(), weights.clone())
        return d

    def combine(self, expert_out, out=None):
        c = self.config
        r, L = c.rank, c.num_local_experts
        if out is not None and out.numel() and expert_out.numel() and \
                out.untyped_storage().data_ptr() == expert_out.untyped_storage().data_ptr():
            # epx's kernels read expert_out while they write out
            raise epx.InputError("combine: out shares memory with expert_out")
        self.combines += 1
        posted = self._exchange("out", self.combines, (expert_out.clone(), dict(self.slots),
                                                         dict(self.rows)))
        ids, weights = self.inputs
        y = torch.zeros(self.num_tokens, c.hidden)
        if c.layout == "token":  # each rank's row of the token holds its weighted partial sum
            for n in range(self.num_tokens):
                for q, (partials, _, rows) in posted.items():
                    if (r, n) in rows:
                        y[n] += partials[rows[(r, n)]].float()
        logfmt = c.combine_format == "logfmt"
        for n in range(self.num_tokens if c.layout == "expert" else 0):
            partial = torch.zeros(c.world_size, c.hidden)  # each expert rank's sum for token n
            for k in range(c.topk):
                e = int(ids[n, k])
                if e >= 0 and e // L in posted:  # a masked rank's partials are left out
                    rows, slots, _ = posted[e // L]
                    partial[e // L] += weights[n, k] * rows[slots[(r, n, k)]].float()
            if logfmt:  # each partial crosses as a LogFMT row of its bf16 value
                partial = ref.logfmt_round_trip(partial.to(torch.bfloat16))
            y[n] = partial.sum(dim=0)
        self.logfmt_combines = getattr(self, "logfmt_combines", 0) + int(logfmt)
        y = y.to(torch.bfloat16)
        if out is None:
            return y
        out.copy_(y)
        return out

    def combine_with(self, expert_out, out=None, topk_weights=None, bias=None):
        """The core's combine with extras (token layout): (y, y_topk_weights or None); the bias
        rows start each token's f32 sum, then the ranks' rows (and top-k weights) are added in
        rank order, or with combine_order 'highest_slot' in the order of each rank's highest
        top-k slot of the token whose expert it holds."""
        c = self.config
        assert c.layout == "token"
        biases = list(bias) if isinstance(bias, (tuple, list)) else [bias]
        start = torch.zeros(self.num_tokens, c.hidden)
        for b in biases:
            if b is not None:
                start += b.float()
        self.combines += 1
        w = None if topk_weights is None else topk_weights.clone()
        posted = self._exchange("out", self.combines, (expert_out.clone(), w, dict(self.rows)))
        y = start
        y_w = None if w is None else torch.zeros(self.num_tokens, c.topk)
        ids, L = self.inputs[0], c.num_local_experts
        for n in range(self.num_tokens):
            ranks = [q for q in sorted(posted) if (c.rank, n) in posted[q][2]]
            if c.combine_order == "highest_slot":
                ranks.sort(key=lambda q: max(k for k in range(c.topk)
                                             if 0 <= int(ids[n, k]) and int(ids[n, k]) // L == q))
            for q in ranks:
                partials, wq, rows = posted[q]
                y[n] += partials[rows[(c.rank, n)]].float()
                if y_w is not None:
                    y_w[n] += wq[rows[(c.rank, n)]]
        y = y.to(torch.bfloat16)
        if out is not None:
            out.copy_(y)
            y = out
        return y, y_w

    def synchronize(self):
        pass

    def close(self):
        pass


def run_threads(fabric, world_size, rank_main, on_failure=None):
    """rank_main(rank) on every rank, each a thread; a rank that raises aborts the fabric (the
    others stop waiting), calls on_failure() when given, and the test fails with its
    traceback."""
    outcome = {}

    def main(rank):
        try:
            rank_main(rank)
            outcome[rank] = "ok"
        except BaseException:
            outcome[rank] = traceback.format_exc()
            fabric.abort()
            if on_failure is not None:
                on_failure()

    threads = [threading.Thread(target=main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(world_size):
        assert outcome.get(r) == "ok", f"rank {r}:\n{outcome.get(r)}"


class FakeGroup:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def test_scenario_over_a_fake_core(monkeypatch):
    import epx.deep_ep as deep_ep

    fabric = Fabric(scenario.WORLD)
    monkeypatch.setattr(deep_ep._low_latency_shapes, "All2All", FakeAll2All)
    monkeypatch.setattr(deep_ep.Buffer, "_make_world",
                        staticmethod(lambda group, comm: FakeWorld(fabric, group.rank())))

    def rank_main(rank):
        buffer = deep_ep.Buffer(FakeGroup(rank, scenario.WORLD), low_latency_mode=True,
                                explicitly_destroy=True)
        scenario.run_scenario(buffer, rank, torch.device("cpu"))
        # use_logfmt reached objects made with combine_format 'logfmt', and only those
        objects = buffer._low_latency_objects()
        assert any(getattr(a, "logfmt_combines", 0) for a in objects)
        assert all(a.config.combine_format == "logfmt" for a in objects
                   if getattr(a, "logfmt_combines", 0))
        buffer.destroy()

    run_threads(fabric, scenario.WORLD, rank_main)


def test_shrink_scenario_over_a_fake_core(monkeypatch):
    """Shrink mode (rank masking): three ranks, rank 2 stops calling after the first round and
    rank 1 after the second; the fake core masks a peer that does not post within timeout_ms."""
    import epx.deep_ep as deep_ep

    W = shrink_scenario.WORLD
    fabric = Fabric(W)
    monkeypatch.setenv("EPX_TIMEOUT_MS", "400")
    monkeypatch.setattr(deep_ep._low_latency_shapes, "All2All", FakeAll2All)
    monkeypatch.setattr(deep_ep.Buffer, "_make_world",
                        staticmethod(lambda group, comm: FakeWorld(fabric, group.rank())))
    aligners = {frozenset(range(W)): threading.Barrier(W, timeout=HANG_S),
                frozenset({0, 1}): threading.Barrier(2, timeout=HANG_S)}

    def align(live):
        barrier = aligners.get(frozenset(live))
        if barrier is not None:
            barrier.wait()

    def rank_main(rank):
        buffer = deep_ep.Buffer(FakeGroup(rank, W), low_latency_mode=True,
                                explicitly_destroy=True, enable_shrink=True)
        shrink_scenario.run_shrink_scenario(buffer, rank, torch.device("cpu"), align)
        buffer.destroy()

    def on_failure():
        for barrier in aligners.values():
            barrier.abort()

    run_threads(fabric, W, rank_main, on_failure)


def test_mask_calls_need_shrink_mode(monkeypatch):
    import epx.deep_ep as deep_ep

    monkeypatch.setattr(deep_ep._low_latency_shapes, "All2All", FakeAll2All)
    monkeypatch.setattr(deep_ep.Buffer, "_make_world",
                        staticmethod(lambda group, comm: FakeWorld(Fabric(1), 0)))
    b = deep_ep.Buffer(FakeGroup(0, 1), low_latency_mode=True)
    status = torch.zeros(1, dtype=torch.int32)
    for call in (lambda: b.low_latency_query_mask_buffer(status),
                 lambda: b.low_latency_update_mask_buffer(0, False),
                 lambda: b.low_latency_clean_mask_buffer()):
        with pytest.raises(epx.ConfigError, match="enable_shrink = False, expected True"):
            call()
    b.clean_low_latency_buffer(16, 256, 4)  # nothing to do without shrink mode
    b.prepare_low_latency_shape(16, 256, 4, 2, use_fp8=False)
    assert len(b._shapes) == 1
    shrinking = deep_ep.Buffer(FakeGroup(0, 1), low_latency_mode=True, enable_shrink=True)
    with pytest.raises(epx.InputError, match="mask_status.device"):
        shrinking.low_latency_query_mask_buffer(status.to("meta"))
    with pytest.raises(epx.InputError, match="mask_status.stride"):
        shrinking.low_latency_query_mask_buffer(torch.zeros(2, 2, dtype=torch.int32)[:, 0])
    shrinking.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0]


def test_logfmt_at_combine_only_needs_ordered_rows_and_the_routing_kept(monkeypatch):
    """A combine whose use_logfmt differs from its dispatch's sends the round again with the
    dispatch's topk_idx: shrink mode (rows in arrival order) refuses it, and so does a topk_idx
    modified since the dispatch. Named at dispatch, shrink mode combines in LogFMT."""
    import epx.deep_ep as deep_ep

    monkeypatch.setattr(deep_ep._low_latency_shapes, "All2All", FakeAll2All)
    monkeypatch.setattr(deep_ep.Buffer, "_make_world",
                        staticmethod(lambda group, comm: FakeWorld(Fabric(1), 0)))
    x = torch.randn(4, 256).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [1, 2], [3, -1], [2, 0]])
    w = torch.rand(4, 2)
    shrinking = deep_ep.Buffer(FakeGroup(0, 1), low_latency_mode=True, enable_shrink=True)
    recv_x, _, handle, _, _ = shrinking.low_latency_dispatch(x, ids, 8, 4, use_fp8=False)
    with pytest.raises(NotImplementedError, match="shrink mode"):
        shrinking.low_latency_combine(recv_x, ids, w, handle, use_logfmt=True)
    recv_x, _, handle, _, _ = shrinking.low_latency_dispatch(x, ids, 8, 4, use_fp8=False,
                                                             use_logfmt=True)
    y, _, _ = shrinking.low_latency_combine(recv_x, ids, w, handle, use_logfmt=True)
    assert y.shape == (4, 256)

    # Named at dispatch: the round's own LogFMT objects combine it, no second dispatch; named
    # at combine only: the round is dispatched again on the shape's LogFMT objects.
    b = deep_ep.Buffer(FakeGroup(0, 1), low_latency_mode=True)

    def rows_dispatched():  # dispatches of the row objects, by combine format
        out = {}
        for a in b._low_latency_objects():
            if a.config.layout == "expert" and a.dispatches:
                out[a.config.combine_format] = out.get(a.config.combine_format, 0) + a.dispatches
        return out

    recv_x, _, handle, _, _ = b.low_latency_dispatch(x, ids, 8, 4, use_fp8=False,
                                                     use_logfmt=True)
    b.low_latency_combine(recv_x, ids, w, handle, use_logfmt=True)
    assert rows_dispatched() == {"logfmt": 1}
    recv_x, _, handle, _, _ = b.low_latency_dispatch(x, ids, 8, 4, use_fp8=False)
    b.low_latency_combine(recv_x, ids, w, handle, use_logfmt=True)
    assert rows_dispatched() == {"logfmt": 2, "bf16": 1}
    mine = ids.clone()
    recv_x, _, handle, _, _ = b.low_latency_dispatch(x, mine, 8, 4, use_fp8=False)
    mine[0, 0] = 3
    with pytest.raises(epx.InputError, match="topk_idx was modified"):
        b.low_latency_combine(recv_x, ids, w, handle, use_logfmt=True)
    with pytest.raises(epx.InputError, match="multiple of 128 with use_logfmt"):
        b.prepare_low_latency_shape(8, 200, 4, 2, use_fp8=False, use_logfmt=True)
