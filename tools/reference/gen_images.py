"""Reference data for the image pipeline (tests/data/test_images.cpp): decoded pixels and
torchvision transforms, made with PIL (libjpeg-turbo, libpng) and torchvision 0.14.

Run with /usr/bin/python3 from the repository root:
    /usr/bin/python3 tools/reference/gen_images.py
Writes tests/data/images/*.{jpg,png} (small hand-made files: every colour type Tessera converts,
and broken ones) and tests/data/images.safetensors:
    decode.<file>.rgb / .l     PIL's Image.open(f).convert("RGB") / convert("L") as (H, W, C) bytes
    crop.<case>                 F.resized_crop(img, top, left, h, w, [oh, ow]) (PIL, bilinear) bytes;
                                metadata crop.<case> = "file top left h w oh ow"
    eval.<case>                 F.center_crop(F.resize(img, resize), crop) bytes; metadata "file resize crop"
    tensor.<case>               Normalize(mean, std)(ToTensor()(F.hflip(crop))) float32 (C, H, W);
                                metadata "file top left h w oh ow mean0 mean1 mean2 std0 std1 std2"
The C++ test reads the configurations from the metadata, so the two cannot drift apart.
"""
import io
import os
import sys

import numpy as np
from PIL import Image
import torch
import torchvision.transforms as T
import torchvision.transforms.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/
from tessera_tools.safetensors_io import save  # noqa: E402

OUT = "tests/data/images"
rng = np.random.default_rng(7)


def smooth_rgb(h, w):
    """A photo-like image: smooth gradients, a few edges and some noise (JPEG-relevant content)."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    r = 128 + 100 * np.sin(x / 7.0) * np.cos(y / 11.0)
    g = 128 + 90 * np.cos((x + y) / 13.0)
    b = np.where((x // 9 + y // 7) % 2 == 0, 200.0, 40.0)
    img = np.stack([r, g, b], axis=-1) + rng.normal(0, 12, (h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def main():
    os.makedirs(OUT, exist_ok=True)
    files = {}
    rgb = smooth_rgb(29, 37)
    big = smooth_rgb(120, 160)
    files["rgb_420.jpg"] = lambda p: Image.fromarray(rgb).save(p, quality=85)
    files["rgb_444.jpg"] = lambda p: Image.fromarray(rgb).save(p, quality=92, subsampling=0)
    files["big.jpg"] = lambda p: Image.fromarray(big).save(p, quality=90)
    files["grey.jpg"] = lambda p: Image.fromarray(rgb[:, :, 0]).save(p, quality=90)
    files["cmyk.jpg"] = lambda p: Image.fromarray(rgb).convert("CMYK").save(p, quality=95)
    files["progressive.jpg"] = lambda p: Image.fromarray(rgb).save(p, quality=80, progressive=True)
    files["rgb.png"] = lambda p: Image.fromarray(big).save(p)
    files["grey.png"] = lambda p: Image.fromarray(rgb[:, :, 1]).save(p)
    alpha = np.concatenate([rgb, rng.integers(0, 256, (29, 37, 1), dtype=np.uint8)], axis=-1)
    files["rgba.png"] = lambda p: Image.fromarray(alpha, "RGBA").save(p)
    files["grey_alpha.png"] = lambda p: Image.fromarray(alpha[:, :, 1:3].copy(), "LA").save(p)
    files["palette.png"] = lambda p: Image.fromarray(rgb).quantize(16).save(p, transparency=3)
    files["interlaced.png"] = lambda p: _interlaced(p, rgb)  # PIL cannot write interlaced PNGs
    files["bits1.png"] = lambda p: Image.fromarray(rgb[:, :, 2] > 128).save(p)
    files["rgb16.png"] = lambda p: _rgb16(p, rgb)
    for name, make in files.items():
        make(os.path.join(OUT, name))

    # Broken files: each must give an error naming it.
    jpeg = open(os.path.join(OUT, "big.jpg"), "rb").read()
    png = open(os.path.join(OUT, "rgb.png"), "rb").read()
    broken = {
        "broken_truncated.jpg": jpeg[: len(jpeg) // 2],
        "broken_truncated.png": png[: len(png) // 2],
        "broken_empty.png": b"",
        "broken_garbage.jpg": bytes(rng.integers(0, 256, 300, dtype=np.uint8)),
        "broken_header.jpg": jpeg[:40],
        "broken_crc.png": _corrupt_idat(png),
        "broken_bmp_named.png": _bmp(rgb),
    }
    for name, data in broken.items():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)

    tensors, meta = {}, {}
    for name in sorted(files):
        with Image.open(os.path.join(OUT, name)) as im:
            tensors[f"decode.{name}.rgb"] = np.asarray(im.convert("RGB"))
            if name != "rgb16.png":
                tensors[f"decode.{name}.l"] = np.asarray(im.convert("L"))[:, :, None]

    def load(name):
        return Image.open(os.path.join(OUT, name)).convert("RGB")

    crops = {  # file top left h w oh ow
        "down_big": ("big.jpg", 10, 20, 100, 130, 24, 24),    # downscale: filter support > 1
        "up_small": ("rgb_420.jpg", 3, 5, 11, 13, 32, 40),    # upscale
        "mixed": ("big.jpg", 0, 0, 120, 160, 200, 50),        # up one way, down the other
        "same_w": ("rgb.png", 5, 7, 60, 64, 30, 64),          # vertical pass only
        "same_h": ("rgb.png", 5, 7, 60, 64, 60, 17),          # horizontal pass only
        "edge": ("big.jpg", 90, 140, 30, 20, 9, 9),           # crop at the image's corner
    }
    for case, (f, top, left, h, w, oh, ow) in crops.items():
        out = F.resized_crop(load(f), top, left, h, w, [oh, ow], interpolation=T.InterpolationMode.BILINEAR)
        tensors[f"crop.{case}"] = np.asarray(out)
        meta[f"crop.{case}"] = f"{f} {top} {left} {h} {w} {oh} {ow}"
    evals = {  # file resize crop
        "standard": ("big.jpg", 64, 56),
        "odd": ("big.jpg", 45, 33),
        "tall": ("rgb_420.jpg", 50, 41),
        "pad": ("rgb_420.jpg", 0, 40),  # crop larger than the image: zero padding
    }
    for case, (f, resize, crop) in evals.items():
        img = load(f)
        if resize:
            img = F.resize(img, resize, interpolation=T.InterpolationMode.BILINEAR)
        tensors[f"eval.{case}"] = np.asarray(F.center_crop(img, crop))
        meta[f"eval.{case}"] = f"{f} {resize} {crop}"
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    for case, (f, top, left, h, w, oh, ow) in {"flip_norm": ("big.jpg", 7, 9, 90, 100, 28, 20)}.items():
        img = F.hflip(F.resized_crop(load(f), top, left, h, w, [oh, ow]))
        t = T.Normalize(mean, std)(T.ToTensor()(img))
        tensors[f"tensor.{case}"] = t.numpy().astype(np.float32)
        meta[f"tensor.{case}"] = " ".join(str(v) for v in (f, top, left, h, w, oh, ow, *mean, *std))
    save("tests/data/images.safetensors", tensors, meta)
    print(f"wrote {len(files) + len(broken)} files to {OUT} and {len(tensors)} tensors")


def _interlaced(path, rgb):
    # PIL cannot write interlaced PNGs; build one with zlib by hand (Adam7, filter 0 everywhere).
    import struct
    import zlib
    h, w, _ = rgb.shape
    passes = [(0, 0, 8, 8), (0, 4, 8, 8), (4, 0, 8, 4), (0, 2, 4, 4), (2, 0, 4, 2), (0, 1, 2, 2), (1, 0, 2, 1)]
    raw = b""
    for y0, x0, dy, dx in passes:
        sub = rgb[y0::dy, x0::dx]
        if sub.size == 0:
            continue
        for row in sub:
            raw += b"\x00" + row.tobytes()

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xffffffff)

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 1)
    data = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    with open(path, "wb") as f:
        f.write(data)


def _rgb16(path, rgb):
    import struct
    import zlib
    h, w, _ = rgb.shape
    wide = (rgb.astype(np.uint16) * 257 + rng.integers(0, 256, rgb.shape)).clip(0, 65535).astype(">u2")
    raw = b"".join(b"\x00" + row.tobytes() for row in wide)

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xffffffff)

    ihdr = struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def _corrupt_idat(png):
    i = png.index(b"IDAT") + 20
    return png[:i] + bytes([png[i] ^ 0x55]) + png[i + 1:]


def _bmp(rgb):
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="BMP")
    return buf.getvalue()


if __name__ == "__main__":
    main()
