"""The client's upload body: zero-copy chunks that rebuild the bytes, sent whole through a real coordinator.

httpx given one large `bytes` body copies the unsent rest after every partial socket send (quadratic in
the body size); the client streams `upload_chunks` views with an explicit Content-Length instead.
"""

from __future__ import annotations

import hashlib
import os

import pytest

from coordinator.blobs import BlobStore
from coordinator.client import CoordinatorClient, CoordinatorHTTPError, upload_chunks


@pytest.mark.parametrize(("size", "chunk"), [(0, 4), (1, 4), (4, 4), (10, 4), (10, 3), (4096, 1000)])
def test_upload_chunks_rebuild_the_bytes_within_the_chunk_size(size, chunk):
    data = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    parts = list(upload_chunks(data, chunk))
    assert b"".join(parts) == data
    assert all(isinstance(p, memoryview) and 0 < len(p) <= chunk for p in parts)
    assert len(parts) == -(-size // chunk)  # ceil: only the last part is short


def test_upload_chunks_refuse_a_non_positive_size():
    with pytest.raises(ValueError, match="chunk_bytes"):
        list(upload_chunks(b"abc", 0))


def test_put_blob_of_many_chunks_arrives_whole_and_verified(env):
    data = os.urandom((3 << 20) + 12345)  # 3 full 1 MiB chunks and a short one
    sha = hashlib.sha256(data).hexdigest()
    with CoordinatorClient(env.url, env.settings.admin_token.get_secret_value(), attempts=1) as client:
        info = client.put_blob(sha, data)
        assert (info.sha256, info.bytes) == (sha, len(data))
        assert client.get_blob(sha) == data
        bad = hashlib.sha256(data + b"x").hexdigest()  # the server hashes what arrived: a wrong claim is refused
        with pytest.raises(CoordinatorHTTPError) as refused:
            client.put_blob(bad, data)
        assert refused.value.status == 422 and "does not match" in str(refused.value)
    assert BlobStore(env.settings.blob_dir).path(sha).read_bytes() == data
    assert not BlobStore(env.settings.blob_dir).exists(bad)
