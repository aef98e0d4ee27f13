"""tools/vllm's stand-ins for what a vLLM bundle lacks on a torch other than the one vLLM's wheel
was built for, without vLLM: the torch compatibility they add. Needs torch (skipped without
it); no GPU, no vLLM."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")


def test_bundle_torch_compat_for_an_older_torch(monkeypatch):
    """On a torch whose built-in Stream lacks is_capturing (torch 2.11), the stand-ins give CUDA
    streams one and make torch.accelerator.current_stream() return torch.cuda's stream object;
    on a torch that has it, they change nothing. Shown on a model of such a torch."""
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "vllm"))
    import _epx_vllm_ops as ops

    class BuiltinStream:  # torch.Stream of torch 2.11: no is_capturing
        def __init__(self, kind):
            self.device = SimpleNamespace(type=kind)

    class CudaStream(BuiltinStream):
        pass

    capturing = []
    old = SimpleNamespace(
        Stream=BuiltinStream,
        accelerator=SimpleNamespace(current_stream=lambda device=None: BuiltinStream("cuda")),
        cuda=SimpleNamespace(Stream=CudaStream, current_stream=lambda device: CudaStream("cuda"),
                             is_current_stream_capturing=lambda: bool(capturing)))
    monkeypatch.setattr(ops, "torch", old)
    ops._torch_compat()
    s = old.accelerator.current_stream()
    assert isinstance(s, CudaStream) and s.is_capturing() is False
    capturing.append(1)
    assert s.is_capturing() is True
    assert not hasattr(BuiltinStream("cpu"), "is_capturing")
    # A torch that has it keeps its own (a model too: the installed torch may be either).
    class NewStream(BuiltinStream):
        def is_capturing(self):
            return False

    class NewCudaStream(NewStream):
        pass

    current = lambda device=None: NewStream("cuda")  # noqa: E731
    new = SimpleNamespace(
        Stream=NewStream, accelerator=SimpleNamespace(current_stream=current),
        cuda=SimpleNamespace(Stream=NewCudaStream, current_stream=lambda device: NewCudaStream("cuda"),
                             is_current_stream_capturing=lambda: False))
    monkeypatch.setattr(ops, "torch", new)
    ops._torch_compat()
    assert new.accelerator.current_stream is current
    assert "is_capturing" not in vars(NewCudaStream)
