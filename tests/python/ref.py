"""A torch reference of the dispatch/combine contract (DESIGN §4), written for these tests from
the contract, not from the C++ reference: inputs, fp8 quantisation, what each rank receives,
the expert stage, and combine's result."""

try:
    import torch
except ImportError:  # the GPU tests that use this skip themselves without torch
    torch = None

FP8_MAX = 448.0


def expert_scale(e):
    """The test expert: f_e(x) = x * (1 + (e % 7) / 8)."""
    return 1.0 + (e % 7) / 8.0


def quantize(x):
    """bf16 [N, H] -> (fp8 e4m3 [N, H], f32 [N, H/128]): per 1x128 block, a = amax (1 when 0),
    scale = a / 448 and q = fp8(x * (448 / a)), each division an IEEE f32 division, as the
    contract says (dispatch's bytes are compared with these exactly).

    The divisions are tensor by tensor: torch computes `448 / a` as `a.reciprocal() * 448`
    and, on CUDA, `a / 448` as `a * (1 / 448)`, two roundings that differ from the division in
    the last bit now and then, and so flip the fp8 rounding of some elements."""
    n, h = x.shape
    blocks = x.float().view(n, h // 128, 128)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    a = torch.where(amax > 0, amax, torch.ones_like(amax))
    fp8_max = torch.full_like(a, FP8_MAX)
    inv = torch.div(fp8_max, a)
    q = (blocks * inv).to(torch.float8_e4m3fn).view(n, h)
    return q, torch.div(a, fp8_max).view(n, h // 128)


def quantize_pow2(x):
    """bf16 [N, H] -> (fp8 e4m3 [N, H], f32 [N, H/128]) with power-of-two scales (EpConfig's
    round_scale, DeepEP's rule): per 1x128 block, e = ceil(log2(max(amax, 1e-4) * f32(1/448))),
    scale = 2^e, q = fp8(x * 2^-e) (exact scaling)."""
    n, h = x.shape
    blocks = x.float().view(n, h // 128, 128)
    amax = blocks.abs().amax(dim=2).clamp_min(1e-4)
    t = amax * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32, device=x.device)
    m, e = torch.frexp(t)
    ceil_log2 = torch.where(m == 0.5, e - 1, e)
    q = torch.ldexp(blocks, -ceil_log2.unsqueeze(-1).float()).to(torch.float8_e4m3fn)
    return q.view(n, h), torch.ldexp(torch.ones_like(t), ceil_log2.float())


def dequantize(q, scales):
    n, h = q.shape
    return (q.float().view(n, h // 128, 128) * scales.float().view(n, h // 128, 1)).view(n, h)


def make_inputs(cfg, rank, n, seed, device, ids_dtype=None):
    """x (as the config's dtype wants it), scales, topk_ids (distinct, some -1), weights."""
    g = torch.Generator(device="cpu").manual_seed(seed * 1000 + rank)
    H, E, K = cfg.hidden, cfg.num_experts, cfg.topk
    x = (torch.randn(n, H, generator=g) * 2).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]) if n else \
        torch.empty(0, K, dtype=torch.int64)
    drop = torch.rand(n, K, generator=g) < 0.1
    ids = torch.where(drop, torch.full_like(ids, -1), ids).to(ids_dtype or torch.int32)
    w = torch.rand(n, K, generator=g).float()
    scales = None
    if cfg.dtype == "fp8":
        xq, scales = quantize(x)
        x = xq
    return [t.to(device) if t is not None else None for t in (x, ids, w, scales)]


def refill(inputs, fresh):
    """Copies `fresh` (make_inputs' list) into the tensors `inputs` in place (a captured graph
    keeps reading them); None entries stay None."""
    for dst, src in zip(inputs, fresh):
        if dst is not None:
            dst.copy_(src)


def as_bf16_values(x, scales):
    """What a row means in f32: bf16 as is (scales None), fp8 dequantised with its scales."""
    if scales is None:
        assert x.dtype != torch.float8_e4m3fn, "fp8 rows mean nothing without their scales"
        return x.float()
    return dequantize(x, scales)


def wire_rows(cfg, x, scales):
    """(bytes/values on the wire, scales) for the inputs of one rank."""
    if cfg.dtype == "bf16-to-fp8":
        return quantize(x)
    return x, scales


def expected_rows(cfg, inputs, rank, every_rank):
    """Rows rank `rank` receives: list of (src_rank, src_idx) sorted, from every rank's inputs."""
    L = cfg.num_local_experts
    rows = []
    for q, (x, ids, w, s) in enumerate(inputs):
        for i in range(ids.shape[0]):
            mine = ((ids[i] >= rank * L) & (ids[i] < (rank + 1) * L)).any().item()
            if every_rank or mine:
                rows.append((q, i))
    return rows


def token_partials(cfg, rank, recv_x, recv_scales, recv_ids, recv_w):
    """The expert stage, token-major: partial = sum over local k of w_k * f_{e_k}(x), bf16, for
    every row of the receive area (rows past recv_count are computed and ignored).
    `recv_scales` is None for bf16 rows (as expert_outputs)."""
    L = cfg.num_local_experts
    xv = as_bf16_values(recv_x, recv_scales if cfg.wire_fp8 else None)
    ids = recv_ids.long()
    local = (ids >= rank * L) & (ids < (rank + 1) * L)
    coef = torch.where(local, recv_w * (1.0 + (ids.clamp(min=0) % 7).float() / 8.0),
                       torch.zeros_like(recv_w))
    return (xv * coef.sum(dim=1, keepdim=True)).to(torch.bfloat16)


def expert_outputs(cfg, rank, expert_x, expert_scales):
    """The expert stage, expert-major: out[e] = f_e(x) for every row of every local expert.
    `expert_scales` is None for bf16 rows (a bf16 wire, or bf16 warm-up rows on an fp8 one)."""
    L, cap, H = expert_x.shape
    scales = expert_scales if cfg.wire_fp8 else None
    xv = as_bf16_values(expert_x.reshape(L * cap, H),
                        None if scales is None else scales.reshape(L * cap, -1))
    # Computed on the device (no host-to-device copy: this runs inside graph captures too);
    # the same values as expert_scale(e).
    e = torch.arange(rank * L, (rank + 1) * L, device=xv.device)
    coef = (1.0 + (e % 7).float() / 8.0).repeat_interleave(cap)[:, None]
    return (xv * coef).to(torch.bfloat16).view(L, cap, H)


def combined(cfg, x, ids, w, scales):
    """y = sum_k w_k f_{e_k}(x) in f32 from the values that travelled (fp8 wires: dequantised)."""
    xs = x if cfg.dtype != "bf16-to-fp8" else None
    if cfg.dtype == "bf16-to-fp8":
        q, s = quantize(x)
        xv = dequantize(q, s)
    else:
        xv = as_bf16_values(xs, scales)
    idsl = ids.long()
    coef = torch.where(idsl >= 0, w * (1.0 + (idsl.clamp(min=0) % 7).float() / 8.0),
                       torch.zeros_like(w))
    return xv * coef.sum(dim=1, keepdim=True)


LOGFMT_BLOCK = 128


def logfmt_round_trip(x):
    """bf16 [N, H] (H a multiple of 128) -> f32 [N, H]: what the token's rank adds of a partial
    that crossed as a LogFMT-10 row (src/core/logfmt.hpp), written from the format's definition:
    per block of 128 values, amax and amin of |x| (bf16), l_max = log2(amax),
    l_min = max(log2(amin), l_max - 32), step = (l_max - l_min) / 510; a magnitude takes code
    c = floor((log2|x| - l_min) / step + 2 - log2((1 + 2^step) / 2) / step) in 0..511 (the level
    nearest on the linear scale; |x| >= amax is 511, 0 is 0) and decodes to 2^(l_min + (c-1)
    step), code 511 to amax; a block of equal magnitudes is exact; a block holding inf or NaN is
    NaN. torch's log2 / exp2 stand in for the format's fixed polynomials: a decoded value may
    differ from epx's in the last bits of f32 (about 1e-6 relative), and a code by one level
    where a value lands on a rounding boundary (rare)."""
    n, h = x.shape
    bits = x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    negative = (bits >> 15) == 1
    mag = (bits & 0x7FFF).view(n, h // LOGFMT_BLOCK, LOGFMT_BLOCK)

    def value(b):  # bf16 bits (int32) -> f32
        return (b << 16).view(torch.float32)

    amax_bits = mag.amax(dim=2, keepdim=True)
    amin_bits = mag.amin(dim=2, keepdim=True)
    amax = value(amax_bits)
    l_max = torch.log2(amax)
    floor_log = l_max - 32.0
    l_min = torch.where(amin_bits == 0, floor_log,
                        torch.maximum(torch.log2(value(amin_bits)), floor_log))
    spread = amin_bits != amax_bits
    step = torch.where(spread, (l_max - l_min) / 510.0, torch.zeros_like(l_max))
    inv_step = torch.where(spread, 1.0 / step, torch.zeros_like(step))
    mid = torch.log2((1.0 + torch.exp2(step)) * 0.5)
    rounding = torch.where(spread, 2.0 - mid * inv_step, torch.zeros_like(step))
    with torch.no_grad():
        t = (torch.log2(value(mag)) - l_min) * inv_step + rounding
        code = torch.where(t >= 1.0, torch.floor(t.clamp(max=511.0)), torch.zeros_like(t))
        code = torch.where(mag >= amax_bits, torch.full_like(code, 511.0), code)
        code = torch.where(mag == 0, torch.zeros_like(code), code)
        level = torch.exp2(l_min + (code - 1.0) * step)
        m = torch.where(code == 0, torch.zeros_like(level),
                        torch.where(code >= 511.0, amax.expand_as(level), level))
        m = torch.where(amax_bits >= 0x7F80, torch.full_like(m, float("nan")), m)
    m = m.view(n, h)
    return torch.where(negative, -m, m)
