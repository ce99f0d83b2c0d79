"""shards.reader.decode_pngs (a shard's PNGs decoded together, as load_split reads them) against
PIL one image at a time and against the pixels that were encoded: every PNG row filter, RGB and
grey, several IDAT chunks; anything it does not take goes back to PIL, damage named as before."""

import io
import zlib

import numpy as np
import pytest
from PIL import Image

from shards.manifest import ShardError
from shards.reader import decode_png, decode_pngs, iter_folder, load_split
from shards.writer import ShardFolder, encode_png


def _chunk(kind: bytes, data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else b if pb <= pc else c


def _png(image: np.ndarray, filters: list[int]) -> bytes:
    """An 8-bit PNG of image [H, W, C] (C = 3: RGB, 1: grey) with row r filtered by filters[r],
    written from the PNG spec byte by byte (no PIL), in two IDAT chunks, with a tEXt chunk."""
    h, w, ch = image.shape
    flat = image.reshape(h, w * ch).astype(int)
    out = bytearray()
    for r in range(h):
        kind, row = filters[r], flat[r]
        prior = flat[r - 1] if r else np.zeros(w * ch, int)
        out.append(kind)
        for x in range(w * ch):
            a = row[x - ch] if x >= ch else 0
            b = prior[x]
            c = prior[x - ch] if x >= ch else 0
            guess = (0, a, b, (a + b) // 2, _paeth(a, b, c))[kind]
            out.append((row[x] - guess) % 256)
    stream = zlib.compress(bytes(out), 9)
    half = len(stream) // 2
    header = w.to_bytes(4, "big") + h.to_bytes(4, "big") + bytes([8, 2 if ch == 3 else 0, 0, 0, 0])
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"tEXt", b"Comment\x00test")
        + _chunk(b"IDAT", stream[:half])
        + _chunk(b"IDAT", stream[half:])
        + _chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("channels", [3, 1])
def test_every_row_filter_decodes_to_the_encoded_pixels_and_pils(channels):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (7, 6, 5, channels), dtype=np.uint8)
    images[0] = 255  # wrap-around in every filter's sum
    images[1] = np.arange(30 * channels).reshape(6, 5, channels) * 37 % 256
    # image i filters row r with (i + r) mod 5: each row of the batch mixes the five filters
    pngs = [_png(im, [(i + r) % 5 for r in range(6)]) for i, im in enumerate(images)]
    got = decode_pngs(pngs)
    rgb = np.repeat(images, 3, axis=3) if channels == 1 else images
    assert got.dtype == np.uint8 and got.shape == (7, 6, 5, 3)
    np.testing.assert_array_equal(got, rgb)
    np.testing.assert_array_equal(got, np.stack([decode_png(p) for p in pngs]))


def test_pils_own_pngs_decode_as_pil_does():
    rng = np.random.default_rng(1)
    smooth = np.cumsum(rng.integers(0, 9, (40, 28, 28, 3)), axis=2).astype(np.uint8)  # Paeth, Up
    noisy = rng.integers(0, 256, (40, 28, 28, 3), dtype=np.uint8)  # None
    pngs = [encode_png(im) for im in (*smooth, *noisy)]
    np.testing.assert_array_equal(decode_pngs(pngs), np.concatenate([smooth, noisy]))
    np.testing.assert_array_equal(decode_pngs(pngs), np.stack([decode_png(p) for p in pngs]))


def _pil_png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_what_it_does_not_take_goes_back_to_pil():
    rgb = np.zeros((4, 4, 3), np.uint8)
    plain = encode_png(rgb)
    palette = _pil_png(Image.fromarray(rgb).convert("P"))
    deep = _pil_png(Image.fromarray(np.zeros((4, 4), np.uint16)))
    other_size = encode_png(np.zeros((4, 5, 3), np.uint8))
    broken = plain[:40] + bytes(8) + plain[48:]  # inside the IDAT stream
    assert decode_pngs([plain, plain]) is not None
    for odd in (palette, deep, other_size, broken, plain[:-12], b"GIF89a"):
        assert decode_pngs([plain, odd]) is None
    assert decode_pngs([]) is None


def _folder(tmp_path, images, pngs=None):
    sf = ShardFolder(tmp_path, "t")
    pngs = pngs or [encode_png(im) for im in images]
    sf.write(0, [{"__key__": f"k{i:03d}", "png": p, "cls": i % 2} for i, p in enumerate(pngs)])
    sf.finish(1, kind="real", class_names=["a", "b"], code_version="test")
    return tmp_path


def test_load_split_reads_the_pixels_pil_reads(tmp_path):
    rng = np.random.default_rng(2)
    images = np.cumsum(rng.integers(0, 5, (300, 12, 12, 3)), axis=1).astype(np.uint8)
    folder = _folder(tmp_path, images)
    split = load_split(folder)
    one_by_one = np.stack([s["image"] for s in iter_folder(folder)])  # decode_sample: PIL
    np.testing.assert_array_equal(split.images.numpy(), one_by_one)
    np.testing.assert_array_equal(split.images.numpy(), images)
    assert split.labels.tolist() == [i % 2 for i in range(300)]


def test_a_damaged_png_is_named_as_before(tmp_path):
    pngs = [encode_png(np.full((6, 6, 3), i, np.uint8)) for i in range(5)]
    pngs[3] = pngs[3][:41] + bytes(6) + pngs[3][47:]  # same length, a broken zlib stream
    folder = _folder(tmp_path, None, pngs)
    with pytest.raises(ShardError, match="png member of sample 'k003' does not decode"):
        load_split(folder)
