"""DeepEP's normal (high-throughput) mode, which epx.deep_ep does not provide yet: its launch
configuration (Config) and the Buffer methods of that mode, each refusing with
NotImplementedError naming the call. An implementation replaces these, as a mixin of Buffer
beside the low-latency one (_low_latency.py)."""

from __future__ import annotations

from ._common import _unsupported


def _normal_mode(name: str):
    return _unsupported(
        f"Buffer.{name} (DeepEP's normal, high-throughput mode)",
        "epx.deep_ep implements the low-latency mode (low_latency_dispatch / "
        "low_latency_combine); epx has no high-throughput (prefill) backend to serve it yet",
    )


class Config:
    """DeepEP's launch configuration of the normal mode, which epx.deep_ep does not provide."""

    def __init__(self, *args, **kwargs):
        raise _normal_mode("Config")


class _NormalMode:
    """Buffer's methods of DeepEP's normal mode."""

    @staticmethod
    def get_dispatch_config(num_ranks: int):
        raise _normal_mode("get_dispatch_config")

    @staticmethod
    def get_combine_config(num_ranks: int):
        raise _normal_mode("get_combine_config")

    def get_dispatch_layout(self, *args, **kwargs):
        raise _normal_mode("get_dispatch_layout")

    def dispatch(self, *args, **kwargs):
        raise _normal_mode("dispatch")

    def combine(self, *args, **kwargs):
        raise _normal_mode("combine")

    def internode_dispatch(self, *args, **kwargs):
        raise _normal_mode("internode_dispatch")

    def internode_combine(self, *args, **kwargs):
        raise _normal_mode("internode_combine")
