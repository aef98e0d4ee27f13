"""The parts of epx that need neither a GPU nor torch: the extension loads, configurations and
launch files are read with the library's rules, sizes, the exception classes."""

import json
import sys

import pytest

import epx


def test_import_needs_no_torch():
    assert epx.__version__ == epx.library_version()
    assert isinstance(epx.has_cuda, bool)
    # Importing the package (all of it) must not import torch.
    assert "torch" not in sys.modules or sys.modules["torch"] is not None


def test_ep_config_by_keyword():
    c = epx.EpConfig(hidden=4096, num_experts=64, topk=4, max_tokens_per_rank=128,
                     dtype="fp8", layout="expert", scale_layout="column", world_size=8,
                     deterministic=True, timeout_ms=500)
    c.validate()
    assert (c.hidden, c.num_experts, c.topk, c.world_size) == (4096, 64, 4, 8)
    assert (c.dtype, c.layout, c.scale_layout) == ("fp8", "expert", "column")
    assert c.capacity == 8 * 128 and c.num_local_experts == 8 and c.num_scale_groups == 32
    assert c.replace(hidden=2048).hidden == 2048 and c.hidden == 4096
    assert "hidden=4096" in repr(c)
    assert c.combine == "auto" and c.replace(combine="push").combine == "push"
    assert "combine='auto'" in repr(c)
    assert not c.round_scale and "round_scale=False" in repr(c)
    q = c.replace(dtype="bf16-to-fp8", round_scale=True)
    q.validate()
    assert q.round_scale
    with pytest.raises(epx.ConfigError, match=r"round_scale = true, expected false with dtype fp8"):
        c.replace(round_scale=True).validate()
    assert c.combine_format == "bf16" and "combine_format='bf16'" in repr(c)
    lf = c.replace(combine_format="logfmt")
    lf.validate()
    assert lf.combine_format == "logfmt" and lf != c
    with pytest.raises(epx.ConfigError, match=r"combine_format = logfmt, expected bf16 with "
                                              r"hidden = 1000 \(LogFMT rows need hidden a "
                                              r"multiple of 128\)"):
        lf.replace(dtype="bf16", hidden=1000).validate()
    assert c.combine_order == "rank" and "combine_order='rank'" in repr(c)
    hs = c.replace(combine_order="highest_slot", layout="token")
    hs.validate()
    assert hs.combine_order == "highest_slot" and hs != c
    with pytest.raises(epx.ConfigError, match=r"combine_order = highest_slot, expected rank with "
                                              r"layout expert"):
        hs.replace(layout="expert").validate()


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"hiden": 4096}, "EpConfig key = 'hiden'"),
        ({"hidden": "4096"}, "EpConfig.hidden = '4096' (str), expected an int"),
        ({"topk": True}, "EpConfig.topk = True (bool), expected an int"),
        ({"dtype": "fp16"}, "dtype"),
        ({"layout": "rows"}, "layout"),
        ({"deterministic": 1}, "EpConfig.deterministic = 1 (int), expected True or False"),
        ({"combine": "sideways"}, 'combine = "sideways", expected one of auto, pull, push'),
        ({"combine_format": "fp8"}, 'combine_format = "fp8", expected one of bf16, logfmt'),
        ({"combine_format": True}, "EpConfig.combine_format = True (bool), expected a str"),
        ({"combine_order": "slot"}, 'combine_order = "slot", expected one of rank, highest_slot'),
    ],
)
def test_ep_config_refuses_bad_keywords(fields, message):
    with pytest.raises(epx.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        epx.EpConfig(**fields)


def test_validate_names_the_field():
    with pytest.raises(epx.ConfigError, match="num_experts = 7, expected a multiple of world_size"):
        epx.EpConfig(num_experts=7, world_size=2).validate()
    with pytest.raises(epx.ConfigError, match="world_size = 0"):
        epx.ep_config(world_size=0)
    with pytest.raises(ValueError):  # ConfigError is a ValueError too
        epx.ep_config(topk=0)


def test_launch_configs_by_keyword_and_aliases():
    lc = epx.launch_configs(dispatch={"block_num": 32}, combine={"num_blocks": 16},
                            **{"global": {"warp_num_per_block": 8}})
    assert (lc.dispatch.num_blocks, lc.dispatch.warps_per_block) == (32, 8)
    assert (lc.combine.num_blocks, lc.combine.warps_per_block) == (16, 8)
    assert epx.launch_configs(global_={"warps_per_block": 4}).combine.warps_per_block == 4
    with pytest.raises(epx.ConfigError, match="unknown key dispatch.blocks"):
        epx.launch_configs(dispatch={"blocks": 32})
    with pytest.raises(epx.ConfigError, match="launch_configs key = 'scatter'"):
        epx.launch_configs(scatter={"num_blocks": 1})


def test_launch_file_and_env(tmp_path, monkeypatch):
    path = tmp_path / "launch.json"
    path.write_text(json.dumps({"dispatch": {"warp_num_per_block": 16, "block_num": 64}}))
    lc = epx.launch_configs_from_file(path)
    assert (lc.dispatch.num_blocks, lc.dispatch.warps_per_block) == (64, 16)
    monkeypatch.delenv("EPX_CONFIG_PATH", raising=False)
    assert epx.launch_configs_from_env() is None
    monkeypatch.setenv("EPX_CONFIG_PATH", str(path))
    assert epx.launch_configs_from_env().dispatch.num_blocks == 64
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"combine": {"warps_per_block": 999}}))
    with pytest.raises(epx.ConfigError, match="bad.json"):
        epx.launch_configs_from_file(bad)
    with pytest.raises(epx.ConfigError, match="my text"):
        epx.launch_configs_from_json("{not json", "my text")
    with pytest.raises(epx.ConfigError):
        epx.launch_configs_from_file(tmp_path / "missing.json")


def test_environment(monkeypatch):
    monkeypatch.setenv("EPX_BACKEND", "naive")
    monkeypatch.setenv("EPX_TIMEOUT_MS", "250")
    assert epx.env()["backend"] == "naive" and epx.env()["timeout_ms"] == 250
    assert epx.backend_from_env() == "naive"
    monkeypatch.setenv("EPX_BACKEND", "fastest")
    with pytest.raises(epx.ConfigError, match="EPX_BACKEND"):
        epx.env()
    assert epx._epx.parse_env(None, None, None)["backend"] is None
    with pytest.raises(epx.ConfigError, match="EPX_TIMEOUT_MS"):
        epx._epx.parse_env(None, "0", None)
    assert epx._epx.hardware_queues_per_gpu(None) == 8
    with pytest.raises(epx.ConfigError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        epx._epx.hardware_queues_per_gpu("64")


@pytest.mark.skipif(not epx.has_cuda, reason="epx built without CUDA: no sizing function")
def test_buffer_sizes():
    c = epx.EpConfig(hidden=7168, num_experts=256, topk=8, max_tokens_per_rank=128,
                     world_size=8)
    ll = epx.buffer_bytes(c, "low_latency")
    assert ll > c.capacity * c.wire_row_bytes  # at least the receive rows
    assert ll <= 64 << 20  # DESIGN §9's budget at 128 tokens per rank
    bigger = epx.buffer_bytes(c.replace(max_tokens_per_rank=1024), "low_latency")
    assert bigger > ll
    with pytest.raises(epx.ConfigError, match="backend"):
        epx.buffer_bytes(c, "fastest")
    # high_throughput: rings of fixed size, whatever the tokens per rank
    ht = epx.buffer_bytes(c.replace(max_tokens_per_rank=16384), "high_throughput")
    assert ht <= 256 << 20
    assert epx.buffer_bytes(c.replace(max_tokens_per_rank=16384, worst_case_output=True),
                            "high_throughput") > ht + 8 * 16384 * 7168


def test_high_throughput_from_python_needs_worst_case_output():
    c = epx.EpConfig(hidden=1024, num_experts=16, topk=4, max_tokens_per_rank=8)
    assert not c.worst_case_output and "worst_case_output=False" in repr(c)
    assert c.replace(worst_case_output=True).worst_case_output
    assert "high_throughput" in epx.BACKENDS
    lc = epx.launch_configs(dispatch={"ring_rows": 128})
    assert lc.dispatch.ring_rows == 128 and lc.combine.ring_rows == 0
    # refused before any world or GPU is touched
    with pytest.raises(epx.ConfigError, match="worst_case_output = False, expected True"):
        epx.make_group(c, world=None, backend="high_throughput")
    with pytest.raises(epx.ConfigError, match="worst_case_output = False, expected True"):
        epx.All2All.create(c, world=None, backend="high_throughput")

    class OneNode:
        num_nodes = 1

    class TwoNodes:
        num_nodes = 2

    # across nodes (an NcclWorld of several nodes) the receive areas keep one shape either way
    with pytest.raises(epx.ConfigError, match="NcclWorlds of several nodes"):
        epx.config.check_backend_config("high_throughput", c, OneNode())
    epx.config.check_backend_config("high_throughput", c, TwoNodes())


@pytest.mark.parametrize(
    "code, cls",
    [("config", "ConfigError"), ("input", "InputError"), ("timeout", "TimeoutError"),
     ("peer", "PeerError"), ("cuda", "CudaError"), ("state", "StateError"),
     ("unsupported", "UnsupportedError")],
)
def test_exception_mapping(code, cls):
    with pytest.raises(getattr(epx, cls)) as info:
        epx._epx._throw(code, f"the message of {code}")
    assert type(info.value).__name__ == cls and type(info.value).__module__ == "epx"
    assert isinstance(info.value, epx.Error) and str(info.value) == f"the message of {code}"
    assert info.value.code == code
    assert isinstance(info.value, ValueError) == (code in ("config", "input"))


def test_callback_bootstrap_and_fingerprints():
    c = epx.EpConfig(hidden=4096, num_experts=64, topk=4, world_size=2)
    same = epx.CallbackBootstrap(0, 2, lambda b: [b, b])
    assert same.all_gather(b"\x00\xffbytes") == [b"\x00\xffbytes"] * 2
    same.check_fingerprints(c, "low_latency")
    other = epx.CallbackBootstrap(
        0, 2, lambda b: [b, b.replace(b"hidden=4096", b"hidden=2048")])
    with pytest.raises(epx.ConfigError, match="hidden: rank 0 has 4096, rank 1 has 2048"):
        other.check_fingerprints(c, "low_latency")
    short = epx.CallbackBootstrap(0, 2, lambda b: [b])
    with pytest.raises(epx.PeerError, match="result size = 1, expected 2"):
        short.all_gather(b"x")

    def failing(_):
        raise KeyError("from the callback")

    with pytest.raises(KeyError, match="from the callback"):
        epx.CallbackBootstrap(0, 2, failing).all_gather(b"x")
    with pytest.raises(epx.ConfigError, match="rank = 2"):
        epx.CallbackBootstrap(2, 2, lambda b: [b, b])


def test_bootstrap_options_from_env_values():
    o = epx._epx.parse_bootstrap_options("1", "2", "@epx-test", "2000")
    assert o == {"rank": 1, "world_size": 2, "address": "@epx-test", "timeout_ms": 2000}
    with pytest.raises(epx.ConfigError, match="EPX_RANK"):
        epx._epx.parse_bootstrap_options("2", "2", "@epx-test", None)


def test_moe_shape_by_keyword():
    if not epx.has_cuda:
        pytest.skip("epx built without CUDA: no MoeShape")
    s = epx.MoeShape(hidden=1024, intermediate=512, num_experts=8, topk=2, scoring="softmax",
                     shared_intermediate=0, num_groups=1, topk_groups=1)
    s.validate()
    assert s.scoring == "softmax" and not s.has_shared_expert
    with pytest.raises(epx.ConfigError, match="scoring"):
        epx.MoeShape(scoring="argmax")


def test_gpu_parts_refuse_cleanly_without_gpu():
    if epx.has_cuda and epx._epx.cuda_device_count() > 0:
        pytest.skip("a GPU is visible: the refusal is for machines without one")
    # the error says what is missing: a GPU, or CUDA in this build
    with pytest.raises(epx.UnsupportedError, match="GPU|CUDA"):
        epx.InProcessWorld(2)


def test_vllm_plugin_is_off_by_default(monkeypatch):
    import epx.vllm

    monkeypatch.delenv("EPX_VLLM", raising=False)
    epx.vllm.register()  # a no-op, even without vLLM installed


def test_vllm_adapter_is_vllms_prepare_finalize():
    # Where vLLM installs (it needs no GPU to import): the adapter's class derives from vLLM's
    # own modular-kernel base, implements every abstract method with vLLM's parameter names, and
    # the function the plugin wraps exists.
    import inspect

    mk = pytest.importorskip("vllm.model_executor.layers.fused_moe.modular_kernel",
                             reason="vLLM is not installed")
    au = pytest.importorskip("vllm.model_executor.layers.fused_moe.all2all_utils")
    import epx.vllm as ev

    cls, base = ev._class("EpxPrepareAndFinalize", ev._PrepareFinalizeMethods,
                          "FusedMoEPrepareAndFinalizeModular")
    assert base is not None and issubclass(cls, base)
    assert not getattr(cls, "__abstractmethods__", frozenset())
    abstract = set()
    for k in base.__mro__:
        abstract |= set(getattr(k, "__abstractmethods__", ()))
    for name in abstract:
        ours = inspect.getattr_static(ev._PrepareFinalizeMethods, name)
        theirs = inspect.getattr_static(base, name)
        if isinstance(theirs, property):
            assert isinstance(ours, property), name
            continue
        assert list(inspect.signature(ours).parameters) == \
            list(inspect.signature(theirs).parameters), name
    assert callable(au.maybe_make_prepare_finalize)


class _MaskingCore:
    """What epx.All2All reads of the extension's object, with a mask set as a kernel would."""

    def __init__(self, masked, dropped):
        self.config = epx.EpConfig(hidden=1024, num_experts=16, topk=4, max_tokens_per_rank=8,
                                   world_size=8, mask_failed_ranks=True)
        self.backend = "low_latency"
        self.device = 0
        self.masked_ranks, self.dropped_pairs = masked, dropped
        self.cleared_on = []

    def combine_buffer(self):
        return None

    def clear_mask(self, stream):
        self.cleared_on.append(stream)
        self.masked_ranks = self.dropped_pairs = 0


def test_masking_accessors_without_gpu(monkeypatch):
    import epx._torch
    import epx.all2all as a2a_module

    if epx.has_cuda:  # the extension's All2All carries them (read-only: the kernels set them)
        for name in ("masked_ranks", "dropped_pairs"):
            assert isinstance(getattr(epx._epx.All2All, name), property), name
        assert callable(epx._epx.All2All.clear_mask)
    monkeypatch.setattr(epx._torch, "has_torch", lambda: False)  # no custom ops, no tensors
    core = _MaskingCore(masked=(1 << 7) | (1 << 2), dropped=5)
    a = a2a_module.All2All(core)
    assert a.config.mask_failed_ranks
    assert (a.masked_ranks, a.dropped_pairs) == (0x84, 5)
    assert isinstance(a.masked_ranks, int) and a.masked_rank_list() == [2, 7]
    monkeypatch.setattr(epx._torch, "current_stream", lambda device: 1234)
    monkeypatch.setattr(epx._torch, "cuda_device", lambda index: f"cuda:{index}")
    a.clear_mask()
    assert core.cleared_on == [1234]  # torch's current stream of the object's GPU
    assert (a.masked_ranks, a.dropped_pairs, a.masked_rank_list()) == (0, 0, [])
    a.close()
