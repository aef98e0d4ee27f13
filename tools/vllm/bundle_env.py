"""Puts a vLLM bundle (tools/vllm/bundle.sh) on sys.path:

    import bundle_env; bundle_env.activate()        # or activate("/path/to/.vllm")

The bundle's folder is the argument, else $EPX_VLLM_BUNDLE, else .vllm in the repository root.
site.zip is unpacked into <bundle>/site and the wheels into <bundle>/deps (once; again when the
bundle changes). <bundle>/site goes first on sys.path (vLLM and its stand-ins), <bundle>/deps
last (a package the machine has wins). Processes started with multiprocessing's spawn get the
same sys.path from their parent.
"""

from __future__ import annotations

import json
import os
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent


def bundle_dir(path=None) -> Path:
    return Path(path or os.environ.get("EPX_VLLM_BUNDLE") or REPO / ".vllm").resolve()


def _unpack(bundle: Path) -> None:
    stamp = bundle / "BUNDLE.json"
    done = bundle / ".unpacked"
    if done.exists() and done.read_text() == stamp.read_text():
        return
    with zipfile.ZipFile(bundle / "site.zip") as z:
        z.extractall(bundle / "site")
    wheels = sorted((bundle / "wheels").glob("*.whl"))
    shared = json.loads(stamp.read_text()).get("shared_wheels")
    if shared:  # (bundle.sh --share-wheels: the rest are in another bundle)
        source = (bundle / shared["from"] / "wheels").resolve()
        for name in shared["names"]:
            if not (source / name).exists():
                raise FileNotFoundError(f"vLLM bundle {bundle}: wheel {name} is shared with "
                                        f"{source.parent}, which lacks it")
            wheels.append(source / name)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(bundle / "deps")
    done.write_text(stamp.read_text())


def activate(path=None) -> dict:
    """Unpacks (if needed) and puts the bundle on sys.path; returns its BUNDLE.json."""
    bundle = bundle_dir(path)
    if not (bundle / "BUNDLE.json").exists():
        raise FileNotFoundError(f"no vLLM bundle at {bundle} (make one with "
                                "tools/vllm/bundle.sh, or set EPX_VLLM_BUNDLE)")
    _unpack(bundle)
    site, deps = str(bundle / "site"), str(bundle / "deps")
    if site not in sys.path:
        sys.path.insert(0, site)
    if deps not in sys.path:
        sys.path.append(deps)
    return json.loads((bundle / "BUNDLE.json").read_text())
