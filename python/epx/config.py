"""Configurations: EpConfig and MoeShape by keyword, launch shapes by keyword, JSON text, a JSON
file or EPX_CONFIG_PATH, and the process environment (EPX_BACKEND, EPX_TIMEOUT_MS).

Every rule is the library's: values go through EpConfig::validate(), parse_launch_configs() and
read_env(), so Python accepts and refuses exactly what the C++ API and the ``epx`` CLI do, with
the same messages (epx.ConfigError names the field or key, the value and the bound).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

from . import _epx

EpConfig = _epx.EpConfig
LaunchConfig = _epx.LaunchConfig
LaunchConfigs = _epx.LaunchConfigs

DEFAULT_BACKEND = "low_latency"
BACKENDS = ("naive", "allgather_reducescatter", "low_latency", "high_throughput")


def ep_config(**fields: Any) -> EpConfig:
    """EpConfig(**fields), validated: ConfigError names the first impossible field.

    Keys: rank, world_size, hidden, num_experts, topk, max_tokens_per_rank, dtype ('bf16',
    'fp8', 'bf16-to-fp8'), scale_layout ('row', 'column'), round_scale (bf16-to-fp8: power-of-two
    scales, DeepEP's round_scale), layout ('token', 'expert'),
    deterministic, rounds_in_flight (1, or 2: the next round's dispatch before this round's
    combine), mask_failed_ranks (a peer that times out is masked, not fatal), worst_case_output
    (high_throughput's receive areas for every row; required for that backend from Python),
    combine ('auto', 'pull', 'push': how combine moves the partials), combine_format ('bf16',
    'logfmt': what the partials cross as; 'logfmt' is low_latency's LogFMT-10 rows, DeepEP's
    use_logfmt), combine_order ('rank', 'highest_slot': the order of combine's sum; 'highest_slot'
    adds each rank at its highest top-k slot of the token, DeepEP V2's order, high_throughput
    only), timeout_ms. Worlds set rank and world_size per rank, so they may be left out.
    """
    cfg = EpConfig(**fields)
    cfg.validate()
    return cfg


def launch_configs(
    dispatch: Optional[Mapping[str, int]] = None,
    combine: Optional[Mapping[str, int]] = None,
    **sections: Mapping[str, int],
) -> LaunchConfigs:
    """Launch shapes by keyword, read exactly as the JSON file would be.

    ``launch_configs(dispatch={"num_blocks": 64}, combine={"warps_per_block": 8})``; a
    ``global`` section (a Python keyword, so pass it as ``**{"global": {...}}`` or ``global_=``)
    fills what an op leaves unset. The alias keys ``block_num`` / ``warp_num_per_block`` are
    accepted; unknown keys and out-of-range values raise ConfigError.
    """
    doc: dict = {}
    for key, value in sections.items():
        name = "global" if key == "global_" else key
        if name != "global":
            raise _epx.ConfigError(
                f"launch_configs key = '{key}', expected dispatch, combine or global"
            )
        doc["global"] = dict(value)
    if dispatch is not None:
        doc["dispatch"] = dict(dispatch)
    if combine is not None:
        doc["combine"] = dict(combine)
    return _epx.parse_launch_configs(json.dumps(doc), "launch_configs() keyword arguments")


def launch_configs_from_json(text: str, origin: str = "<json text>") -> LaunchConfigs:
    """Parses launch JSON; ConfigError names `origin`, the key and the allowed range."""
    return _epx.parse_launch_configs(text, origin)


def launch_configs_from_file(path: "os.PathLike[str] | str") -> LaunchConfigs:
    """Reads a launch file as ``epx tune`` writes it (DESIGN §6)."""
    return _epx.load_launch_configs(os.fspath(path))


def launch_configs_from_env() -> Optional[LaunchConfigs]:
    """The file named by EPX_CONFIG_PATH, or None when it is unset."""
    path = _epx.read_env()["config_path"]
    return None if path is None else _epx.load_launch_configs(path)


def env() -> dict:
    """EPX_BACKEND, EPX_TIMEOUT_MS and EPX_CONFIG_PATH, parsed (None when unset)."""
    return _epx.read_env()


def check_backend_config(backend: str, config: EpConfig, world=None) -> None:
    """What a backend needs of a config from Python, before any collective: the package's
    tensors keep one shape (the custom ops describe them from the config alone), so
    high_throughput must hold its receive areas for the worst case (worst_case_output=True),
    except across nodes (an NcclWorld of several nodes), where its areas keep that shape either
    way and worst_case_output=False moves exact sizes (its counts read on the host, no graphs)."""
    across_nodes = getattr(world, "num_nodes", 1) > 1
    if backend == "high_throughput" and not config.worst_case_output and not across_nodes:
        raise _epx.ConfigError(
            "worst_case_output = False, expected True for backend high_throughput from Python "
            "(its tensors keep one shape, world_size x max_tokens_per_rank rows; C++ callers and "
            "NcclWorlds of several nodes may size them per call)"
        )


def backend_from_env(default: str = DEFAULT_BACKEND) -> str:
    """EPX_BACKEND's backend, else `default`; ConfigError for an unknown name."""
    name = _epx.read_env()["backend"]
    return _epx.parse_backend(default) if name is None else name


def with_env_timeout(cfg: EpConfig) -> EpConfig:
    """`cfg` with timeout_ms from EPX_TIMEOUT_MS when that is set."""
    t = _epx.read_env()["timeout_ms"]
    return cfg if t is None else cfg.replace(timeout_ms=t)


def buffer_bytes(config: EpConfig, backend: str = DEFAULT_BACKEND) -> int:
    """Bytes of device memory one rank's All2All needs for `config` (the library's sizing)."""
    if not _epx.has_cuda:
        raise _epx.UnsupportedError("buffer_bytes: this epx was built without CUDA")
    return _epx.buffer_bytes(backend, config)
