"""epx.deep_ep's own logic on the CPU, over a stand-in for epx's core: the GPU test's scenario
(test_gpu_deep_ep.run_scenario) on two ranks run as threads, where each All2All is a plain torch
model of the contract epx's expert-major and token-major dispatch and combine keep (DESIGN §4):
expert rows ordered by (source rank, source index) when deterministic, token-major rows in any
order otherwise, garbage past the counts, combine folding the weights carried at dispatch.
Needs torch (skipped without it); no GPU."""

import threading
import traceback

import pytest

import ref
import test_gpu_deep_ep as scenario

torch = pytest.importorskip("torch")


class Fabric:
    """What the ranks share: each object's inputs and outputs, and a barrier."""

    def __init__(self, world_size):
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=60)
        self.objects = {}
        self.lock = threading.Lock()


class FakeWorld:
    def __init__(self, fabric, rank):
        self.fabric, self.rank, self.size = fabric, rank, fabric.world_size
        self.made = 0

    def barrier(self):
        self.fabric.barrier.wait()


class FakeConfig:
    def __init__(self, c, world_size, rank):
        for f in ("hidden", "num_experts", "topk", "max_tokens_per_rank", "dtype", "layout",
                  "deterministic"):
            setattr(self, f, getattr(c, f))
        self.world_size, self.rank = world_size, rank
        self.capacity = world_size * c.max_tokens_per_rank
        self.num_local_experts = c.num_experts // world_size


class Result:
    pass


def garbage(*shape):
    return torch.randint(-5, 1 << 20, shape, dtype=torch.int32)


class FakeAll2All:
    """One rank's object; the ranks' objects of one creation share a dict in the fabric."""

    def __init__(self, cfg, world):
        self.world = world
        self.config = FakeConfig(cfg, world.size, world.rank)
        self.device = torch.device("cpu")
        with world.fabric.lock:
            self.shared = world.fabric.objects.setdefault(world.made, {})
        world.made += 1
        c = self.config
        self.buffer = torch.zeros(c.num_local_experts, c.capacity, c.hidden, dtype=torch.bfloat16)
        self.slots = {}
        self.num_tokens = 0

    @classmethod
    def create(cls, cfg, world, backend=None):
        return cls(cfg, world)

    def combine_buffer(self):
        return self.buffer

    def dispatch(self, x, ids, weights, x_scales=None):
        c = self.config
        r, W, L, K = c.rank, c.world_size, c.num_local_experts, c.topk
        self.shared[("in", r)] = (x.clone(), ids.clone(), weights.clone())
        self.world.fabric.barrier.wait()
        rows = [(q, n) for q in range(W) for n in range(self.shared[("in", q)][1].shape[0])
                if any(r * L <= int(e) < (r + 1) * L for e in self.shared[("in", q)][1][n])]
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
            d.recv_topk_weights[j] = self.shared[("in", q)][2][n]
        if c.layout == "expert":
            fp8 = c.dtype == "bf16-to-fp8"
            H, G = c.hidden, c.hidden // 128
            d.expert_x = torch.randn(L, cap, H).to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
            d.expert_scales = torch.rand(L, G, cap).transpose(1, 2) if fp8 else None
            d.expert_src_rank, d.expert_src_idx = garbage(L, cap), garbage(L, cap)
            d.expert_topk_slot = garbage(L, cap)
            d.expert_counts = torch.zeros(L, dtype=torch.int32)
            self.slots = {}
            for q, n in rows:
                xq, iq, _ = self.shared[("in", q)]
                for k in range(K):
                    e = int(iq[n, k]) - r * L
                    if not 0 <= e < L:
                        continue
                    s = int(d.expert_counts[e])
                    d.expert_counts[e] += 1
                    if fp8:
                        qv, sv = ref.quantize(xq[n:n + 1])
                        d.expert_x[e, s], d.expert_scales[e, s] = qv[0], sv[0]
                    else:
                        d.expert_x[e, s] = xq[n]
                    d.expert_src_rank[e, s], d.expert_src_idx[e, s] = q, n
                    d.expert_topk_slot[e, s] = k
                    self.slots[(q, n, k)] = (e, s)
        self.num_tokens = x.shape[0]
        self.world.fabric.barrier.wait()
        return d

    def combine(self, expert_out, out=None):
        c = self.config
        r, L = c.rank, c.num_local_experts
        self.shared[("out", r)] = (expert_out.clone(), dict(self.slots))
        self.world.fabric.barrier.wait()
        _, ids, weights = self.shared[("in", r)]
        y = torch.zeros(self.num_tokens, c.hidden)
        for n in range(self.num_tokens):
            for k in range(c.topk):
                e = int(ids[n, k])
                if e >= 0:
                    rows, slots = self.shared[("out", e // L)]
                    y[n] += weights[n, k] * rows[slots[(r, n, k)]].float()
        self.world.fabric.barrier.wait()
        y = y.to(torch.bfloat16)
        if out is None:
            return y
        out.copy_(y)
        return out

    def synchronize(self):
        pass

    def close(self):
        pass


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
    monkeypatch.setattr(deep_ep, "All2All", FakeAll2All)
    monkeypatch.setattr(deep_ep.Buffer, "_make_world",
                        staticmethod(lambda group, comm: FakeWorld(fabric, group.rank())))
    outcome = {}

    def rank_main(rank):
        try:
            buffer = deep_ep.Buffer(FakeGroup(rank, scenario.WORLD), low_latency_mode=True,
                                    explicitly_destroy=True)
            scenario.run_scenario(buffer, rank, torch.device("cpu"))
            buffer.destroy()
            outcome[rank] = "ok"
        except BaseException:
            outcome[rank] = traceback.format_exc()
            fabric.barrier.abort()  # the other rank stops waiting

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(scenario.WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(scenario.WORLD):
        assert outcome.get(r) == "ok", f"rank {r}:\n{outcome.get(r)}"
