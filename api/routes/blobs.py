"""Content-addressed blobs (weight shards, batches): upload (admin), download with ETag and Range."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Request, Response
from fastapi.responses import FileResponse, JSONResponse

from api.deps import Admin, MetricsD, Reader, ShaP, StoreD
from coordinator.errors import NotFound
from wire.messages import BlobInfo

router = APIRouter(prefix="/v1/blobs")


class _CountingFileResponse(FileResponse):
    """FileResponse that counts the body bytes actually sent (full file or Range parts).

    Sends 4 MiB per ASGI message instead of Starlette's 64 KiB: a 250 MB weight shard is then 60 messages, not
    4,000 (each costs a Python round trip through the server loop)."""

    chunk_size = 4 << 20

    def __init__(self, *args, counter, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._counter = counter

    async def __call__(self, scope, receive, send) -> None:
        async def counting_send(message) -> None:
            if message["type"] == "http.response.body":
                self._counter.inc(len(message.get("body", b"")))
            await send(message)

        await super().__call__(scope, receive, counting_send)


async def _upload(request: Request, expected: str | None) -> JSONResponse:
    state = request.app.state
    writer = state.store.blobs.writer(expected)
    try:
        async for chunk in request.stream():
            writer.write(chunk)
        sha, size = writer.commit()
    finally:
        writer.abort()
    state.metrics.blob_bytes_stored.inc(size)
    return JSONResponse(BlobInfo(sha256=sha, bytes=size).model_dump(), status_code=201)


@router.post("", status_code=201, dependencies=[Admin], response_model=BlobInfo)
async def upload_blob(
    request: Request, x_content_sha256: Annotated[str | None, Header(pattern=r"^[0-9a-f]{64}$")] = None
) -> JSONResponse:
    """Upload raw bytes (any content type); `X-Content-SHA256`, if given, must match."""
    return await _upload(request, x_content_sha256)


@router.put("/{sha256}", status_code=201, dependencies=[Admin], response_model=BlobInfo)
async def put_blob(request: Request, sha256: ShaP) -> JSONResponse:
    """Upload raw bytes that must hash to `sha256`."""
    return await _upload(request, sha256)


@router.head("/{sha256}", dependencies=[Reader])
def head_blob(sha256: ShaP, store: StoreD) -> Response:
    """200 with the blob's Content-Length if it is stored, else 404 (a trainer that wrote a shard into a shared
    blob directory checks here that the coordinator sees it)."""
    if not store.blobs.exists(sha256):
        raise NotFound(f"no blob {sha256}")
    return Response(status_code=200, headers={"content-length": str(store.blobs.size(sha256)), "etag": f'"{sha256}"'})


@router.get("/{sha256}", dependencies=[Reader])
def get_blob(
    sha256: ShaP, store: StoreD, metrics: MetricsD, if_none_match: Annotated[str | None, Header()] = None
) -> Response:
    """Stream a blob; ETag is the quoted sha256; Range requests give 206; unknown hashes 404."""
    if not store.blobs.exists(sha256):
        raise NotFound(f"no blob {sha256}")
    etag = f'"{sha256}"'
    headers = {"etag": etag, "cache-control": "public, max-age=31536000, immutable"}
    if if_none_match is not None and etag in [t.strip() for t in if_none_match.split(",")]:
        return Response(status_code=304, headers=headers)
    return _CountingFileResponse(
        store.blobs.path(sha256),
        media_type="application/octet-stream",
        headers=headers,
        counter=metrics.blob_bytes_served,
    )
