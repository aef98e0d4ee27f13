"""epx.deep_ep without a GPU (and without torch where it can): DeepEP's Buffer surface (names,
defaults), the size hint, what is refused and how it says so, events and hooks, the import
alias, and the package the DeepEP runner assembles (tests/compat)."""

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import epx
import epx.deep_ep as deep_ep

COMPAT = Path(__file__).resolve().parents[1] / "compat"
sys.path.insert(0, str(COMPAT))

import deepep_shim  # noqa: E402


class FakeGroup:
    """What Buffer reads of a torch.distributed group before it makes a world."""

    def __init__(self, rank=0, size=2):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def params(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY)]


def test_import_needs_no_torch():
    # epx.deep_ep imports torch only when a tensor is needed.
    code = ("import sys, epx.deep_ep as d; assert 'torch' not in sys.modules, 'torch imported';"
            "print(sorted(d.__all__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "Buffer" in out.stdout


def test_signatures_are_deepeps():
    empty = inspect.Parameter.empty
    assert params(deep_ep.Buffer.__init__) == [
        ("self", empty), ("group", empty), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0),
        ("low_latency_mode", False), ("num_qps_per_rank", 24),
        ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
        ("explicitly_destroy", False), ("enable_shrink", False), ("comm", None)]
    # the normal mode's (DeepEP's legacy Buffer: same names, order and defaults)
    assert params(deep_ep.Buffer.get_dispatch_layout) == [
        ("self", empty), ("topk_idx", empty), ("num_experts", empty), ("previous_event", None),
        ("async_finish", False), ("allocate_on_comm_stream", False)]
    assert params(deep_ep.Buffer.dispatch) == [
        ("self", empty), ("x", empty), ("handle", None), ("num_tokens_per_rank", None),
        ("num_tokens_per_rdma_rank", None), ("is_token_in_rank", None),
        ("num_tokens_per_expert", None), ("topk_idx", None), ("topk_weights", None),
        ("expert_alignment", 1), ("num_worst_tokens", 0), ("config", None),
        ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)]
    assert params(deep_ep.Buffer.combine) == [
        ("self", empty), ("x", empty), ("handle", empty), ("topk_weights", None), ("bias", None),
        ("config", None), ("previous_event", None), ("async_finish", False),
        ("allocate_on_comm_stream", False)]
    assert params(deep_ep.Config.__init__) == [
        ("self", empty), ("num_sms", 20), ("num_max_nvl_chunked_send_tokens", 6),
        ("num_max_nvl_chunked_recv_tokens", 256), ("num_max_rdma_chunked_send_tokens", 6),
        ("num_max_rdma_chunked_recv_tokens", 256)]
    assert params(deep_ep.Buffer.low_latency_dispatch) == [
        ("self", empty), ("x", empty), ("topk_idx", empty),
        ("num_max_dispatch_tokens_per_rank", empty), ("num_experts", empty),
        ("cumulative_local_expert_recv_stats", None), ("dispatch_wait_recv_cost_stats", None),
        ("use_fp8", True), ("round_scale", False), ("use_ue8m0", False),
        ("async_finish", False), ("return_recv_hook", False)]
    assert params(deep_ep.Buffer.low_latency_combine) == [
        ("self", empty), ("x", empty), ("topk_idx", empty), ("topk_weights", empty),
        ("handle", empty), ("use_logfmt", False), ("zero_copy", False), ("async_finish", False),
        ("return_recv_hook", False), ("out", None), ("combine_wait_recv_cost_stats", None)]
    assert params(deep_ep.Buffer.get_low_latency_rdma_size_hint) == [
        ("num_max_dispatch_tokens_per_rank", empty), ("hidden", empty), ("num_ranks", empty),
        ("num_experts", empty)]
    assert params(deep_ep.Buffer.clean_low_latency_buffer)[1:] == [
        ("num_max_dispatch_tokens_per_rank", empty), ("hidden", empty), ("num_experts", empty)]
    assert params(deep_ep.Buffer.low_latency_update_mask_buffer)[1:] == [
        ("rank_to_mask", empty), ("mask", False)]
    assert params(deep_ep.Buffer.low_latency_query_mask_buffer)[1:] == [("mask_status", empty)]
    assert params(deep_ep.Buffer.low_latency_clean_mask_buffer)[1:] == []
    for name in ("destroy", "is_sm90_compiled", "set_num_sms", "capture", "get_comm_stream",
                 "get_local_buffer_tensor", "get_dispatch_config", "get_combine_config",
                 "get_dispatch_layout", "dispatch", "combine", "internode_dispatch",
                 "internode_combine", "low_latency_update_mask_buffer",
                 "low_latency_query_mask_buffer", "low_latency_clean_mask_buffer",
                 "get_next_low_latency_combine_buffer"):
        assert callable(getattr(deep_ep.Buffer, name)), name


@pytest.mark.skipif(not epx.has_cuda, reason="epx built without CUDA: no sizing function")
def test_size_hint_is_epx_sizing():
    T, H, W, E = 128, 7168, 8, 256
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, H, W, E)
    rows = epx.EpConfig(hidden=H, num_experts=E, topk=epx._epx.MAX_TOPK, max_tokens_per_rank=T,
                        world_size=W, dtype="bf16", layout="expert", scale_layout="column",
                        deterministic=True)
    carrier = rows.replace(hidden=128, layout="token", dtype="bf16", deterministic=False)
    assert hint == 2 * epx.buffer_bytes(rows, "low_latency") + \
        epx.buffer_bytes(carrier, "low_latency")
    # Two rounds of expert rows in (bf16) and out (bf16) dominate: the rest is a few percent.
    expert_rows = 2 * 2 * rows.num_local_experts * rows.capacity * H * 2
    assert expert_rows < hint < 1.1 * expert_rows
    assert deep_ep.Buffer.get_low_latency_rdma_size_hint(2 * T, H, W, E) > hint


def test_constructor_refusals():
    with pytest.raises(NotImplementedError, match="allow_nvlink_for_low_latency_mode=False"):
        deep_ep.Buffer(FakeGroup(), low_latency_mode=True, allow_nvlink_for_low_latency_mode=False)
    with pytest.raises(ValueError, match="group = None and comm = None"):
        deep_ep.Buffer(None)
    with pytest.raises(epx.InputError, match="rounds_in_flight = 3"):
        deep_ep.Buffer(FakeGroup(), rounds_in_flight=3)


def test_normal_mode_needs_nvl_bytes_and_masking_names_the_mode():
    # A Buffer without NVLink bytes and low-latency mode makes no world: the normal mode's
    # communicating calls name num_nvl_bytes (the mode itself: test_cpu_deep_ep_normal.py).
    b = deep_ep.Buffer(FakeGroup(1, 4))
    assert (b.rank, b.group_size, b.low_latency_mode) == (1, 4, False)
    for name in ("dispatch", "combine"):
        with pytest.raises(epx.ConfigError, match=r"Buffer\.%s: num_nvl_bytes = 0, expected > 0"
                                                  % name):
            getattr(b, name)(None, None)
    for name in ("internode_dispatch", "internode_combine"):
        with pytest.raises(NotImplementedError, match=r"Buffer\.%s is not provided: .* across nodes"
                                                      % name):
            getattr(b, name)(None, None)
    for fn in (deep_ep.Buffer.get_dispatch_config, deep_ep.Buffer.get_combine_config):
        assert fn(8).num_sms == deep_ep.Buffer.num_sms
    assert deep_ep.Config(20, 6, 256, 6, 128).num_max_rdma_chunked_recv_tokens == 132  # 22 x 6
    with pytest.raises(ValueError, match="ElasticBuffer: group = None"):
        deep_ep.ElasticBuffer(None)  # V2's buffer: test_cpu_deep_ep_elastic.py
    # The mask calls are low-latency calls: on a normal-mode Buffer they name the flag first,
    # shrink mode or not (a normal-mode Buffer records enable_shrink and makes nothing).
    shrinking = deep_ep.Buffer(FakeGroup(1, 4), enable_shrink=True)
    assert shrinking.enable_shrink and not shrinking.low_latency_mode
    for buf in (b, shrinking):
        for call in (lambda: buf.low_latency_update_mask_buffer(1, True),
                     lambda: buf.low_latency_query_mask_buffer(None),
                     lambda: buf.low_latency_clean_mask_buffer(),
                     lambda: buf.prepare_low_latency_shape(128, 7168, 32, 8)):
            with pytest.raises(epx.ConfigError, match="low_latency_mode = False"):
                call()
    with pytest.raises(NotImplementedError, match="get_local_buffer_tensor"):
        b.get_local_buffer_tensor(None)
    # Low-latency calls on a normal-mode Buffer name the flag.
    with pytest.raises(epx.ConfigError, match="low_latency_mode = False"):
        b.clean_low_latency_buffer(128, 7168, 32)
    with pytest.raises(epx.ConfigError, match="low_latency_mode = False"):
        b.low_latency_dispatch(None, None, 128, 32)
    with pytest.raises(epx.StateError, match="explicitly_destroy = False"):
        b.destroy()
    explicit = deep_ep.Buffer(FakeGroup(), explicitly_destroy=True)
    explicit.destroy()
    with pytest.raises(epx.StateError, match="destroyed"):
        explicit.clean_low_latency_buffer(128, 7168, 32)


def test_statics():
    assert deep_ep.Buffer.is_sm90_compiled() == epx.has_cuda
    deep_ep.Buffer.set_num_sms(24)
    assert deep_ep.Buffer.num_sms == 24
    with pytest.raises(epx.InputError, match="new_num_sms = 7"):
        deep_ep.Buffer.set_num_sms(7)
    deep_ep.Buffer.set_num_sms(20)


class FakeEvent:
    def __init__(self):
        self.waits = 0

    def current_stream_wait(self):
        self.waits += 1


def test_event_overlap():
    ev = FakeEvent()
    overlap = deep_ep.EventOverlap(ev, extra_tensors=("kept",))
    calls = []
    overlap.register_hook_after_wait(lambda: calls.append(1))
    with pytest.raises(epx.StateError, match="registered already"):
        overlap.register_hook_after_wait(lambda: None)
    overlap.current_stream_wait()
    overlap.current_stream_wait()
    assert ev.waits == 2 and calls == [1] and overlap.extra_tensors == ("kept",)
    with overlap(release_handle=True):
        pass
    assert ev.waits == 3 and overlap.event is None
    with overlap:  # nothing left to wait for
        pass
    with pytest.raises(epx.StateError, match="event = None"):
        deep_ep.EventOverlap().current_stream_wait()


def test_hook_runs_its_receive_half_once():
    from epx.deep_ep._common import _Hook

    runs = []
    hook = _Hook(lambda: runs.append(1))
    hook()
    hook()
    assert runs == [1]


def test_handle_is_deepeps_tuple():
    from epx.deep_ep._low_latency import _Handle

    h = _Handle(("src_info", "layout_range", 128, 7168, 32), None, None, 0, 1, 5)
    src_info, layout_range, tokens, hidden, experts = h
    assert isinstance(h, tuple) and len(h) == 5 and (tokens, hidden, experts) == (128, 7168, 32)
    assert h[0] == "src_info" and h[1] == "layout_range"


def test_install_as_deep_ep(monkeypatch):
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    deep_ep.install_as_deep_ep()
    import deep_ep as alias

    assert alias is deep_ep
    deep_ep.install_as_deep_ep()  # twice is fine
    monkeypatch.setitem(sys.modules, "deep_ep", type(sys)("deep_ep"))
    with pytest.raises(ImportError, match="already imported"):
        deep_ep.install_as_deep_ep()


def test_topk_idx_t_is_int64():
    torch = pytest.importorskip("torch")
    assert deep_ep.topk_idx_t == torch.int64
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        deep_ep.nothing


# ---- the runner's package --------------------------------------------------------------------


def fake_checkout(root: Path) -> Path:
    """The parts of a DeepEP tree the runner reads, with placeholder contents."""
    (root / "deep_ep" / "utils").mkdir(parents=True)
    (root / "deep_ep" / "utils" / "__init__.py").write_text("")
    (root / "deep_ep" / "utils" / "envs.py").write_text("MARK = 'checkout utils'\n")
    (root / "tests" / "legacy").mkdir(parents=True)
    return root


def test_assembled_package(tmp_path):
    checkout = fake_checkout(tmp_path / "DeepEP")
    pkg = deepep_shim.assemble(checkout, tmp_path / "out")
    assert (pkg / "utils").is_symlink()
    assert (pkg / "utils").resolve() == (checkout / "deep_ep" / "utils").resolve()
    # deep_ep is epx's Buffer, deep_ep.utils the checkout's, deep_ep._C the stand-in.
    code = ("import sys, deep_ep, deep_ep.utils.envs as envs, deep_ep._C as C, epx.deep_ep;"
            "assert deep_ep.Buffer is epx.deep_ep.Buffer;"
            "assert deep_ep.EventOverlap is epx.deep_ep.EventOverlap;"
            "assert C.EventHandle is epx.deep_ep.EventHandle;"
            "assert envs.MARK == 'checkout utils';"
            "assert 'torch' not in sys.modules;"
            "print('ok')")
    env = {"PYTHONPATH": f"{tmp_path / 'out'}:{':'.join(sys.path)}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    with pytest.raises(ValueError, match="deep_ep/utils/__init__.py is missing"):
        deepep_shim.assemble(tmp_path / "nothing", tmp_path / "out2")


def test_runner_assemble_only(tmp_path):
    checkout = fake_checkout(tmp_path / "DeepEP")
    out = subprocess.run([sys.executable, str(COMPAT / "run_deepep_low_latency.py"),
                          str(checkout), "--assemble-only", str(tmp_path / "pkg")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "test_low_latency.py --num-processes 2 --num-tokens 128" in out.stdout
    assert (tmp_path / "pkg" / "deep_ep" / "__init__.py").exists()


def test_runner_runs_any_test_file(tmp_path):
    checkout = fake_checkout(tmp_path / "DeepEP")
    runner = str(COMPAT / "run_deepep_low_latency.py")
    (checkout / "tests" / "legacy" / "test_intranode.py").write_text("")
    out = subprocess.run([sys.executable, runner, str(checkout), "--test",
                          "tests/legacy/test_intranode.py", "--assemble-only",
                          str(tmp_path / "pkg")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "EPX_DEEP_EP_MAX_TOKENS=4096 " in out.stdout, out.stdout
    assert f"{checkout / 'tests' / 'legacy'}:" in out.stdout, out.stdout  # its sibling imports
    assert "test_intranode.py --num-processes 2 --num-tokens 4096 --hidden 7168 --num-topk 8 " \
           "--num-experts 256" in out.stdout, out.stdout
    out = subprocess.run([sys.executable, runner, str(checkout), "--test", "tests/nothing.py",
                          "--assemble-only", str(tmp_path / "pkg2")], capture_output=True,
                         text=True)
    assert out.returncode != 0 and "--test tests/nothing.py: no such file" in out.stderr
    # A run: the test is __main__ with its folder on the path, deep_ep is epx's, and the verdict
    # line names the file.
    (checkout / "tests" / "legacy" / "sibling.py").write_text("VALUE = 7\n")
    (checkout / "tests" / "legacy" / "test_fake.py").write_text(
        "import os, sys, sibling, deep_ep, epx.deep_ep\n"
        "assert __name__ == '__main__' and deep_ep.Buffer is epx.deep_ep.Buffer\n"
        "assert sys.argv[1:] == ['--num-tokens', '12'], sys.argv\n"
        "assert os.environ['EPX_DEEP_EP_MAX_TOKENS'] == '12' and sibling.VALUE == 7\n")
    env = {k: v for k, v in os.environ.items() if k != "EPX_DEEP_EP_MAX_TOKENS"}
    env["PYTHONPATH"] = ":".join(sys.path)
    out = subprocess.run([sys.executable, runner, str(checkout), "--mode", "gpu-per-rank",
                          "--test", str(checkout / "tests" / "legacy" / "test_fake.py"), "--",
                          "--num-tokens", "12"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1] == "deepep_fake: 1 passed, 0 failed"


def test_runner_defaults_for_the_elastic_test(tmp_path):
    """V2's tests/elastic/test_ep.py: 2 processes, 256 tokens, its performance part skipped (it
    times DeepEP's kernels by name)."""
    checkout = fake_checkout(tmp_path / "DeepEP")
    (checkout / "tests" / "elastic").mkdir()
    (checkout / "tests" / "elastic" / "test_ep.py").write_text("")
    out = subprocess.run([sys.executable, str(COMPAT / "run_deepep_low_latency.py"),
                          str(checkout), "--test", "tests/elastic/test_ep.py", "--assemble-only",
                          str(tmp_path / "pkg")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "test_ep.py --num-processes 2 --num-tokens 256 --skip-perf-test\n" in out.stdout, \
        out.stdout
    code = ("import deep_ep, epx.deep_ep;"
            "assert deep_ep.ElasticBuffer is epx.deep_ep.ElasticBuffer;"
            "print('ok')")
    env = {"PYTHONPATH": f"{tmp_path / 'pkg'}:{':'.join(sys.path)}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_staged_collectives_keep_rows(tmp_path):
    """all_to_all_single of the one-GPU mode sends bytes: rows of any dtype keep their split."""
    torch = pytest.importorskip("torch")
    out = torch.arange(3, dtype=torch.int32)
    view = deepep_shim.as_bytes(out)
    assert view.shape == (3, 4) and view.dtype == torch.uint8
    view[1] = torch.tensor([9, 0, 0, 0], dtype=torch.uint8)
    assert out.tolist() == [0, 9, 2]
    assert deepep_shim.as_bytes(torch.zeros(0, 5, dtype=torch.bfloat16)).shape == (0, 10)


def test_runner_shrink_flag(tmp_path):
    checkout = fake_checkout(tmp_path / "DeepEP")
    runner = str(COMPAT / "run_deepep_low_latency.py")
    out = subprocess.run([sys.executable, runner, str(checkout), "--shrink", "--assemble-only",
                          str(tmp_path / "pkg")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "test_low_latency.py --num-processes 8 --num-tokens 128 --hidden 7168 --num-topk 8 " \
           "--num-experts 32 --shrink-test" in out.stdout, out.stdout
    assert f"{deepep_shim.SHAPES_ENV}=128,7168,32,8" in out.stdout, out.stdout
    # Given arguments keep theirs; --shrink adds the test's flag, the shape follows them (and
    # the test's own defaults where absent).
    out = subprocess.run([sys.executable, runner, str(checkout), "--shrink", "--assemble-only",
                          str(tmp_path / "pkg2"), "--", "--num-processes", "6", "--hidden",
                          "2048"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "test_low_latency.py --num-processes 6 --hidden 2048 --shrink-test" in out.stdout
    assert f"{deepep_shim.SHAPES_ENV}=128,2048,288,8" in out.stdout, out.stdout
    out = subprocess.run([sys.executable, runner, str(checkout), "--assemble-only",
                          str(tmp_path / "pkg3")], capture_output=True, text=True)
    assert out.returncode == 0 and deepep_shim.SHAPES_ENV not in out.stdout, out.stdout


def test_preparing_buffer_makes_the_shapes_in_its_constructor(tmp_path):
    made = []

    class Base:
        """the base's doc"""

        def __init__(self, group, low_latency_mode=False, **kwargs):
            self.low_latency_mode = low_latency_mode

        def prepare_low_latency_shape(self, *args, **kwargs):
            made.append((args, kwargs))

    Prepared = deepep_shim.preparing_buffer(Base, "64,2048,16,4")
    assert issubclass(Prepared, Base) and Prepared.__name__ == "Base"
    Prepared(None)  # normal mode: no shapes
    assert made == []
    Prepared(None, low_latency_mode=True)
    assert made == [((64, 2048, 16, 4), {"use_fp8": False}), ((64, 2048, 16, 4), {"use_fp8": True}),
                    ((64, 2048, 16, 4), {"use_fp8": True, "round_scale": True})]
    for bad in ("64,2048,16", "64,2048,16,x", ""):
        with pytest.raises(ValueError, match=deepep_shim.SHAPES_ENV):
            deepep_shim.preparing_buffer(Base, bad)
    # The assembled package uses it when the variable is set.
    checkout = fake_checkout(tmp_path / "DeepEP")
    deepep_shim.assemble(checkout, tmp_path / "out")
    code = ("import deep_ep, epx.deep_ep;"
            "assert deep_ep.Buffer is not epx.deep_ep.Buffer;"
            "assert issubclass(deep_ep.Buffer, epx.deep_ep.Buffer);"
            "print('ok')")
    env = {"PYTHONPATH": f"{tmp_path / 'out'}:{':'.join(sys.path)}",
           deepep_shim.SHAPES_ENV: "128,7168,32,8"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_ranks_of_several_nodes_make_an_nccl_world(monkeypatch):
    """epx.deep_ep's world: an NcclWorld when the launcher's LOCAL_WORLD_SIZE puts the group's
    ranks on several nodes, else an IpcWorld; and the runner's emulated nodes set what NCCL and
    epx read in each process."""
    from epx.deep_ep._common import nodes_of

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert nodes_of(4) == 0
    for env, size, want in [("2", 4, 2), ("4", 4, 0), ("8", 4, 0), ("3", 4, 0), ("x", 4, 0),
                            ("1", 2, 1)]:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", env)
        assert nodes_of(size) == want, (env, size)
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "NCCL_HOSTID", "NCCL_NVLS_ENABLE",
                 deepep_shim.NODES_ENV):
        monkeypatch.delenv(name, raising=False)
    deepep_shim.emulate_node(3, 4)  # no emulated nodes asked for: nothing set
    assert "NCCL_HOSTID" not in os.environ
    monkeypatch.setenv(deepep_shim.NODES_ENV, "2")
    deepep_shim.emulate_node(3, 4)
    assert (os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("2", "1")
    assert os.environ["NCCL_HOSTID"] == "epx-emulated-3"
