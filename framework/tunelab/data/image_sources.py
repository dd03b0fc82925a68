"""Where an image comes from: a file, an http(s) URL, or inline base64 (a ``data:`` URI).

A chat row names an image by a file path, by an ``http://`` or ``https://`` URL, or inline as
``data:image/png;base64,...`` (the three that transformers' ``load_image`` reads). A URL's
bytes are fetched once per machine and kept in ``images/`` beside the tokenised tables
(``tunelab.data.cache.cache_root``'s default folder), named by the sha256 of the URL; every
later read (the collate in each epoch, a second run) opens that file. The dataset builders
fetch each URL while they check the rows, since only the decoded image shows a truncated
download or a page that is not an image; the collate, in the data loader, fetches only a URL
whose file is no longer there. Inline images are decoded into the same folder.

A fetch is bounded by ``ImageFetch``: ``timeout`` seconds for connecting and for each read
and in all, ``max_bytes`` bytes (what the server announces in ``Content-Length``, and what
it sends), and then ``open_image``'s pixel limit from the decoded header (a decompression
bomb). Nothing is kept of a failed fetch. A fetch that failed for a reason that may pass
(unreachable, timed out, an HTTP error) is ``FetchError``, whose message ends with
``RETRIED``: the tokenised table that records it as a malformed row is built again by the
next run (``tunelab.data.cache``), so a transient failure is not cached.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import http.client
import os
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from tunelab.data.cache import RETRIED, cache_root
from tunelab.data.images import ImageError, open_image
from tunelab.errors import ConfigError

IMAGES_FOLDER = "images"
"""The folder of fetched images, under ``cache_root``'s default."""
DEFAULT_FETCH_TIMEOUT = 30.0
"""Seconds a URL may take to answer and to send an image."""
DEFAULT_MAX_IMAGE_BYTES = 64 * 2**20
"""The largest image a URL or a ``data:`` URI may hold, in bytes."""
_READ_SIZE = 1 << 16


def is_url(source: str) -> bool:
    """Whether an image source is a URL (``http://``, ``https://``) or inline (``data:``)."""
    return source[:8].lower().startswith(("http://", "https://", "data:"))


def describe(source: str) -> str:
    """An image source as messages name it: a path or URL, or an inline image's start."""
    if source[:5].lower() == "data:" and len(source) > 64:
        return f"{source[:40]}... ({len(source)} characters)"
    return source


class FetchError(ImageError):
    """A URL not fetched for a reason that may pass: unreachable, timed out, an HTTP error."""


@dataclass(frozen=True)
class ImageFetch:
    """How images named by URL are fetched, and where their bytes are kept."""

    timeout: float = DEFAULT_FETCH_TIMEOUT
    """Seconds for connecting, for each read, and for the whole image."""
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    """The largest image accepted, in bytes."""
    folder: str | None = None
    """Where fetched images are kept (None: ``images/`` under ``cache_root``'s default)."""

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ConfigError(f"image_fetch_timeout must be over 0 seconds, got {self.timeout}")
        if self.max_bytes < 1:
            raise ConfigError(f"max_image_bytes must be at least 1, got {self.max_bytes}")

    def cache_folder(self) -> Path:
        """The folder fetched images are kept in."""
        return Path(self.folder) if self.folder else cache_root(None) / IMAGES_FOLDER

    def cached_file(self, source: str) -> Path:
        """Where the bytes of a URL or inline image are kept (by the sha256 of ``source``)."""
        return self.cache_folder() / hashlib.sha256(source.encode()).hexdigest()

    def local_file(self, source: str) -> Path:
        """The file holding a URL's or inline image's bytes, fetched if not kept yet.

        Raises:
            ImageError: the bytes cannot be had (``FetchError`` when that may pass), or are
                more than ``max_bytes``.
        """
        path = self.cached_file(source)
        if path.is_file():
            return path
        inline = source[:5].lower() == "data:"
        data = self._decode(source) if inline else self._download(source)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written aside and renamed: a reader never sees part of an image.
        part = path.with_name(f"{path.name}.{uuid.uuid4().hex}.part")
        part.write_bytes(data)
        os.replace(part, path)
        return path

    def _too_large(self, source: str, size: int) -> ImageError:
        return ImageError(
            f"{describe(source)}: {size} bytes is over the limit of {self.max_bytes} "
            "(max_image_bytes)"
        )

    def _decode(self, source: str) -> bytes:
        header, comma, data = source.partition(",")
        if not comma or not header.lower().endswith(";base64"):
            raise ImageError(
                f"{describe(source)}: an inline image must be data:<type>;base64,<data>"
            )
        data = "".join(data.split())
        if len(data) // 4 * 3 > self.max_bytes:
            raise self._too_large(source, len(data) // 4 * 3)
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError(f"{describe(source)}: the inline image is not valid base64") from None

    def _download(self, url: str) -> bytes:
        deadline = time.monotonic() + self.timeout
        request = urllib.request.Request(url, headers={"User-Agent": "tunelab"})
        chunks: list[bytes] = []
        size = 0
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                announced = response.headers.get("Content-Length", "")
                if announced.isdigit() and int(announced) > self.max_bytes:
                    raise self._too_large(url, int(announced))
                while chunk := response.read(_READ_SIZE):
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise self._too_large(url, size)
                    if time.monotonic() > deadline:
                        raise TimeoutError
                    chunks.append(chunk)
        except urllib.error.HTTPError as error:
            raise FetchError(f"{url}: HTTP error {error.code} {error.reason} {RETRIED}") from None
        except (TimeoutError, urllib.error.URLError) as error:
            reason = getattr(error, "reason", error)
            if isinstance(error, TimeoutError) or isinstance(reason, TimeoutError):
                raise FetchError(
                    f"{url}: no image within {self.timeout:g} s (image_fetch_timeout) {RETRIED}"
                ) from None
            raise FetchError(f"{url}: unreachable ({reason}) {RETRIED}") from None
        except (http.client.HTTPException, OSError, ValueError) as error:
            if isinstance(error, ImageError):
                raise
            raise FetchError(
                f"{url}: the download failed ({type(error).__name__}: {error}) {RETRIED}"
            ) from None
        return b"".join(chunks)


def open_image_source(
    source: str, max_image_pixels: int, fetch: ImageFetch | None = None
) -> Image.Image:
    """``open_image`` of a file, or of a URL's or inline image's bytes (fetched if needed).

    Args:
        source: a file path, an http(s) URL or a ``data:`` URI.
        max_image_pixels: the largest ``width * height`` accepted.
        fetch: how URLs are fetched (None: the defaults).

    Returns:
        The decoded image.

    Raises:
        ImageError: as ``open_image``, or a URL that cannot be fetched; the message names the
            URL. The kept bytes of an image that cannot be used are removed.
    """
    if not is_url(source):
        return open_image(source, max_image_pixels)
    path = (fetch or ImageFetch()).local_file(source)
    try:
        return open_image(path, max_image_pixels)
    except ImageError as error:
        path.unlink(missing_ok=True)
        raise ImageError(str(error).replace(str(path), describe(source))) from None
