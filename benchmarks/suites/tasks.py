"""Seeded generators of small (32×32 RGB) image-classification tasks, built only from data that packages ship.

Sources, all offline:

* scikit-learn: ``load_digits`` (1797 handwritten 8×8 scans) and the two sample photos (china, flower);
* matplotlib: its bundled fonts (DejaVu, STIX, Computer Modern) and sample data (grace_hopper.jpg, two elevation
  maps, one MRI slice);
* procedural drawing with Pillow / numpy (shapes, bars, dots, textures).

There are two kinds of data:

**Evaluation tasks** (:data:`TASKS`): each a distinct visual domain with its own label set, like the 8 datasets of the
CLIP merging papers. Every task has ``train`` / ``val`` / ``test`` splits drawn from independent random streams
(digits additionally uses disjoint scans per split), and a ``prompt`` split: canonical renderings of each class
(black on white, upright, centred: the printed digit, the letter in DejaVu, the whole photo...), the analogue of
CLIP's text prompts, from which the zero-shot heads are built.

**Pretraining mix** (:data:`PRETRAIN_SOURCES`): a broad labelled mix standing in for web-scale pretraining, which
covers the evaluation concepts the way CLIP's data covers its benchmarks, in other renderings and never with the
evaluation images: printed glyphs in the DejaVu fonts (the ``letters`` task uses Computer Modern / STIX, ``digits``
handwriting; ``symbols`` shares some fonts), filled or outlined shapes on plainer backgrounds, gratings in 4 coarse
orientation bins (the task: bars in 8 bins), counting squares (the task: dots), texture families on plain
backgrounds, and small unjittered crops of the same pictures as ``scene``.

Every generator is ``fn(rng, n, split) -> (images uint8 [n, 32, 32, 3], labels int64 [n])`` and is deterministic
given ``rng`` (a :class:`numpy.random.Generator`). Use :func:`make_task` / :func:`make_pretrain_mix`, which
derive the random streams from ``(seed, name, split)``.
"""

from __future__ import annotations

import functools
import gzip
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

SIZE = 32
"""Image side in pixels."""

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

Generator = Callable[[np.random.Generator, int, str], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class TaskSpec:
    name: str
    classes: tuple[str, ...]
    generate: Generator
    description: str


# ----------------------------------------------------------------------------------------------------------------
# Shipped assets
# ----------------------------------------------------------------------------------------------------------------


def _mpl_data() -> Path:
    import matplotlib

    return Path(matplotlib.get_data_path())


def font_path(filename: str) -> str:
    return str(_mpl_data() / "fonts" / "ttf" / filename)


PRETRAIN_FONTS = (
    "DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf", "DejaVuSans-BoldOblique.ttf",
    "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf", "DejaVuSerif-Italic.ttf", "DejaVuSerif-BoldItalic.ttf",
    "DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf", "DejaVuSansMono-Oblique.ttf", "DejaVuSansMono-BoldOblique.ttf",
)  # fmt: skip
LETTER_FONTS = (
    "cmr10.ttf", "cmss10.ttf", "cmtt10.ttf", "cmb10.ttf", "cmti10.ttf",
    "STIXGeneral.ttf", "STIXGeneralBol.ttf", "STIXGeneralItalic.ttf", "STIXGeneralBolIta.ttf",
)  # fmt: skip
SYMBOL_FONTS = PRETRAIN_FONTS[:8] + LETTER_FONTS[5:]


@functools.lru_cache(maxsize=512)
def _font(filename: str, size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(font_path(filename), size)


@functools.lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return (bunch.images / 16.0).astype(np.float32), bunch.target.astype(np.int64)


def _colormapped(values: np.ndarray, cmap: str) -> np.ndarray:
    import matplotlib

    v = values.astype(np.float64)
    lo, hi = np.percentile(v, [1, 99])
    v = np.clip((v - lo) / max(hi - lo, 1e-9), 0, 1)
    return (matplotlib.colormaps[cmap](v)[..., :3] * 255).astype(np.uint8)


@functools.lru_cache(maxsize=1)
def photos() -> dict[str, np.ndarray]:
    """The shipped photographs / rasters as uint8 RGB arrays (the "scenes")."""
    from sklearn.datasets import load_sample_images

    china, flower = load_sample_images().images
    data = _mpl_data() / "sample_data"
    hopper = np.asarray(Image.open(data / "grace_hopper.jpg").convert("RGB"))
    dem = np.load(data / "jacksboro_fault_dem.npz")["elevation"]
    topo = np.load(data / "topobathy.npz")["topo"]
    topo = np.asarray(Image.fromarray(_colormapped(topo, "gist_earth")).resize((360, 273), Image.BICUBIC))
    mri = np.frombuffer(gzip.open(data / "s1045.ima.gz").read(), np.uint16).reshape(256, 256)
    return {
        "china": china, "flower": flower, "hopper": hopper, "terrain": _colormapped(dem, "terrain"),
        "ocean": topo, "mri": _colormapped(mri, "bone"),
    }  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# Drawing helpers
# ----------------------------------------------------------------------------------------------------------------


def _hsv(h: float, s: float, v: float) -> np.ndarray:
    i = int(h * 6) % 6
    f = h * 6 - math.floor(h * 6)
    p, q, t = v * (1 - s), v * (1 - f * s), v * (1 - (1 - f) * s)
    return np.array([(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)][i]) * 255


def _luma(c: np.ndarray) -> float:
    return float(np.dot(c, (0.299, 0.587, 0.114)))


def _colour_pair(rng: np.random.Generator, min_contrast: float = 100) -> tuple[np.ndarray, np.ndarray]:
    """A background and a foreground colour with a luminance difference of at least ``min_contrast``."""
    while True:
        bg = _hsv(rng.random(), rng.uniform(0, 0.9), rng.uniform(0.05, 1))
        fg = _hsv(rng.random(), rng.uniform(0, 1), rng.uniform(0.05, 1))
        if abs(_luma(fg) - _luma(bg)) >= min_contrast:
            return bg, fg


def _photo_crop(rng: np.random.Generator, source: str | None = None, scale: tuple[int, int] = (24, 128)) -> np.ndarray:
    """A random square crop of a shipped photo, nearest-neighbour resampled to 32×32, float [32, 32, 3]."""
    bank = photos()
    img = bank[source or list(bank)[rng.integers(len(bank))]]
    h, w = img.shape[:2]
    s = int(rng.integers(scale[0], min(scale[1], h, w) + 1))
    y0, x0 = rng.integers(0, h - s + 1), rng.integers(0, w - s + 1)
    idx = (np.arange(SIZE) * s / SIZE).astype(int)
    crop = img[y0 + idx][:, x0 + idx].astype(np.float32)
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    return crop


def _background(rng: np.random.Generator, colour: np.ndarray, kind: str) -> np.ndarray:
    """float [32, 32, 3]: ``plain`` (colour + a soft gradient), ``photo`` (a dimmed photo crop tinted towards
    ``colour``) or ``noise`` (smoothed colour noise around ``colour``)."""
    if kind == "plain":
        g = np.linspace(-1, 1, SIZE, dtype=np.float32)
        ramp = rng.uniform(-20, 20) * g[None, :, None] + rng.uniform(-20, 20) * g[:, None, None]
        return np.broadcast_to(colour, (SIZE, SIZE, 3)) + ramp
    if kind == "photo":
        a = rng.uniform(0.25, 0.55)
        return a * _photo_crop(rng) + (1 - a) * colour
    if kind == "noise":
        coarse = rng.normal(0, 1, (8, 8, 3)).astype(np.float32)
        up = np.asarray(Image.fromarray(((coarse + 3) * 40).clip(0, 255).astype(np.uint8)).resize((SIZE, SIZE),
                                                                                               Image.BILINEAR))
        return colour + (up.astype(np.float32) - 120) * rng.uniform(0.2, 0.5)
    raise ValueError(kind)


def _compose(bg: np.ndarray, fg: np.ndarray, mask: np.ndarray, rng: np.random.Generator,
             noise: float = 6.0) -> np.ndarray:
    img = bg * (1 - mask[..., None]) + fg * mask[..., None]
    if noise:
        img = img + rng.normal(0, noise, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def _paint(rng: np.random.Generator, mask: np.ndarray, split: str, kinds: Sequence[str], noise: float = 6.0,
           min_contrast: float = 100) -> np.ndarray:
    """Colour a mask: random contrasting colours on a background of one of ``kinds`` — or, for the ``prompt``
    split, black on plain white (the canonical rendering that the zero-shot heads are built from)."""
    if split == "prompt":
        return _compose(np.full((SIZE, SIZE, 3), 255.0, np.float32), np.zeros(3), mask, rng, noise=0)
    bg, fg = _colour_pair(rng, min_contrast)
    return _compose(_background(rng, bg, kinds[rng.integers(len(kinds))]), fg, mask, rng, noise)


def _labels(rng: np.random.Generator, n: int, num_classes: int, split: str) -> np.ndarray:
    """Uniform random labels; the ``prompt`` split cycles through the classes (balanced)."""
    if split == "prompt":
        return np.arange(n, dtype=np.int64) % num_classes
    return rng.integers(0, num_classes, n).astype(np.int64)


def _glyph_mask(rng: np.random.Generator, char: str, font: str, size: tuple[float, float] = (0.5, 0.85),
                rotate: float = 15.0, jitter: float = 0.15) -> np.ndarray:
    """A 32×32 float mask of ``char`` rendered at 2× and downsampled (anti-aliased)."""
    canvas = 2 * SIZE
    px = int(canvas * rng.uniform(*size))
    img = Image.new("L", (canvas, canvas), 0)
    draw = ImageDraw.Draw(img)
    f = _font(font, px)
    left, top, right, bottom = draw.textbbox((0, 0), char, font=f)
    x = (canvas - (right - left)) / 2 - left + rng.uniform(-jitter, jitter) * canvas
    y = (canvas - (bottom - top)) / 2 - top + rng.uniform(-jitter, jitter) * canvas
    draw.text((x, y), char, fill=255, font=f)
    if rotate:
        img = img.rotate(rng.uniform(-rotate, rotate), resample=Image.BILINEAR)
    return np.asarray(img.resize((SIZE, SIZE), Image.BOX), dtype=np.float32) / 255.0


SHAPES = ("circle", "triangle", "square", "pentagon", "hexagon", "star", "cross", "crescent")
EXTRA_SHAPES = ("ellipse", "arrow", "semicircle", "heart")


def _shape_points(shape: str, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    def polygon(radii: list[float], offset: float = 0.0) -> list[tuple[float, float]]:
        n = len(radii)
        return [(cx + rr * r * math.cos(angle + offset + 2 * math.pi * i / n),
                 cy + rr * r * math.sin(angle + offset + 2 * math.pi * i / n)) for i, rr in enumerate(radii)]

    if shape == "triangle":
        return polygon([1.0] * 3)
    if shape == "square":
        return polygon([1.0] * 4)
    if shape == "pentagon":
        return polygon([1.0] * 5)
    if shape == "hexagon":
        return polygon([1.0] * 6)
    if shape == "star":
        return polygon([1.0, 0.42] * 5)
    if shape == "cross":
        w = 0.36
        pts = [(w, 1), (w, w), (1, w), (1, -w), (w, -w), (w, -1), (-w, -1), (-w, -w), (-1, -w), (-1, w), (-w, w),
               (-w, 1)]
    elif shape == "arrow":
        pts = [(-1, -0.3), (0.2, -0.3), (0.2, -0.75), (1, 0), (0.2, 0.75), (0.2, 0.3), (-1, 0.3)]
    elif shape == "semicircle":
        pts = [(math.cos(t), math.sin(t) - 0.4) for t in np.linspace(0, math.pi, 24)]
    elif shape == "heart":
        ts = np.linspace(0, 2 * math.pi, 40)
        pts = [(math.sin(t) ** 3,
                -(13 * math.cos(t) - 5 * math.cos(2 * t) - 2 * math.cos(3 * t) - math.cos(4 * t)) / 16) for t in ts]
    else:
        raise ValueError(shape)
    c, s = math.cos(angle), math.sin(angle)
    return [(cx + r * (x * c - y * s), cy + r * (x * s + y * c)) for x, y in pts]


def _shape_mask(rng: np.random.Generator, shape: str, outline: bool = False, r_range: tuple[float, float] = (7, 13),
                jitter: float = 5.0, canonical: bool = False) -> np.ndarray:
    """A 32×32 float mask of ``shape`` (filled or outlined), drawn at 4× and downsampled; ``canonical``: centred,
    radius 11, upright."""
    k = 4
    img = Image.new("L", (SIZE * k, SIZE * k), 0)
    draw = ImageDraw.Draw(img)
    r = rng.uniform(*r_range) * k
    cx, cy = (SIZE / 2 + rng.uniform(-jitter, jitter)) * k, (SIZE / 2 + rng.uniform(-jitter, jitter)) * k
    angle = rng.uniform(0, 2 * math.pi)
    if canonical:
        r, cx, cy = 11 * k, SIZE / 2 * k, SIZE / 2 * k
        angle = -math.pi / 4 if shape == "square" else -math.pi / 2
    width = int(rng.uniform(1.5, 2.5) * k)
    fill, line = (None, 255) if outline else (255, None)
    if shape in ("circle", "ellipse"):
        ry = r * (rng.uniform(0.45, 0.65) if shape == "ellipse" else 1.0)
        box = [cx - r, cy - ry, cx + r, cy + ry]
        if shape == "ellipse":
            layer = Image.new("L", img.size, 0)
            ImageDraw.Draw(layer).ellipse(box, fill=fill, outline=line, width=width)
            img = layer.rotate(math.degrees(angle), center=(cx, cy), resample=Image.BILINEAR)
        else:
            draw.ellipse(box, fill=fill, outline=line, width=width)
    elif shape == "crescent":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill, outline=line, width=width)
        dx, dy = 0.55 * r * math.cos(angle), 0.55 * r * math.sin(angle)
        cut = 0.85 * r
        box = [cx + dx - cut, cy + dy - cut, cx + dx + cut, cy + dy + cut]
        draw.ellipse(box, fill=0, outline=(255 if outline else None), width=width)
        if outline:  # keep only the outer arc + the inner arc: clear the inside of the cut disc
            inner = cut - width
            draw.ellipse([cx + dx - inner, cy + dy - inner, cx + dx + inner, cy + dy + inner], fill=0)
    else:
        pts = _shape_points(shape, cx, cy, r, angle)
        if outline:
            draw.line(pts + pts[:1], fill=255, width=width, joint="curve")
        else:
            draw.polygon(pts, fill=255)
    return np.asarray(img.resize((SIZE, SIZE), Image.BOX), dtype=np.float32) / 255.0


def _grid() -> tuple[np.ndarray, np.ndarray]:
    y, x = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)
    return x - SIZE / 2 + 0.5, y - SIZE / 2 + 0.5


def _bar_mask(angle: float, cx: float, cy: float, length: float, width: float) -> np.ndarray:
    """Anti-aliased mask of a bar through (cx, cy) (pixel offsets from the centre) at ``angle`` radians."""
    x, y = _grid()
    x, y = x - cx, y - cy
    along = x * math.cos(angle) + y * math.sin(angle)
    across = -x * math.sin(angle) + y * math.cos(angle)
    m_across = np.clip(width / 2 + 0.5 - np.abs(across), 0, 1)
    m_along = np.clip(length / 2 + 0.5 - np.abs(along), 0, 1)
    return m_across * m_along


def _disc_mask(cx: float, cy: float, r: float) -> np.ndarray:
    x, y = _grid()
    return np.clip(r + 0.5 - np.hypot(x - cx, y - cy), 0, 1)


def _dots(rng: np.random.Generator, count: int, r_range: tuple[float, float], square: bool = False) -> np.ndarray:
    """Mask of ``count`` non-overlapping discs (or squares) of random radius inside the image."""
    mask = np.zeros((SIZE, SIZE), np.float32)
    placed: list[tuple[float, float, float]] = []
    while len(placed) < count:
        r = rng.uniform(*r_range)
        cx, cy = rng.uniform(-SIZE / 2 + r + 1, SIZE / 2 - r - 1, size=2)
        if all(math.hypot(cx - px, cy - py) > r + pr + 2 for px, py, pr in placed):
            placed.append((cx, cy, r))
            if square:
                mask = np.maximum(mask, _bar_mask(0.0, cx, cy, 2 * r, 2 * r))
            else:
                mask = np.maximum(mask, _disc_mask(cx, cy, r))
    return mask


# ----------------------------------------------------------------------------------------------------------------
# Evaluation tasks
# ----------------------------------------------------------------------------------------------------------------

DIGIT_SPLITS = {"test": (0, 500), "val": (500, 700), "train": (700, 1797)}
"""Disjoint ranges of a fixed permutation of the 1797 sklearn scans."""


def _digit_indices(split: str) -> np.ndarray:
    order = np.random.default_rng(1797).permutation(1797)
    lo, hi = DIGIT_SPLITS[split]
    return order[lo:hi]


def gen_digits(rng: np.random.Generator, n: int, split: str):
    """Handwritten digits (sklearn scans, disjoint per split), recoloured, rescaled and placed on clutter."""
    if split == "prompt":  # printed digits: the "class names"
        labels = _labels(rng, n, 10, split)
        masks = [_glyph_mask(rng, str(c), PRETRAIN_FONTS[4 * (i % 3)], size=(0.7, 0.7), rotate=0, jitter=0)
                 for i, c in enumerate(labels)]
        return np.stack([_paint(rng, m, split, ()) for m in masks]), labels
    images, targets = _digits()
    pool = _digit_indices(split)
    idx = pool[rng.permutation(len(pool))[:n]] if n <= len(pool) else rng.choice(pool, n)
    out = np.empty((n, SIZE, SIZE, 3), np.uint8)
    for i, j in enumerate(idx):
        s = int(rng.integers(20, 31))
        scan = Image.fromarray((images[j] * 255).astype(np.uint8)).resize((s, s), Image.BILINEAR)
        mask = np.zeros((SIZE, SIZE), np.float32)
        y0, x0 = rng.integers(0, SIZE - s + 1, size=2)
        mask[y0:y0 + s, x0:x0 + s] = np.asarray(scan, np.float32) / 255.0
        out[i] = _paint(rng, mask, split, ("plain", "noise"), noise=4)
    return out, targets[idx]


LETTERS = tuple("AEFGHKMQRW")


def gen_letters(rng: np.random.Generator, n: int, split: str):
    """Ten capital letters in the Computer Modern and STIX fonts (not seen in pretraining), rotated, on clutter."""
    labels = _labels(rng, n, len(LETTERS), split)
    out = np.empty((n, SIZE, SIZE, 3), np.uint8)
    for i, c in enumerate(labels):
        if split == "prompt":
            mask = _glyph_mask(rng, LETTERS[c], PRETRAIN_FONTS[4 * (i % 3)], size=(0.7, 0.7), rotate=0, jitter=0)
        else:
            mask = _glyph_mask(rng, LETTERS[c], LETTER_FONTS[rng.integers(len(LETTER_FONTS))], size=(0.6, 0.9),
                               rotate=10, jitter=0.08)
        out[i] = _paint(rng, mask, split, ("plain", "noise"), noise=4)
    return out, labels


SYMBOLS = tuple("#$%&@?+=§*")


def gen_symbols(rng: np.random.Generator, n: int, split: str):
    """Ten typographic symbols (absent from pretraining) in DejaVu / STIX fonts."""
    labels = _labels(rng, n, len(SYMBOLS), split)
    out = np.empty((n, SIZE, SIZE, 3), np.uint8)
    for i, c in enumerate(labels):
        if split == "prompt":
            mask = _glyph_mask(rng, SYMBOLS[c], PRETRAIN_FONTS[4 * (i % 3)], size=(0.7, 0.7), rotate=0, jitter=0)
        else:
            mask = _glyph_mask(rng, SYMBOLS[c], SYMBOL_FONTS[rng.integers(len(SYMBOL_FONTS))], size=(0.6, 0.9),
                               rotate=10, jitter=0.08)
        out[i] = _paint(rng, mask, split, ("plain", "noise"), noise=4)
    return out, labels


def gen_shapes(rng: np.random.Generator, n: int, split: str):
    """Eight filled shapes, any rotation / size / colour, on photo or noise clutter."""
    labels = _labels(rng, n, len(SHAPES), split)
    out = np.empty((n, SIZE, SIZE, 3), np.uint8)
    for i, c in enumerate(labels):
        mask = _shape_mask(rng, SHAPES[c], outline=False, r_range=(8, 13), jitter=3, canonical=split == "prompt")
        out[i] = _paint(rng, mask, split, ("plain", "noise"), noise=4)
    return out, labels


ORIENTATIONS = tuple(f"{a:g}deg" for a in np.arange(8) * 22.5)


def gen_orientation(rng: np.random.Generator, n: int, split: str):
    """A single bar; class = its orientation in 8 bins of 22.5° (angle within ±7° of the bin centre)."""
    labels = _labels(rng, n, 8, split)
    out = np.empty((n, SIZE, SIZE, 3), np.uint8)
    for i, c in enumerate(labels):
        if split == "prompt":
            mask = _bar_mask(math.radians(c * 22.5), 0, 0, 24, 3)
        else:
            angle = math.radians(c * 22.5 + rng.uniform(-7, 7))
            cx, cy = rng.uniform(-5, 5, size=2)
            mask = _bar_mask(angle, cx, cy, rng.uniform(14, 26), rng.uniform(2, 5))
        out[i] = _paint(rng, mask, split, ("plain", "noise"), noise=4)
    return out, labels


COUNTS = tuple(str(k) for k in range(1, 7))


def gen_count(rng: np.random.Generator, n: int, split: str):
    """1 to 6 dots of random size; class = how many."""
    labels = _labels(rng, n, len(COUNTS), split)
    out = np.empty((n, SIZE, SIZE, 3), np.uint8)
    for i, c in enumerate(labels):
        mask = _dots(rng, int(c) + 1, (2.5, 2.5) if split == "prompt" else (2.0, 3.5))
        out[i] = _paint(rng, mask, split, ("plain", "noise"), noise=4)
    return out, labels


TEXTURES = ("stripes", "checker", "dots", "grid", "waves", "rings", "noise", "bricks")


def _texture_mask(rng: np.random.Generator, kind: str, canonical: bool = False) -> np.ndarray:
    x, y = _grid()
    a = 0.0 if canonical else rng.uniform(0, math.pi)
    u = x * math.cos(a) + y * math.sin(a)
    v = -x * math.sin(a) + y * math.cos(a)
    period = 6.0 if canonical else rng.uniform(4, 9)
    phase = rng.uniform(0, 2 * math.pi)
    w = 2 * math.pi / period
    if kind == "stripes":
        m = np.sin(w * u + phase) > 0
    elif kind == "checker":
        m = (np.sin(w * u + phase) > 0) ^ (np.sin(w * v) > 0)
    elif kind == "dots":
        m = np.hypot(((u / period + phase) % 1) - 0.5, ((v / period) % 1) - 0.5) < rng.uniform(0.2, 0.32)
    elif kind == "grid":
        t = rng.uniform(0.12, 0.22)
        m = (((u / period + phase) % 1) < t) | (((v / period) % 1) < t)
    elif kind == "waves":
        m = np.sin(w * u + 2.5 * np.sin(v * rng.uniform(0.3, 0.6)) + phase) > 0
    elif kind == "rings":
        cx, cy = rng.uniform(-12, 12, size=2)
        m = np.sin(w * np.hypot(x - cx, y - cy) + phase) > 0
    elif kind == "noise":
        m = rng.random((SIZE, SIZE)) < 0.5
    elif kind == "bricks":
        row = np.floor(v / period)
        t = 0.18
        m = (((v / period) % 1) < t) | ((((u / (2 * period)) + 0.5 * row) % 1) < t / 2)
    else:
        raise ValueError(kind)
    return m.astype(np.float32)


def gen_texture(rng: np.random.Generator, n: int, split: str):
    """Eight procedural textures at random scale / rotation / colours."""
    labels = _labels(rng, n, len(TEXTURES), split)
    out = np.empty((n, SIZE, SIZE, 3), np.uint8)
    for i, c in enumerate(labels):
        mask = _texture_mask(rng, TEXTURES[c], canonical=split == "prompt")
        out[i] = _paint(rng, mask, split, ("plain", "noise"), noise=10, min_contrast=50)
    return out, labels


SCENES = ("china", "flower", "hopper", "terrain", "ocean", "mri")


def gen_scene(rng: np.random.Generator, n: int, split: str):
    """Which shipped photo / raster a random crop comes from (6 "scenes"), with colour jitter."""
    names = SCENES
    labels = _labels(rng, n, len(names), split)
    out = np.empty((n, SIZE, SIZE, 3), np.uint8)
    for i, c in enumerate(labels):
        if split == "prompt":  # the whole picture, downsampled
            img = photos()[names[c]]
            side = min(img.shape[:2])
            out[i] = np.asarray(Image.fromarray(img[:side, :side]).resize((SIZE, SIZE), Image.BOX))
            continue
        crop = _photo_crop(rng, names[c], scale=(20, 160))
        crop = crop * rng.uniform(0.7, 1.3, size=3) + rng.uniform(-25, 25)
        out[i] = np.clip(crop + rng.normal(0, 4, crop.shape), 0, 255).astype(np.uint8)
    return out, labels.astype(np.int64)


TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in [
        TaskSpec("digits", tuple(str(d) for d in range(10)), gen_digits, "handwritten digits (sklearn scans)"),
        TaskSpec("letters", LETTERS, gen_letters, "capital letters in Computer Modern / STIX"),
        TaskSpec("symbols", SYMBOLS, gen_symbols, "typographic symbols"),
        TaskSpec("shapes", SHAPES, gen_shapes, "filled shapes on clutter"),
        TaskSpec("orientation", ORIENTATIONS, gen_orientation, "bar orientation, 8 bins"),
        TaskSpec("count", COUNTS, gen_count, "number of dots, 1-6"),
        TaskSpec("texture", TEXTURES, gen_texture, "procedural textures"),
        TaskSpec("scene", SCENES, gen_scene, "source of a photo crop"),
    ]
}
"""The evaluation tasks, in their default order."""


# ----------------------------------------------------------------------------------------------------------------
# Pretraining mix
# ----------------------------------------------------------------------------------------------------------------

GLYPHS = tuple("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") + SYMBOLS
"""Printed digits, letters and symbols in the DejaVu fonts (the ``letters`` task uses other fonts, ``digits``
handwriting)."""


def pre_glyphs(rng: np.random.Generator, n: int, split: str):
    labels = rng.integers(0, len(GLYPHS), n)
    out = np.empty((n, SIZE, SIZE, 3), np.uint8)
    for i, c in enumerate(labels):
        mask = _glyph_mask(rng, GLYPHS[c], PRETRAIN_FONTS[rng.integers(len(PRETRAIN_FONTS))], size=(0.6, 0.9),
                           rotate=10, jitter=0.08)
        out[i] = _paint(rng, mask, split, ("plain", "noise"), noise=4)
    return out, labels.astype(np.int64)


OUTLINE_SHAPES = SHAPES + EXTRA_SHAPES


def pre_outlines(rng: np.random.Generator, n: int, split: str):
    labels = rng.integers(0, len(OUTLINE_SHAPES), n)
    out = np.empty((n, SIZE, SIZE, 3), np.uint8)
    for i, c in enumerate(labels):
        mask = _shape_mask(rng, OUTLINE_SHAPES[c], outline=bool(rng.random() < 0.5), r_range=(8, 13), jitter=3)
        out[i] = _paint(rng, mask, split, ("plain", "noise"), noise=4)
    return out, labels.astype(np.int64)


def pre_gratings(rng: np.random.Generator, n: int, split: str):
    """Full-field sinusoidal gratings; label = orientation in 4 coarse bins (0/45/90/135° ± 22.5°)."""
    labels = rng.integers(0, 4, n)
    out = np.empty((n, SIZE, SIZE, 3), np.uint8)
    x, y = _grid()
    for i, c in enumerate(labels):
        a = math.radians(c * 45 + rng.uniform(-22.5, 22.5))
        wave = 0.5 + 0.5 * np.sin(2 * math.pi / rng.uniform(3, 10) * (x * math.cos(a) + y * math.sin(a))
                                  + rng.uniform(0, 2 * math.pi))
        bg, fg = _colour_pair(rng)
        out[i] = _compose(_background(rng, bg, "plain"), fg, wave.astype(np.float32), rng, noise=3)
    return out, labels.astype(np.int64)


def pre_squares(rng: np.random.Generator, n: int, split: str):
    """1 to 6 squares; label = how many."""
    labels = rng.integers(0, 6, n)
    out = np.empty((n, SIZE, SIZE, 3), np.uint8)
    for i, c in enumerate(labels):
        mask = _dots(rng, int(c) + 1, (1.5, 3.0), square=True)
        bg, fg = _colour_pair(rng)
        out[i] = _compose(_background(rng, bg, "plain"), fg, mask, rng, noise=3)
    return out, labels.astype(np.int64)


def pre_textures(rng: np.random.Generator, n: int, split: str):
    """The texture families, as named in the pretraining "captions" (other draws than the ``texture`` task's)."""
    labels = rng.integers(0, len(TEXTURES), n)
    out = np.empty((n, SIZE, SIZE, 3), np.uint8)
    for i, c in enumerate(labels):
        out[i] = _paint(rng, _texture_mask(rng, TEXTURES[c]), split, ("plain",), noise=4, min_contrast=60)
    return out, labels.astype(np.int64)


def pre_photos(rng: np.random.Generator, n: int, split: str):
    """Which shipped picture a small crop (12-48 px, no colour jitter) comes from."""
    labels = rng.integers(0, len(SCENES), n)
    out = np.empty((n, SIZE, SIZE, 3), np.uint8)
    for i, c in enumerate(labels):
        out[i] = np.clip(_photo_crop(rng, SCENES[c], scale=(12, 48)), 0, 255).astype(np.uint8)
    return out, labels.astype(np.int64)


PRETRAIN_SOURCES: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in [
        TaskSpec("glyphs", GLYPHS, pre_glyphs, "printed glyphs in DejaVu fonts"),
        TaskSpec("outlines", OUTLINE_SHAPES, pre_outlines, "filled or outlined shapes"),
        TaskSpec("gratings", ("0", "45", "90", "135"), pre_gratings, "grating orientation, 4 coarse bins"),
        TaskSpec("squares", COUNTS, pre_squares, "number of squares"),
        TaskSpec("textures", TEXTURES, pre_textures, "texture families"),
        TaskSpec("photos", SCENES, pre_photos, "source of a small photo crop"),
    ]
}
"""The labelled pretraining mix (its labels are its own: no evaluation task's images or label set)."""


# ----------------------------------------------------------------------------------------------------------------
# Public helpers
# ----------------------------------------------------------------------------------------------------------------

SPLIT_IDS = {"train": 0, "val": 1, "test": 2, "pretrain": 3, "prompt": 4}


def task_rng(seed: int, name: str, split: str) -> np.random.Generator:
    """The random stream of ``(seed, name, split)``: independent across names and splits, stable across runs."""
    return np.random.default_rng([seed, zlib.crc32(name.encode()), SPLIT_IDS[split]])


def make_task(name: str, sizes: dict[str, int], seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Build the splits of evaluation task ``name``: ``{split: (uint8 [n, 32, 32, 3], int64 [n])}``."""
    spec = TASKS[name]
    return {split: spec.generate(task_rng(seed, name, split), n, split) for split, n in sizes.items()}


def make_pretrain_mix(n_per_source: int, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Build the pretraining mix: ``{source: (uint8 images, int64 labels)}``."""
    return {name: spec.generate(task_rng(seed, name, "pretrain"), n_per_source, "pretrain")
            for name, spec in PRETRAIN_SOURCES.items()}


def to_pixel_values(images: np.ndarray, size: int | None = None, mean: Sequence[float] = CLIP_MEAN,
                    std: Sequence[float] = CLIP_STD) -> "torch.Tensor":  # noqa: F821
    """uint8 ``[n, H, W, 3]`` → float ``[n, 3, H, W]`` normalised as an image processor does (rescale by 1/255,
    then (x - mean) / std; CLIP's mean/std by default); ``size`` first resizes to ``size``×``size`` (bicubic,
    antialiased)."""
    import torch

    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() * (1 / 255)
    if size is not None and tuple(x.shape[-2:]) != (size, size):
        x = torch.nn.functional.interpolate(x, size=(size, size), mode="bicubic", antialias=True,
                                            align_corners=False).clamp_(0, 1)
    mean_t = torch.tensor(mean).view(1, 3, 1, 1)
    std_t = torch.tensor(std).view(1, 3, 1, 1)
    return ((x - mean_t) / std_t).contiguous()


def contact_sheet(images: np.ndarray, columns: int = 16, scale: int = 2) -> Image.Image:
    """A grid of same-sized images (for looking at a task)."""
    n, h, w = images.shape[:3]
    rows = -(-n // columns)
    sheet = np.zeros((rows * h, columns * w, 3), np.uint8)
    for i, img in enumerate(images):
        r, c = divmod(i, columns)
        sheet[r * h:(r + 1) * h, c * w:(c + 1) * w] = img
    return Image.fromarray(sheet).resize((columns * w * scale, rows * h * scale), Image.NEAREST)
