"""Images named by URL or inline (``data:``) in chat rows, fetched from a local HTTP server.

A ``ThreadingHTTPServer`` in a thread serves the tiny model's generated images and the bad
answers a data check must name: a 404, a page that is not an image, a decompression bomb, a
file over the byte limit (announced and not), and a server that does not answer (it waits on
an event the test sets afterwards; the fetch's timeout is short). No internet is used.

A row with URLs gives the samples and pixels of the same row with files; each URL is fetched
once per machine (while the rows are checked), a second build and every collate read the
image cache, and the collate fetches again only a file the cache lost. A bad URL is one line
with the file, line and URL; ``skip_malformed`` skips it; a failure that may pass (an HTTP
error, no answer) is not cached: the next build fetches it again.
"""

import base64
import io
import json
import random
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from PIL import Image

from tunelab._paths import assets_dir
from tunelab.data import image_chat_dataset, load_tokenizer, sft_collate
from tunelab.data.image_sources import ImageFetch, open_image_source
from tunelab.data.images import ImageError
from tunelab.errors import ConfigError, DataError

TINY_VL = assets_dir() / "tiny_vl"
IMAGES = TINY_VL / "images"
QUESTION = "What colour is the shape?"


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


class _Server:
    """The test server: ``url(name)``, the requests per path, the slow answer's release."""

    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()
        self.release = threading.Event()
        files = {path.name: path.read_bytes() for path in IMAGES.glob("*.png")}
        # 12 megapixels in 1.5 kB (one bit a pixel, all zero), and 48 kB that do not compress.
        files["bomb.png"] = _png(Image.new("1", (4000, 3000)))
        noise = random.Random(0).randbytes(128 * 128 * 3)
        files["noise.png"] = _png(Image.frombytes("RGB", (128, 128), noise))
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):  # noqa: N802 (http.server's name)
                server.requests[self.path] += 1
                name = self.path.rsplit("/", 1)[-1]
                if name == "slow.png":
                    server.release.wait(30)
                    try:
                        return self._send(files["red_circle_0.png"])
                    except (BrokenPipeError, ConnectionResetError):
                        return None  # the client that timed out has gone
                if name == "page.png":
                    return self._send(b"<html>not an image</html>", "text/html")
                if name == "unannounced.png":  # no Content-Length: read to the end
                    self.send_response(200)
                    self.end_headers()
                    self.wfile.write(files["noise.png"])
                    return None
                if name not in files:
                    return self.send_error(404)
                return self._send(files[name])

            def _send(self, body, kind="image/png"):
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, test: str, name: str) -> str:
        """A URL of ``name`` that no other test fetches (the image cache is per session)."""
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/{test}/{name}"


@pytest.fixture(scope="module")
def server():
    served = _Server()
    yield served
    served.release.set()
    served.httpd.shutdown()
    served.httpd.server_close()
    served.thread.join(timeout=10)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_VL, max_seq_len=128)


def _row(image, key="image"):
    parts = [{"type": "image", key: image}, {"type": "text", "text": QUESTION}]
    return {
        "messages": [
            {"role": "user", "content": parts},
            {"role": "assistant", "content": "Red."},
        ]
    }


def _placeholder_row(image):
    return {
        "messages": [
            {"role": "user", "content": f"<image>{QUESTION}"},
            {"role": "assistant", "content": "Blue."},
        ],
        "images": [image],
    }


def _dataset(tokenizer, folder, rows, **kwargs):
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / "rows.jsonl"
    text = "".join(json.dumps(row) + "\n" for row in rows)
    if not file.is_file() or file.read_text() != text:  # a rewrite would be another source
        file.write_text(text)
    build = dict(source="json", data_files=str(file), cache_dir=str(folder / "cache"), num_proc=1)
    return image_chat_dataset(tokenizer, **build, **kwargs), file


def test_url_rows_equal_file_rows_and_each_url_is_fetched_once(server, tokenizer, tmp_path):
    red, blue = "red_circle_0.png", "blue_square_1.png"
    urls = [server.url("once", red), server.url("once", blue)]
    with_files, _ = _dataset(
        tokenizer,
        tmp_path / "files",
        [_row(str(IMAGES / red)), _placeholder_row(str(IMAGES / blue)), _row(str(IMAGES / red))],
    )
    url_rows = [_row(urls[0]), _placeholder_row(urls[1]), _row(urls[0], key="url")]
    with_urls, _ = _dataset(tokenizer, tmp_path / "urls", url_rows)
    for index in range(3):
        ours, theirs = with_urls[index], with_files[index]
        assert ours["tokens"] == theirs["tokens"] and ours["labels"] == theirs["labels"]
        assert ours["image_grids"] == theirs["image_grids"]
    assert [with_urls[index]["images"] for index in range(3)] == [[urls[0]], [urls[1]], [urls[0]]]
    fetched = {f"/once/{red}": 1, f"/once/{blue}": 1}  # the row check fetched each once
    assert _counts(server, "once") == fetched

    # The collate reads the cache: the same pixels as the files', no request.
    collate = sft_collate(tokenizer)
    items = [with_urls[index] for index in range(3)]
    batch = collate(items, pad_id=0)
    expected = collate([with_files[index] for index in range(3)], pad_id=0)
    assert torch.equal(batch["pixel_values"], expected["pixel_values"])
    assert torch.equal(batch["tokens"], expected["tokens"])
    # Another build (another table) reads the image cache too.
    _dataset(tokenizer, tmp_path / "again", url_rows)
    assert _counts(server, "once") == fetched

    # A file the cache lost is fetched again by the collate, once.
    ImageFetch().cached_file(urls[1]).unlink()
    assert torch.equal(collate(items, pad_id=0)["pixel_values"], expected["pixel_values"])
    assert torch.equal(collate(items, pad_id=0)["pixel_values"], expected["pixel_values"])
    assert _counts(server, "once") == {f"/once/{red}": 1, f"/once/{blue}": 2}


def _counts(server, test):
    return {path: count for path, count in server.requests.items() if path.startswith(f"/{test}/")}


def test_an_inline_data_uri_is_the_file(server, tokenizer, tmp_path):
    file = IMAGES / "green_square_0.png"
    uri = "data:image/png;base64," + base64.b64encode(file.read_bytes()).decode()
    dataset, _ = _dataset(tokenizer, tmp_path / "inline", [_row(uri), _row(str(file))])
    assert dataset[0]["tokens"] == dataset[1]["tokens"] and dataset[0]["images"] == [uri]
    collate = sft_collate(tokenizer)
    assert torch.equal(
        collate([dataset[0]], pad_id=0)["pixel_values"],
        collate([dataset[1]], pad_id=0)["pixel_values"],
    )
    with pytest.raises(ImageError, match="not valid base64"):
        open_image_source("data:image/png;base64,@@@", 10**6, ImageFetch())
    with pytest.raises(ImageError, match="must be data:<type>;base64,<data>"):
        open_image_source("data:image/png,abc", 10**6, ImageFetch())


# name served -> what the one line says, and whether a later build fetches it again
BAD = {
    "gone.png": ("HTTP error 404 Not Found (not cached: the next run tries again)", True),
    "page.png": ("not an image pillow can read", False),
    "bomb.png": ("4000x3000 = 12000000 pixels is over the limit of 1000000", False),
    "noise.png": ("bytes is over the limit of 20000 (max_image_bytes)", False),
    "unannounced.png": ("bytes is over the limit of 20000 (max_image_bytes)", False),
    "slow.png": ("no image within 0.5 s (image_fetch_timeout)", True),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_url_is_one_line_with_file_line_and_url(server, tokenizer, tmp_path, name):
    why, retried = BAD[name]
    url = server.url(f"bad-{name}", name)
    rows = [_row(str(IMAGES / "red_circle_0.png")), _placeholder_row(url)]
    settings = dict(max_image_pixels=10**6, max_image_bytes=20_000, image_fetch_timeout=0.5)
    with pytest.raises(DataError) as caught:
        _dataset(tokenizer, tmp_path, rows, **settings)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{tmp_path / 'rows.jsonl'}:2: row 1 (0-based), column 'images': ")
    assert f"{url}: " in message and why in message, message
    assert _counts(server, f"bad-{name}") == {f"/bad-{name}/{name}": 1}
    if name == "slow.png":
        server.release.set()  # the waiting answer ends now; later fetches answer at once
    dataset, _ = _dataset(tokenizer, tmp_path, rows, skip_malformed=True, **settings)
    if name == "slow.png":  # fetched again, and it answers now
        assert (len(dataset), dataset.num_skipped) == (2, 0)
    else:
        assert (len(dataset), dataset.num_skipped) == (1, 1)
    # A failure that may pass is fetched again by the next build; the others are cached.
    assert _counts(server, f"bad-{name}") == {f"/bad-{name}/{name}": 2 if retried else 1}


def test_an_unreachable_url_is_one_line(tokenizer, tmp_path):
    import socket

    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    url = f"http://127.0.0.1:{port}/red.png"
    with pytest.raises(DataError) as caught:
        _dataset(tokenizer, tmp_path, [_row(url)])
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 'rows.jsonl'}:1: row 0 (0-based)")
    assert f"{url}: unreachable (" in message and "\n" not in message
    with pytest.raises(ConfigError, match="image_fetch_timeout must be over 0 seconds, got 0"):
        _dataset(tokenizer, tmp_path, [_row(url)], image_fetch_timeout=0)


def test_a_grpo_prompt_reads_its_image_url(server, tokenizer, tmp_path):
    """``prompt_dataset`` (GRPO) takes image URLs too: the prompt and pixels of the file."""
    from tunelab.data import prompt_dataset

    name = "blue_square_1.png"
    url, file = server.url("prompts", name), str(IMAGES / name)
    rows = [{"prompt": f"<image>{QUESTION}", "images": [image]} for image in (url, file)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    prompts = prompt_dataset(tokenizer, source="json", data_files=str(path))
    assert prompts.tokens[0] == prompts.tokens[1]
    assert [ref.path for ref in prompts.images[0]] == [url]
    read, expected = prompts.prompt_images(0), prompts.prompt_images(1)
    assert torch.equal(read["pixel_values"], expected["pixel_values"])
    assert _counts(server, "prompts") == {f"/prompts/{name}": 1}
