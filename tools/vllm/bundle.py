#!/usr/bin/env python3
"""Makes a vLLM bundle: what a machine without network needs to import vLLM's fused-MoE modular
kernel (vllm.model_executor.layers.fused_moe) and run it with epx.

    tools/vllm/bundle.sh [VERSION] [--python 3.12] [--out .vllm]

On a machine that reaches PyPI, it downloads vLLM's wheel (VERSION, default 0.34.0) and writes
into OUT (default .vllm in the repository root, ignored by git):

- site.zip: vLLM's Python tree (its .py and .json files) with its dist-info (vLLM's platform
  detection reads its own version: without the dist-info it says "The vLLM package was not
  found", picks no platform, and its Triton check fails the same way, see below), none of its
  compiled files, and stand-ins for the compiled extension modules that its import of CUDA
  platform code needs (vllm._C, vllm._C_stable_libtorch, vllm._moe_C,
  vllm._moe_C_stable_libtorch): each defines, through tools/vllm/_epx_vllm_ops.py, the torch
  operators of ``torch.ops._C`` that the experts call (silu_and_mul, masked_moe_activation,
  per_token_group_fp8_quant, ...), where the torch in use lacks them.
- wheels/: the wheels (for --python, manylinux x86_64) of the packages vLLM's fused-MoE import
  needs beyond torch, triton, numpy, transformers and their dependencies (psutil, pyzmq,
  pydantic, msgspec, xgrammar, ...). tools/vllm/bundle_env.py puts them last on sys.path, so a
  machine's own copy of a package wins.
- BUNDLE.json: the vLLM version, the Python version, the wheels.

vLLM's Triton check (vllm/triton_utils/importing.py) runs ``from triton.backends import
backends`` and ``vllm_version_matches_substr("cpu")`` in one ``try`` and reports any ImportError
as "Triton is installed, but `triton.backends` could not be imported". The second call raises
importlib.metadata.PackageNotFoundError (an ImportError) when vLLM's dist-info is missing; with
the dist-info in site.zip the check passes and Triton stays on (it also wants exactly one active
Triton driver, which a machine with a CUDA GPU has).

None of vLLM's files are kept in the repository: the bundle is made where it is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

# Distributions vLLM's fused-MoE import needs that a machine with torch, triton, numpy and
# transformers (and so filelock, packaging, pyyaml, regex, tqdm, tokenizers, safetensors,
# huggingface_hub, jinja2, pillow through torchvision) may lack. Versions follow vLLM's own
# requirements where it states them.
DEPS = [
    "psutil", "pyzmq", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
    "msgspec", "cbor2", "pybase64", "cachetools", "cloudpickle", "uvloop", "py-cpuinfo",
    "prometheus-client", "aiohttp", "aiohappyeyeballs", "aiosignal", "frozenlist", "multidict",
    "yarl", "propcache", "attrs", "requests", "urllib3", "certifi", "charset-normalizer", "idna",
    "llguidance", "xgrammar", "apache-tvm-ffi",
]

# What vLLM 0.33's fused-MoE import needs on top (its reasoning parsers import the server's tool
# code: openai, fastapi, harmony, tracing; openai 3 talks through httpx2).
DEPS_BEFORE_0_34 = [
    "oss-harmony", "openai", "jiter", "distro", "fastapi", "starlette", "annotated-doc",
    "sniffio", "partial-json-parser", "einops", "opentelemetry-api", "opentelemetry-sdk",
    "opentelemetry-semantic-conventions", "importlib-metadata", "zipp",
    "httpx2", "httpcore2", "truststore", "h11", "anyio",
]

# vLLM's compiled extension modules that its imports need, as stand-ins.
STUBS = ["_C", "_C_stable_libtorch", "_moe_C", "_moe_C_stable_libtorch"]
STUB_TEXT = '''"""Stands in for vLLM's compiled extension module vllm.{name} in a bundle made by epx's
tools/vllm/bundle.sh (the wheel's compiled files are not in the bundle): it defines the torch
operators of torch.ops._C that vLLM's fused-MoE experts call, where torch lacks them."""

import _epx_vllm_ops

_epx_vllm_ops.register()
'''

# The flash-attention extension modules whose presence vLLM 0.33's attention code checks at
# import on a GPU (the fused-MoE kernel imports that code, never calls it).
FA_STUBS = ["_vllm_fa2_C"]
FA_STUB_TEXT = '''"""Stands in for vLLM's compiled flash-attention module vllm.vllm_flash_attn.{name} in a
bundle made by epx's tools/vllm/bundle.sh, so that vLLM's attention modules import. It defines no
operator: attention cannot run from the bundle (its fused-MoE kernel does not need it)."""
'''

KEEP_SUFFIXES = (".py", ".json")
# Parts of vLLM's tree that its fused-MoE kernel never imports, left out for size: the model
# implementations, the benchmarks, and the third-party kernels whose compiled parts
# are not in the bundle anyway (their Python alone would look usable).
DROP_PREFIXES = ("vllm/models/", "vllm/benchmarks/",
                 "vllm/third_party/deep_gemm/", "vllm/third_party/fmha_sm100/",
                 "vllm/third_party/tml_fa4/", "vllm/third_party/flashmla/")
DROP_DIST_INFO = ("RECORD",)


def _pip_download(names, dest: Path, python: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp",
           "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_27_x86_64",
           "--platform", "manylinux_2_24_x86_64", "--platform", "manylinux_2_17_x86_64",
           "--platform", "manylinux2014_x86_64", "-d", str(dest)] + list(names)
    subprocess.run(cmd, check=True)


def _requirements(metadata: str) -> dict:
    """Requires-Dist of vLLM's METADATA: normalised name -> specifier (no markers, extras)."""
    reqs = {}
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        spec = line.split(":", 1)[1].split(";", 1)[0].strip()
        if "extra ==" in line:
            continue
        m = re.match(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)", spec)
        if m:
            reqs[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(3).strip()
    return reqs


def make_site_zip(wheel: Path, out: Path) -> dict:
    kept = dropped = 0
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED,
                                                        compresslevel=9) as dst:
        names = src.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        metadata = src.read(f"{dist_info}/METADATA").decode()
        for n in names:
            top = n.split("/")[0]
            if n.startswith(DROP_PREFIXES) or n.rsplit("/", 1)[-1] in DROP_DIST_INFO:
                dropped += 1
            elif top == dist_info or (top == "vllm" and n.endswith(KEEP_SUFFIXES)):
                dst.writestr(n, src.read(n))
                kept += 1
            else:
                dropped += 1
        for name in STUBS:
            dst.writestr(f"vllm/{name}.py", STUB_TEXT.format(name=name))
        if "vllm/vllm_flash_attn/__init__.py" in names:
            for name in FA_STUBS:
                dst.writestr(f"vllm/vllm_flash_attn/{name}.py", FA_STUB_TEXT.format(name=name))
        dst.write(HERE / "_epx_vllm_ops.py", "_epx_vllm_ops.py")
    return {"dist_info": dist_info, "metadata": metadata, "kept": kept, "dropped": dropped}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", nargs="?", default="0.34.0")
    parser.add_argument("--python", default="3.12", help="the target's Python (default 3.12)")
    parser.add_argument("--out", type=Path, default=REPO / ".vllm")
    parser.add_argument("--share-wheels", type=Path, default=None, metavar="BUNDLE",
                        help="leave out the wheels that BUNDLE (another bundle, e.g. .vllm) holds "
                             "already, byte for byte; bundle_env takes them from there, so that two "
                             "bundles travel together in less room")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    (out / "wheels").mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="epx-vllm-") as tmp:
        tmp = Path(tmp)
        _pip_download([f"vllm=={args.version}"], tmp, args.python)
        wheel = next(tmp.glob("vllm-*.whl"))
        info = make_site_zip(wheel, out / "site.zip")
    reqs = _requirements(info["metadata"])
    release = tuple(int(p) for p in re.findall(r"\d+", args.version)[:2])
    for d in DEPS + (DEPS_BEFORE_0_34 if release < (0, 34) else []):
        try:
            _pip_download([f"{d}{reqs.get(d, '')}"], out / "wheels", args.python)
        except subprocess.CalledProcessError:  # vLLM's pin not served: the newest there is
            print(f"vllm bundle: {d}{reqs.get(d, '')} not found, taking {d}", flush=True)
            _pip_download([d], out / "wheels", args.python)
    wheels = sorted(p.name for p in (out / "wheels").glob("*.whl"))
    shared = []
    if args.share_wheels is not None:
        other = args.share_wheels.resolve() / "wheels"
        for name in wheels:
            mine, theirs = out / "wheels" / name, other / name
            if theirs.exists() and theirs.read_bytes() == mine.read_bytes():
                mine.unlink()
                shared.append(name)
    (out / "BUNDLE.json").write_text(json.dumps({
        "vllm": args.version, "python": args.python, "dist_info": info["dist_info"],
        "files_kept": info["kept"], "files_dropped": info["dropped"], "wheels": wheels,
        # wheels left out: in this bundle's sibling folder of that name, relative to it
        "shared_wheels": {"from": os.path.relpath(args.share_wheels.resolve(), out),
                          "names": shared} if shared else None,
    }, indent=1) + "\n")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"vllm bundle: vLLM {args.version} for Python {args.python} in {out} "
          f"({size / 2**20:.1f} MiB: site.zip and {len(wheels)} wheels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
