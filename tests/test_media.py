"""input_builders.image / sources / fetch / media_config: every source kind, every mode conversion,
every refusal (type + message).

Offline: images are built with Pillow on the fly; http(s) is tested against a local server on
127.0.0.1 only, and every foreign host is refused before any connection is attempted.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import os
import struct
import threading
import time
import warnings
import zlib
from functools import lru_cache

import numpy as np
import pytest
from PIL import Image, ImageFile

from input_builders.fetch import _host_allowed, _read_capped
from input_builders.image import LoadedImage, load_image
from input_builders.media_config import MediaConfig
from input_builders.media_errors import (
    MediaDecodeError,
    MediaError,
    MediaFetchError,
    MediaNotAllowedError,
    MediaNotFoundError,
    MediaTooLargeError,
)

# ----------------------------------------------------------------------------------------- helpers


def encode(image: Image.Image, fmt: str, **params) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def quadrants(size=(40, 20)) -> Image.Image:
    """Stored as  red | green  over  blue | white : any rotation or mirror moves a colour."""
    width, height = size
    image = Image.new("RGB", size)
    for box, colour in [((0, 0), (255, 0, 0)), ((width // 2, 0), (0, 255, 0)),
                        ((0, height // 2), (0, 0, 255)), ((width // 2, height // 2), (255, 255, 255))]:
        image.paste(colour, (*box, box[0] + width // 2, box[1] + height // 2))
    return image


def colour_at(image: Image.Image, fx: float, fy: float) -> tuple[int, ...]:
    return image.getpixel((int(fx * image.width), int(fy * image.height)))


def close_to(actual, expected, tolerance=12) -> bool:
    return all(abs(a - e) <= tolerance for a, e in zip(actual, expected, strict=True))


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


@lru_cache
def huge_png(width: int, height: int) -> bytes:
    """A real, valid 1-bit PNG of width × height all-black pixels: kilobytes on disk, a bomb decoded."""
    row = b"\0" * (1 + (width + 7) // 8)  # filter byte + packed bits
    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", idat)
            + png_chunk(b"IEND", b""))


def data_url(data: bytes, media_type="image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def raw_b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture
def media_dir(tmp_path):
    path = tmp_path / "images"
    path.mkdir()
    return path


@pytest.fixture
def config(media_dir):
    return MediaConfig(allowed_local_media_paths=(str(media_dir),))


@pytest.fixture
def png_bytes():
    return encode(quadrants(), "PNG")


# ------------------------------------------------------------------------------ sources: success


@pytest.mark.parametrize("kind", ["path", "pathlike", "file_url", "data_url", "raw_base64", "bytes"])
def test_every_encoded_source_gives_the_same_image_and_digest(kind, media_dir, config, png_bytes):
    file = media_dir / "quad.png"
    file.write_bytes(png_bytes)
    ref = {
        "path": str(file),
        "pathlike": file,
        "file_url": file.as_uri(),
        "data_url": data_url(png_bytes),
        "raw_base64": raw_b64(png_bytes),
        "bytes": png_bytes,
    }[kind]
    loaded = load_image(ref, config)
    assert isinstance(loaded, LoadedImage)
    assert loaded.image.mode == "RGB" and loaded.image.size == (40, 20)
    assert loaded.image.tobytes() == quadrants().tobytes()
    assert loaded.digest == hashlib.sha256(png_bytes).hexdigest()
    assert loaded.source


def test_source_descriptions(media_dir, config, png_bytes):
    file = media_dir / "quad.png"
    file.write_bytes(png_bytes)
    assert load_image(str(file), config).source == str(file)
    assert load_image(data_url(png_bytes), config).source == f"data: URL ({len(png_bytes)} bytes)"
    assert load_image(raw_b64(png_bytes), config).source == f"base64 string ({len(png_bytes)} bytes)"


def test_relative_and_dotdot_paths_inside_the_directory_are_fine(media_dir, config, png_bytes, monkeypatch):
    (media_dir / "sub").mkdir()
    (media_dir / "quad.png").write_bytes(png_bytes)
    monkeypatch.chdir(media_dir / "sub")
    assert load_image("../quad.png", config).image.size == (40, 20)
    assert load_image(f"{media_dir}/sub/../quad.png", config).image.size == (40, 20)


def test_symlink_inside_the_directory_to_a_file_inside_is_fine(media_dir, config, png_bytes):
    (media_dir / "quad.png").write_bytes(png_bytes)
    (media_dir / "alias.png").symlink_to(media_dir / "quad.png")
    assert load_image(str(media_dir / "alias.png"), config).image.size == (40, 20)


def test_jpeg(config):
    loaded = load_image(encode(quadrants(), "JPEG", quality=95), config)
    assert loaded.image.mode == "RGB"
    assert close_to(colour_at(loaded.image, 0.25, 0.25), (255, 0, 0))
    assert close_to(colour_at(loaded.image, 0.75, 0.75), (255, 255, 255))


def test_whitespace_wrapped_and_unpadded_base64_is_accepted(config, png_bytes):
    text = raw_b64(png_bytes)
    wrapped = "\r\n".join(text[i:i + 76] for i in range(0, len(text), 76))
    assert load_image(wrapped, config).digest == hashlib.sha256(png_bytes).hexdigest()
    assert load_image(data_url(png_bytes).rstrip("="), config).digest == hashlib.sha256(png_bytes).hexdigest()


# ------------------------------------------------------------------------- raw base64 versus path


def test_base64_jpeg_starting_with_a_slash_is_base64_not_a_path(config):
    jpeg = encode(quadrants(), "JPEG")
    text = raw_b64(jpeg)
    assert text.startswith("/9j/")  # why "starts with /" cannot mean "path"
    assert load_image(text, MediaConfig()).digest == hashlib.sha256(jpeg).hexdigest()


@pytest.mark.parametrize("ref", ["/etc/passwd", "/data/images/cat", "./cat", "../cat", "~/cat", "images/cat.png"])
def test_absolute_relative_home_and_dotted_strings_are_paths(ref):
    with pytest.raises(MediaNotAllowedError, match="reading local files is disabled"):
        load_image(ref, MediaConfig())


def test_a_relative_base64_shaped_name_is_read_as_base64_and_the_error_says_so(config):
    with pytest.raises(MediaDecodeError, match=r"write a local file as \./name") as caught:
        load_image("images/cat", config)
    assert "base64 string" in str(caught.value)


def test_a_string_longer_than_path_max_is_base64_even_with_a_stray_character():
    with pytest.raises(MediaDecodeError, match="not valid base64"):
        load_image("iVBORw0KGgo" + "A" * 5000 + "!AAA", MediaConfig())


# --------------------------------------------------------------------------------- mode conversion


def test_rgba_is_composited_on_white(config):
    image = Image.new("RGBA", (4, 4), (255, 0, 0, 128))
    image.putpixel((0, 0), (0, 0, 0, 0))  # fully transparent black must become white
    loaded = load_image(encode(image, "PNG"), config).image
    assert loaded.mode == "RGB"
    assert loaded.getpixel((0, 0)) == (255, 255, 255)
    assert close_to(loaded.getpixel((1, 1)), (255, 127, 127), 2)


def test_la_is_composited_on_white(config):
    image = Image.new("LA", (2, 1), (0, 255))
    image.putpixel((1, 0), (0, 0))
    loaded = load_image(encode(image, "PNG"), config).image
    assert loaded.getpixel((0, 0)) == (0, 0, 0) and loaded.getpixel((1, 0)) == (255, 255, 255)


def test_gif_palette_with_transparency_goes_through_rgba(config):
    image = Image.new("P", (2, 1))
    image.putpalette([0, 0, 0, 0, 0, 255] + [0] * 762)  # index 0 black, index 1 blue
    image.putpixel((1, 0), 1)
    loaded = load_image(encode(image, "GIF", transparency=0), config).image
    assert loaded.getpixel((0, 0)) == (255, 255, 255)  # transparent black → white, not black
    assert loaded.getpixel((1, 0)) == (0, 0, 255)


def test_palette_png_with_trns_and_without(config):
    image = Image.new("P", (2, 1))
    image.putpalette([10, 20, 30, 200, 100, 0] + [0] * 762)
    image.putpixel((1, 0), 1)
    plain = load_image(encode(image, "PNG"), config).image
    assert plain.getpixel((0, 0)) == (10, 20, 30) and plain.getpixel((1, 0)) == (200, 100, 0)
    keyed = load_image(encode(image, "PNG", transparency=0), config).image
    assert keyed.getpixel((0, 0)) == (255, 255, 255) and keyed.getpixel((1, 0)) == (200, 100, 0)


def test_palette_pil_image_with_partial_alpha(config):
    image = Image.new("PA", (1, 1), (0, 0))
    image.putpalette([255, 0, 0] + [0] * 765)
    image.putpixel((0, 0), (0, 128))
    assert close_to(load_image(image, config).image.getpixel((0, 0)), (255, 127, 127), 2)


@pytest.mark.parametrize("mode, value", [("L", 100), ("1", 1)])
def test_grayscale_and_bilevel(mode, value, config):
    loaded = load_image(encode(Image.new(mode, (3, 3), value), "PNG"), config).image
    grey = 100 if mode == "L" else 255
    assert loaded.mode == "RGB" and loaded.getpixel((1, 1)) == (grey, grey, grey)


SIXTEEN_BIT = np.array([[0, 257, 32768, 65535]], dtype="<u2")
SIXTEEN_BIT_AS_8 = [0, 1, 128, 255]  # v / 257, not Pillow's clip to 255


@pytest.mark.parametrize("fmt", ["PNG", "TIFF", "PPM"])
def test_sixteen_bit_grayscale_is_scaled_not_clipped(fmt, config):
    data = encode(Image.frombytes("I;16", (4, 1), SIXTEEN_BIT.tobytes()), fmt)
    assert Image.open(io.BytesIO(data)).mode in ("I;16", "I")  # PNG and TIFF: I;16 (I in older Pillow); PPM: I
    loaded = load_image(data, config).image
    assert [loaded.getpixel((x, 0)) for x in range(4)] == [(v, v, v) for v in SIXTEEN_BIT_AS_8]


def test_cmyk_jpeg(config):
    data = encode(Image.new("CMYK", (16, 16), (0, 255, 255, 0)), "JPEG", quality=95)
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    assert close_to(load_image(data, config).image.getpixel((8, 8)), (255, 0, 0))


def test_ycbcr_pil_image(config):
    loaded = load_image(Image.new("YCbCr", (2, 2), (76, 85, 255)), config).image  # ≈ pure red
    assert loaded.mode == "RGB" and close_to(loaded.getpixel((0, 0)), (255, 0, 0), 3)


@pytest.mark.parametrize("image, phrase", [
    (Image.new("F", (2, 2), 0.5), "mode 'F'"),
    (Image.new("LAB", (2, 2)), "mode 'LAB'"),
    (Image.new("I", (2, 2), 70000), "outside the 16-bit range"),
])
def test_unsupported_modes_are_refused(image, phrase, config):
    with pytest.raises(MediaDecodeError, match=phrase) as caught:
        load_image(image, config)
    assert "send an 8-bit or 16-bit" in str(caught.value)


# ------------------------------------------------------------------------------- EXIF orientation


def exif_jpeg(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(quadrants(), "JPEG", quality=95, exif=exif.tobytes())


def test_exif_orientation_6_rotates_90_clockwise(config):
    image = load_image(exif_jpeg(6), config).image
    assert image.size == (20, 40)
    # [[R, G], [B, W]] turned clockwise is [[B, R], [W, G]]
    for (fx, fy), colour in {(0.25, 0.25): (0, 0, 255), (0.75, 0.25): (255, 0, 0),
                             (0.25, 0.75): (255, 255, 255), (0.75, 0.75): (0, 255, 0)}.items():
        assert close_to(colour_at(image, fx, fy), colour), (fx, fy)


def test_exif_orientation_3_rotates_180(config):
    image = load_image(exif_jpeg(3), config).image
    assert image.size == (40, 20)
    for (fx, fy), colour in {(0.25, 0.25): (255, 255, 255), (0.75, 0.25): (0, 0, 255),
                             (0.25, 0.75): (0, 255, 0), (0.75, 0.75): (255, 0, 0)}.items():
        assert close_to(colour_at(image, fx, fy), colour), (fx, fy)


def test_pil_input_with_orientation_is_transposed_without_touching_the_callers_image(config):
    original = Image.open(io.BytesIO(exif_jpeg(6)))
    loaded = load_image(original, config)
    assert loaded.image.size == (20, 40)
    assert original.size == (40, 20) and original.getexif()[0x0112] == 6


# ------------------------------------------------------------------------------------ PIL inputs


def test_pil_digest_is_of_mode_size_and_pixels(config):
    image = quadrants()
    loaded = load_image(image, config)
    expected = hashlib.sha256(b"RGB:40x20:" + image.tobytes()).hexdigest()
    assert loaded.digest == expected
    assert load_image(quadrants(), config).digest == expected  # stable: a usable dedup key
    assert loaded.source == "PIL image (RGB, 40x20)"


def test_pil_palette_images_with_equal_indices_but_different_palettes_get_different_digests(config):
    red, blue = Image.new("P", (2, 2), 0), Image.new("P", (2, 2), 0)
    red.putpalette([255, 0, 0] * 256)
    blue.putpalette([0, 0, 255] * 256)
    assert red.tobytes() == blue.tobytes()
    assert load_image(red, config).digest != load_image(blue, config).digest


# ------------------------------------------------------------------------------- local refusals


@pytest.mark.parametrize("api, knob", [("server", "--allowed-local-media-path"),
                                       ("offline", "media_config=MediaConfig(allowed_local_media_paths=")])
def test_local_files_refused_when_no_directory_is_configured(media_dir, png_bytes, api, knob):
    # The message names the knob of the API in use: a server flag means nothing inside LLM.
    (media_dir / "quad.png").write_bytes(png_bytes)
    with pytest.raises(MediaNotAllowedError) as caught:
        load_image(str(media_dir / "quad.png"), MediaConfig(api=api))
    assert knob in str(caught.value)
    assert ("--" in str(caught.value)) == (api == "server")


def test_path_outside_the_allowed_directories(config, media_dir):
    with pytest.raises(MediaNotAllowedError) as caught:
        load_image("/etc/passwd", config)
    message = str(caught.value)
    assert f"path /etc/passwd is outside the allowed media directories [{os.path.realpath(media_dir)}]" in message
    assert "media_config=MediaConfig(allowed_local_media_paths=" in message  # the offline API's knob


def test_dotdot_escape_is_refused(config, media_dir, tmp_path, png_bytes):
    (tmp_path / "secret.png").write_bytes(png_bytes)
    with pytest.raises(MediaNotAllowedError, match="outside the allowed media directories"):
        load_image(f"{media_dir}/../secret.png", config)


def test_symlink_escape_is_refused(config, media_dir, tmp_path, png_bytes):
    (tmp_path / "secret.png").write_bytes(png_bytes)
    (media_dir / "innocent.png").symlink_to(tmp_path / "secret.png")
    (media_dir / "linkdir").symlink_to(tmp_path)
    for ref in (str(media_dir / "innocent.png"), f"{media_dir}/linkdir/secret.png"):
        with pytest.raises(MediaNotAllowedError, match="symlinks and '..' are resolved first") as caught:
            load_image(ref, config)
        assert str(tmp_path / "secret.png") not in str(caught.value)  # the target is not disclosed


def test_a_sibling_directory_sharing_the_prefix_is_outside(config, media_dir, png_bytes):
    sibling = media_dir.parent / (media_dir.name + "-private")
    sibling.mkdir()
    (sibling / "quad.png").write_bytes(png_bytes)
    with pytest.raises(MediaNotAllowedError, match="outside"):
        load_image(str(sibling / "quad.png"), config)


def test_file_url_outside_and_with_a_host(config):
    with pytest.raises(MediaNotAllowedError, match="outside the allowed media directories"):
        load_image("file:///etc/passwd", config)
    with pytest.raises(MediaNotAllowedError, match="three slashes"):
        load_image("file://etc/passwd", config)


def test_missing_file_inside_is_not_found(config, media_dir):
    with pytest.raises(MediaNotFoundError, match="does not exist"):
        load_image(str(media_dir / "nope.png"), config)


def test_missing_file_outside_is_not_allowed_not_not_found(config):
    # Existence outside the directories is nobody's business.
    with pytest.raises(MediaNotAllowedError):
        load_image("/no/such/dir/nope.png", config)


def test_directory_and_fifo_are_not_regular_files(config, media_dir):
    (media_dir / "sub.png").mkdir()
    os.mkfifo(media_dir / "pipe.png")
    for name in ("sub.png", "pipe.png"):
        with pytest.raises(MediaNotFoundError, match="not a regular file"):
            load_image(str(media_dir / name), config)


# --------------------------------------------------------------------------------------- http(s)


class _Handler(http.server.BaseHTTPRequestHandler):
    body = b""  # set by the fixture

    def do_GET(self):  # noqa: N802 -- http.server's naming
        if self.path == "/img.png":
            self._send(200, self.body)
        elif self.path == "/big":
            self._send(200, b"\0" * 5000)
        elif self.path == "/big-no-length":
            self.send_response(200)
            self.end_headers()  # HTTP/1.0: the body ends when the connection closes
            self.wfile.write(b"\0" * 5000)
        elif self.path == "/to-foreign":
            self._redirect("http://foreign.invalid/img.png")
        elif self.path == "/to-local":
            self._redirect("/img.png")
        elif self.path == "/slow":
            time.sleep(1.0)
            self._send(200, self.body)
        else:
            self._send(404, b"no")

    def _send(self, code, body):
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location):
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # the timeout test's client hangs up on purpose


@pytest.fixture(scope="module")
def http_base():
    _Handler.body = encode(quadrants(), "PNG")
    server = _QuietServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.fixture
def web(http_base, monkeypatch):
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)  # 127.0.0.1 must be reached directly
    return http_base


LOCAL_WEB = MediaConfig(allowed_domains=("127.0.0.1",), max_image_bytes=1000, http_timeout_s=5)


def test_http_refused_without_an_allow_list():
    with pytest.raises(MediaNotAllowedError, match="--allowed-media-domains") as caught:
        load_image("https://example.com/cat.png", MediaConfig(api="server"))
    assert "data: URL" in str(caught.value)


@pytest.mark.parametrize("url", [
    "http://example.com/cat.png",
    "http://127.0.0.1.evil.invalid/cat.png",
    "http://127.0.0.1@evil.invalid/cat.png",  # user-info is not the host
    "http://localhost/cat.png",  # exact host match: localhost is not 127.0.0.1
])
def test_http_to_a_host_outside_the_allow_list_is_refused_before_connecting(url):
    with pytest.raises(MediaNotAllowedError, match=r"is not in the allowed media domains \[127\.0\.0\.1\]"):
        load_image(url, LOCAL_WEB)


def test_host_matching_rules():
    domains = MediaConfig(allowed_domains=("Example.COM.", "*.cdn.net", "10.0.0.5")).allowed_domains
    assert domains == ("example.com", "cdn.net", "10.0.0.5")
    assert _host_allowed("example.com", domains) and _host_allowed("img.static.example.com", domains)
    assert _host_allowed("cdn.net", domains) and _host_allowed("a.cdn.net", domains)
    assert _host_allowed("10.0.0.5", domains)
    assert not _host_allowed("badexample.com", domains)
    assert not _host_allowed("example.com.evil.net", domains)
    assert not _host_allowed("1.10.0.0.5", domains)


def test_http_fetch_from_an_allowed_host(web):
    loaded = load_image(f"{web}/img.png", LOCAL_WEB)
    assert loaded.image.tobytes() == quadrants().tobytes()
    assert loaded.digest == hashlib.sha256(_Handler.body).hexdigest()
    assert loaded.source == "URL on host 127.0.0.1"


def test_redirect_to_an_allowed_host_is_followed(web):
    assert load_image(f"{web}/to-local", LOCAL_WEB).image.size == (40, 20)


def test_redirect_to_a_foreign_host_is_refused(web):
    with pytest.raises(MediaNotAllowedError, match="redirect from 127.0.0.1 refused: host foreign.invalid"):
        load_image(f"{web}/to-foreign", LOCAL_WEB)


def test_http_404_is_not_found(web):
    with pytest.raises(MediaNotFoundError, match="HTTP 404"):
        load_image(f"{web}/missing.png", LOCAL_WEB)


def test_http_timeout(web):
    config = MediaConfig(allowed_domains=("127.0.0.1",), http_timeout_s=0.2)
    # The server answers after 1 s: without the timeout the fetch would succeed, not raise.
    with pytest.raises(MediaFetchError, match=r"timed out after 0\.2 s \(http_timeout_s\)"):
        load_image(f"{web}/slow", config)


def test_unreachable_host_is_a_fetch_error():
    # Port 9 on 127.0.0.1 (discard) is closed on any sane test machine: connection refused, at once.
    with pytest.raises(MediaFetchError, match="could not be fetched"):
        load_image("http://127.0.0.1:9/img.png", LOCAL_WEB)


@pytest.mark.parametrize("ref", ["ftp://example.com/x.png", "gopher://x/y", "s3://bucket/key.png"])
def test_other_schemes_are_refused(ref):
    with pytest.raises(MediaNotAllowedError, match="is not supported"):
        load_image(ref, LOCAL_WEB)


def test_read_capped_stops_after_cap_plus_one_bytes():
    class Endless:
        served = 0

        def read(self, n):
            self.served += n
            return b"x" * n

    stream = Endless()
    assert len(_read_capped(stream, 1000, time.monotonic() + 5, chunk=64)) == 1001
    assert stream.served == 1001
    assert _read_capped(io.BytesIO(b"abc"), 1000, time.monotonic() + 5) == b"abc"
    assert _read_capped(io.BytesIO(b"abc"), 1000, time.monotonic() - 1) is None  # past the deadline


# ------------------------------------------------------------------------------------- byte caps


SMALL = dict(max_image_bytes=100)


def too_large(data_len: int) -> str:
    return rf"is {data_len} bytes; the limit is 100 \(MediaConfig.max_image_bytes\); send a smaller image"


@pytest.fixture
def big_png():
    data = encode(Image.effect_noise((32, 32), 60).convert("L"), "PNG")
    assert len(data) > 100
    return data


@pytest.mark.parametrize("kind", ["path", "file_url", "data_url", "raw_base64", "bytes"])
def test_byte_cap_for_every_local_source(kind, media_dir, big_png):
    config = MediaConfig(allowed_local_media_paths=(str(media_dir),), **SMALL)
    file = media_dir / "big.png"
    file.write_bytes(big_png)
    ref = {"path": str(file), "file_url": file.as_uri(), "data_url": data_url(big_png),
           "raw_base64": raw_b64(big_png), "bytes": big_png}[kind]
    with pytest.raises(MediaTooLargeError, match=too_large(len(big_png))):
        load_image(ref, config)


def test_base64_cap_is_checked_before_decoding(monkeypatch, big_png):
    monkeypatch.setattr(base64, "b64decode", lambda *a, **k: pytest.fail("decoded a too-large payload"))
    with pytest.raises(MediaTooLargeError):
        load_image(data_url(big_png), MediaConfig(**SMALL))


def test_byte_cap_over_http_with_and_without_content_length(web):
    with pytest.raises(MediaTooLargeError, match=r"is 5000 bytes; the limit is 1000 \(MediaConfig.max_image_bytes\)"):
        load_image(f"{web}/big", LOCAL_WEB)
    with pytest.raises(MediaTooLargeError, match=r"is more than 1000 bytes; the limit is 1000 \(MediaConfig.max_image_bytes\)"):
        load_image(f"{web}/big-no-length", LOCAL_WEB)


# ------------------------------------------------------------------------------------ pixel caps


def test_pixel_cap_names_size_and_limit(config):
    with pytest.raises(MediaTooLargeError, match=r"is 40x20 = 800 pixels; the limit is 799 \(MediaConfig.max_image_pixels\)"):
        load_image(encode(quadrants(), "PNG"), MediaConfig(max_image_pixels=799))
    with pytest.raises(MediaTooLargeError, match=r"the limit is 799 \(MediaConfig.max_image_pixels\)"):
        load_image(quadrants(), MediaConfig(max_image_pixels=799))


@pytest.fixture
def no_pixel_decoding(monkeypatch):
    calls = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: calls.append(self) or pytest.fail("decoded"))
    yield calls
    assert calls == [], "pixels were decoded before the pixel cap refused the image"


def test_huge_png_is_refused_from_its_header_before_decoding(no_pixel_decoding):
    data = huge_png(7000, 7000)  # 49 MP: over our default 36 MP, under Pillow's own warning threshold
    assert len(data) < 50_000
    with pytest.raises(MediaTooLargeError, match=r"7000x7000 = 49000000 pixels; the limit is 36000000"):
        load_image(data, MediaConfig())


def test_pillow_bomb_error_becomes_ours(no_pixel_decoding):
    data = huge_png(20000, 20000)  # 400 MP: Pillow itself refuses it in Image.open
    assert len(data) < 200_000
    with pytest.raises(MediaTooLargeError, match=r"too large to decode safely.*limit is 36000000 pixels"):
        load_image(data, MediaConfig())


def test_pillow_bomb_warning_becomes_an_error_not_a_log_line(no_pixel_decoding):
    config = MediaConfig(max_image_pixels=500_000_000)  # above Pillow's thresholds: Pillow's check fires
    with warnings.catch_warnings(record=True) as escaped:
        warnings.simplefilter("always")
        with pytest.raises(MediaTooLargeError, match=r"too large to decode safely.*500000000 pixels"):
            load_image(huge_png(10000, 10000), config)  # 100 MP: Pillow warns (between 89.5 and 179 MP)
    assert not [w for w in escaped if issubclass(w.category, Image.DecompressionBombWarning)]


# --------------------------------------------------------------------------------- decode errors


def test_garbage_bytes(config):
    with pytest.raises(MediaDecodeError, match="is not an image in a supported format"):
        load_image(b"this is not an image at all", config)


def test_postscript_is_not_handed_to_ghostscript(config):
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 1 1\nshowpage\n"
    with pytest.raises(MediaDecodeError, match=r"not an image in a supported format \(PNG, JPEG"):
        load_image(eps, config)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_file(fmt, config):
    data = encode(Image.effect_noise((64, 64), 60).convert("RGB"), fmt)
    with pytest.raises(MediaDecodeError, match="truncated") as caught:
        load_image(data[: len(data) // 2], config)
    assert "send the complete image file" in str(caught.value)


@pytest.mark.parametrize("ref, phrase", [
    ("data:image/png;base64,iVBOR!!!!", "data: URL is not valid base64"),
    ("data:image/png;base64,iVBORw0KG", "impossible length"),
    ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAf=FcSJAAAADUlEQVR42mNk", "base64 string is not valid base64"),
    ("data:image/png,%89PNG", "not base64-encoded"),
    ("data:text/plain;base64,aGVsbG8=", "media type is 'text/plain'"),
    ("data:image/png;base64", "no ','"),
])
def test_bad_base64_and_data_urls(ref, phrase, config):
    with pytest.raises(MediaDecodeError, match=phrase):
        load_image(ref, config)


def test_valid_base64_of_something_that_is_not_an_image(config):
    with pytest.raises(MediaDecodeError, match="base64 string .* is not an image"):
        load_image(raw_b64(b"hello world, definitely not an image"), config)


@pytest.mark.parametrize("ref, phrase", [
    ("", "empty string"),
    ("   ", "empty string"),
    (b"", "is empty"),
    ("data:image/png;base64,", "is empty"),
])
def test_empty_input(ref, phrase, config):
    with pytest.raises(MediaDecodeError, match=phrase):
        load_image(ref, config)


@pytest.mark.parametrize("ref", [42, None, ["a"], {"url": "data:image/png;base64,AAAA"}])
def test_unsupported_reference_types(ref, config):
    with pytest.raises(MediaDecodeError, match=f"unsupported image reference of type {type(ref).__name__}"):
        load_image(ref, config)


def test_every_media_error_is_a_value_error():
    for cls in (MediaNotAllowedError, MediaTooLargeError, MediaDecodeError, MediaNotFoundError, MediaFetchError):
        assert issubclass(cls, MediaError) and issubclass(cls, ValueError)


# ---------------------------------------------------------------------------------------- config


def test_config_normalises_directories_with_realpath(tmp_path, media_dir):
    (tmp_path / "alias").symlink_to(media_dir)
    config = MediaConfig(allowed_local_media_paths=[str(tmp_path / "alias"), str(media_dir)])
    assert config.allowed_local_media_paths == (os.path.realpath(media_dir),)
    single = MediaConfig(allowed_local_media_paths=str(media_dir))  # a lone string is one directory
    assert single.allowed_local_media_paths == config.allowed_local_media_paths


@pytest.mark.parametrize("kwargs, phrase", [
    (dict(max_image_bytes=0), "max_image_bytes must be a positive integer"),
    (dict(max_image_pixels=-1), "max_image_pixels must be a positive integer"),
    (dict(max_image_bytes=True), "max_image_bytes must be a positive integer"),
    (dict(http_timeout_s=0), "http_timeout_s must be a positive number"),
    (dict(http_timeout_s=float("inf")), "http_timeout_s must be a positive number"),
    (dict(allowed_local_media_paths=("/no/such/dir",)), "is not an existing directory"),
    (dict(allowed_domains=("https://example.com",)), "is not a host name"),
    (dict(allowed_domains=("example.com:8080",)), "is not a host name"),
])
def test_config_validation(kwargs, phrase):
    with pytest.raises(ValueError, match=phrase):
        MediaConfig(**kwargs)


def test_a_resent_image_is_decoded_once_and_the_cache_is_bounded(config, png_bytes, monkeypatch):
    """A chat resends its image every turn: the second load of the same bytes reuses the decoded
    image (a digest lookup, no decode); the cache holds a bounded number of decoded bytes."""
    from input_builders import image as media

    decodes = []
    real_decode = media._decode
    monkeypatch.setattr(media, "_decode", lambda *a, **k: decodes.append(1) or real_decode(*a, **k))
    monkeypatch.setattr(media, "_recently_decoded", media._DecodedImages(max_bytes=10**9))
    first = load_image(png_bytes, config)
    again = load_image(png_bytes, config)
    assert len(decodes) == 1 and again.image is first.image and again.digest == first.digest
    tight = media._DecodedImages(max_bytes=2 * media._DecodedImages._size(first.image))
    for digest in ("a", "b", "c"):
        tight.put(digest, config, first.image)
    assert tight.get("a", config) is None and tight.get("c", config) is first.image


def test_a_resent_data_url_is_not_base64_decoded_again(config, png_bytes, monkeypatch):
    """The second load of the same data URL text finds its image by the text's digest: no base64
    decode, no image decode, the same digest and image. Other texts of the same bytes (a data URL
    with other whitespace, raw bytes) still give the same digest; a changed policy or an image that
    left the byte-bounded cache means decoding again."""
    from input_builders import image as media

    from input_builders import sources

    b64decodes, decodes = [], []
    real_b64, real_decode = sources._b64decode, media._decode
    monkeypatch.setattr(sources, "_b64decode", lambda *a, **k: b64decodes.append(1) or real_b64(*a, **k))
    monkeypatch.setattr(media, "_decode", lambda *a, **k: decodes.append(1) or real_decode(*a, **k))
    monkeypatch.setattr(media, "_recently_decoded", media._DecodedImages(max_bytes=10**9))
    url = "data:image/png;base64," + base64.b64encode(png_bytes).decode()
    first = load_image(url, config)
    again = load_image(url, config)
    assert (len(b64decodes), len(decodes)) == (1, 1)
    assert again == first and again.image is first.image
    assert again.digest == hashlib.sha256(png_bytes).hexdigest()

    spaced = load_image(" " + url, config)  # another text: decoded from base64, image still cached
    assert (len(b64decodes), len(decodes)) == (2, 1) and spaced.digest == first.digest

    stricter = MediaConfig(allowed_local_media_paths=config.allowed_local_media_paths,
                           max_image_bytes=len(png_bytes) - 1)
    with pytest.raises(MediaTooLargeError):  # the size is checked again under another policy
        load_image(url, stricter)

    monkeypatch.setattr(media, "_recently_decoded", media._DecodedImages(max_bytes=1))  # keeps no image
    load_image(url, config)
    load_image(url, config)
    assert len(decodes) == 3  # both decoded: an alias never outlives its image


def test_a_data_url_fingerprint_collision_never_serves_another_image(config, monkeypatch):
    """The alias is found by a fingerprint of the text, and a hit is confirmed by comparing the
    whole text: two data URLs that share a fingerprint each get their own image."""
    from input_builders import image as media

    monkeypatch.setattr(media, "_recently_decoded", media._DecodedImages(max_bytes=10**9))
    monkeypatch.setattr(media, "_inline_key", lambda ref: (0, 0))  # every text collides
    red, blue = (encode(Image.new("RGB", (8, 8), colour), "PNG") for colour in ("red", "blue"))
    urls = ["data:image/png;base64," + base64.b64encode(data).decode() for data in (red, blue)]
    first, second, first_again = (load_image(url, config) for url in (urls[0], urls[1], urls[0]))
    assert first.digest == hashlib.sha256(red).hexdigest() == first_again.digest
    assert second.digest == hashlib.sha256(blue).hexdigest()
    assert second.image.getpixel((0, 0)) == (0, 0, 255) and first_again.image.getpixel((0, 0)) == (255, 0, 0)


def test_the_data_url_aliases_are_bounded_by_the_text_they_keep(config, png_bytes):
    from input_builders import image as media

    url = "data:image/png;base64," + base64.b64encode(png_bytes).decode()
    loaded = load_image(url, config)
    cache = media._DecodedImages(max_bytes=10**9, max_inline_bytes=2 * len(url) + 10)
    cache.put(loaded.digest, config, loaded.image)
    texts = [url + " " * n for n in range(3)]  # three texts that load the same image
    for text in texts:
        cache.put_inline(media._inline_key(text), text, config, loaded)
    assert cache.get_inline(media._inline_key(texts[0]), texts[0], config) is None  # the oldest went
    assert cache.get_inline(media._inline_key(texts[2]), texts[2], config) == loaded
    assert cache._inline_bytes <= cache.max_inline_bytes
    too_long = media._DecodedImages(max_bytes=10**9, max_inline_bytes=len(url) - 1)
    too_long.put_inline(media._inline_key(url), url, config, loaded)  # kept only if it fits
    assert too_long.get_inline(media._inline_key(url), url, config) is None


def test_a_decoded_image_keeps_no_reference_to_its_source_bytes(config):
    """What is cached and served is the pixels alone: a PNG file image would keep its whole
    encoded file (BytesIO, chunk reader) alive beside them, which the cache's byte bound does not
    count."""
    import gc
    import weakref

    from input_builders import image as media

    class Source(io.BytesIO):  # BytesIO itself takes no weak references
        pass

    data = encode(quadrants(), "PNG")
    opened = []
    real_bytesio = media.io.BytesIO
    try:  # media.io is the io module itself: patched only around the decode
        media.io.BytesIO = lambda *args: opened.append(Source(*args)) or opened[-1]
        image = media._decode(data, "test", config)
    finally:
        media.io.BytesIO = real_bytesio
    source = weakref.ref(next(buffer for buffer in opened if buffer.getvalue() == data))
    opened.clear()
    gc.collect()
    assert source() is None and image.mode == "RGB" and image.getpixel((0, 0)) is not None


def test_the_decoded_image_cache_can_be_bounded_below_its_default(monkeypatch):
    from input_builders import image as media

    monkeypatch.setattr(media, "_recently_decoded", media._recently_decoded)  # restored afterwards
    media.limit_decoded_image_cache(16 << 20)
    assert media._recently_decoded.max_bytes == 16 << 20
    media.limit_decoded_image_cache(1 << 40)  # never above the default
    assert media._recently_decoded.max_bytes == media.DECODED_CACHE_MAX_BYTES
    with pytest.raises(ValueError, match="max_bytes >= 0"):
        media.limit_decoded_image_cache(-1)
