"""Eight classification tasks from distinct input domains, rendered at 98×98 px from data that packages ship.

Each generator is ``generate(rng, n, split) -> (uint8 [n, 98, 98, 3], int64 [n])`` with balanced classes (every
class ``n // C`` or ``n // C + 1`` times, shuffled). Splits: ``train`` (fine-tuning),
``exemplar`` (the few labelled images per class that build the frozen heads), ``val`` and ``test``. Wherever the
source has distinct items (scans, garments, drawings, emoji, photo regions), the four splits draw from disjoint
items, so val and test measure generalisation to unseen items, not to new placements of seen ones.
:func:`generate_with_items` also returns each image's source item (the unit a statistic over test images should
resample: images of one item are not independent): the scan (digits), garment (fashion), drawing (clipart), emoji,
or photo region (scene); procedural images (script, texture, shapes) are each their own item.

Sources (Debian packages install with ``apt-get install``; see :data:`APT_PACKAGES`):

* ``fashion``  Fashion-MNIST in its own polarity (light garment on black), ``dataset-fashion-mnist``
* ``digits``   the 5000 handwritten digits of OpenCV's ``digits.png``, ``opencv-doc``
* ``clipart``  top-level category of a public-domain drawing, ``openclipart-png``
* ``script``   writing system of a few rendered letters, ``fonts-noto-core``
* ``emoji``    category of a colour emoji (faces, hands, animals, ...), ``fonts-noto-color-emoji``
* ``scene``    which photograph a crop comes from (OpenCV's sample photos + scikit-learn's two), crops of disjoint
  regions per split
* ``texture``  procedural texture family (stripes, checker, dots, ...), random scale, angle and colours
* ``shapes``   procedural filled shape (circle, triangle, ...), random size, angle, colours and background
"""

from __future__ import annotations

import functools
import gzip
import math
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

SIZE = 98
"""Image side: 7×7 patches of 14 px + CLS, the token count of ViT-B/32 at 224 px."""

APT_PACKAGES = ("dataset-fashion-mnist", "opencv-doc", "openclipart-png", "fonts-noto-core",
                "fonts-noto-color-emoji")
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
OPENCV_DIR = Path("/usr/share/doc/opencv-doc/examples/data")
CLIPART_DIR = Path("/usr/share/openclipart/png")
NOTO_DIR = Path("/usr/share/fonts/truetype/noto")
EMOJI_FONT = NOTO_DIR / "NotoColorEmoji.ttf"
SPLITS = ("train", "exemplar", "val", "test")

Generator = Callable[[np.random.Generator, int, str], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Domain:
    name: str
    classes: tuple[str, ...]
    generate: Generator
    source: str
    """What the images are and which package ships them."""
    required: tuple[Path, ...] = ()
    """Files that must exist (with the apt package that installs each one, in ``source``)."""


def split_items(keys: list[str], weights: tuple[int, int, int, int] = (12, 2, 3, 3)) -> dict[str, list[str]]:
    """A stable split of named items: sorted by a hash of the name, then cut into train / exemplar / val / test in
    proportion to ``weights``, each split getting at least one item."""
    order = sorted(keys, key=lambda k: (zlib.crc32(k.encode()), k))
    total, out, start = sum(weights), {}, 0
    for i, (split, w) in enumerate(zip(SPLITS, weights)):
        left = len(SPLITS) - i - 1
        size = max(1, round(len(order) * w / total)) if left else len(order) - start
        size = min(size, len(order) - start - left)
        out[split], start = order[start:start + size], start + size
    return out


def balanced_labels(rng: np.random.Generator, n: int, num_classes: int) -> np.ndarray:
    labels = np.arange(n, dtype=np.int64) % num_classes
    rng.shuffle(labels)
    return labels


def place(canvas: np.ndarray, patch: np.ndarray, rng: np.random.Generator, alpha: np.ndarray | None = None) -> None:
    """Paste ``patch`` (h, w, 3) at a random position of ``canvas`` (in place), alpha-blended when given."""
    h, w = patch.shape[:2]
    y, x = rng.integers(0, SIZE - h + 1), rng.integers(0, SIZE - w + 1)
    region = canvas[y:y + h, x:x + w]
    if alpha is None:
        region[...] = patch
    else:
        a = alpha[..., None].astype(np.float32) / 255
        region[...] = (a * patch + (1 - a) * region).round().astype(np.uint8)


def resized(image: Image.Image, side: int) -> Image.Image:
    """``image`` scaled so that its longer side is ``side`` (bilinear, antialiased)."""
    scale = side / max(image.size)
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    return image.resize(size, Image.Resampling.BILINEAR, reducing_gap=None)


def random_colour(rng: np.random.Generator, light: bool | None = None) -> np.ndarray:
    lo, hi = {None: (0, 256), True: (150, 256), False: (0, 110)}[light]
    return rng.integers(lo, hi, 3).astype(np.uint8)


# ----------------------------------------------------------------------------------------------- fashion, digits
FASHION = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot")


@functools.cache
def _fashion(part: str) -> tuple[np.ndarray, np.ndarray]:
    def idx(name: str, offset: int) -> np.ndarray:
        with gzip.open(FASHION_DIR / name) as f:
            return np.frombuffer(f.read(), np.uint8, offset=offset)

    images = idx(f"{part}-images-idx3-ubyte.gz", 16).reshape(-1, 28, 28)
    return images, idx(f"{part}-labels-idx1-ubyte.gz", 8).astype(np.int64)


def _fashion_pool(split: str) -> tuple[np.ndarray, np.ndarray]:
    """train: the first 55000 training images; exemplar: the last 5000; val / test: halves of the test set."""
    if split in ("train", "exemplar"):
        images, labels = _fashion("train")
        cut = slice(0, 55000) if split == "train" else slice(55000, None)
    else:
        images, labels = _fashion("t10k")
        cut = slice(0, 5000) if split == "val" else slice(5000, None)
    return images[cut], labels[cut]


def _grey_on_black(rng: np.random.Generator, cells: np.ndarray, sides: tuple[int, int]) -> np.ndarray:
    out = np.zeros((len(cells), SIZE, SIZE, 3), np.uint8)
    for i, cell in enumerate(cells):
        side = int(rng.integers(*sides))
        patch = np.asarray(Image.fromarray(cell).resize((side, side), Image.Resampling.BILINEAR))
        place(out[i], np.repeat(patch[..., None], 3, axis=-1), rng)
    return out


def pick_per_class(rng: np.random.Generator, pool_labels: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """For each wanted label, the index of a random pool item of that class."""
    return np.array([rng.choice(np.flatnonzero(pool_labels == c)) for c in labels], dtype=np.int64)


def gen_fashion(rng: np.random.Generator, n: int, split: str):
    images, pool_labels = _fashion_pool(split)
    labels = balanced_labels(rng, n, len(FASHION))
    picks = pick_per_class(rng, pool_labels, labels)
    _note(*(("fashion", split, int(i)) for i in picks))
    return _grey_on_black(rng, images[picks], (70, 99)), labels


@functools.cache
def _opencv_digits() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The 5000 20×20 cells of ``digits.png`` (50 rows × 100 columns, 5 rows per digit), labels, column index."""
    sheet = np.asarray(Image.open(OPENCV_DIR / "digits.png").convert("L"))
    cells = sheet.reshape(50, 20, 100, 20).transpose(0, 2, 1, 3).reshape(-1, 20, 20)
    rows, cols = np.divmod(np.arange(5000), 100)
    return cells, (rows // 5).astype(np.int64), cols


DIGIT_COLUMNS = {"train": (0, 60), "exemplar": (60, 65), "val": (65, 80), "test": (80, 100)}


def gen_digits(rng: np.random.Generator, n: int, split: str):
    """Handwritten digits, white on black as scanned; splits are disjoint column ranges of the sheet."""
    cells, digit, cols = _opencv_digits()
    lo, hi = DIGIT_COLUMNS[split]
    pool = np.flatnonzero((cols >= lo) & (cols < hi))
    labels = balanced_labels(rng, n, 10)
    picks = pool[pick_per_class(rng, digit[pool], labels)]
    _note(*(("digit", int(i)) for i in picks))
    return _grey_on_black(rng, cells[picks], (56, 95)), labels


# ----------------------------------------------------------------------------------------------- clip art
CLIPART = ("animals", "computer", "food", "people", "recreation", "shapes", "signs_and_symbols", "transportation")
CLIPART_FILES_PER_SPLIT = {"train": 150, "exemplar": 20, "val": 60, "test": 60}
MAX_PIXELS = 4_000_000


@functools.cache
def _clipart_files(category: str, split: str) -> tuple[Path, ...]:
    """Up to :data:`CLIPART_FILES_PER_SPLIT` files of a category in a split (stable hash order), links resolved,
    images over :data:`MAX_PIXELS` left out (a few drawings are 13000² px: minutes to decode)."""
    files = {p.resolve().name: p.resolve() for p in (CLIPART_DIR / category).rglob("*.png") if p.exists()}
    keep = []
    for path in (files[name] for name in split_items(sorted(files))[split]):
        if len(keep) == CLIPART_FILES_PER_SPLIT[split]:
            break
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with Image.open(path) as im:  # reads the header only
                    if im.width * im.height <= MAX_PIXELS:
                        keep.append(path)
        except (OSError, Image.DecompressionBombError):
            continue
    return tuple(keep)


@functools.cache
def _rgba(path: Path, side: int = SIZE) -> Image.Image | None:
    try:
        with Image.open(path) as im:
            im = im.convert("RGBA")
            im.thumbnail((side, side), Image.Resampling.LANCZOS)
            return im
    except (OSError, Image.DecompressionBombError):
        return None


def gen_clipart(rng: np.random.Generator, n: int, split: str):
    labels = balanced_labels(rng, n, len(CLIPART))
    out = np.full((n, SIZE, SIZE, 3), 255, np.uint8)
    for i, c in enumerate(labels):
        pool = _clipart_files(CLIPART[c], split)
        image = None
        while image is None:
            path = pool[rng.integers(len(pool))]
            image = _rgba(path)
        _note(str(path))
        image = resized(image, int(rng.integers(60, 95)))
        if rng.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        rgba = np.asarray(image)
        place(out[i], rgba[..., :3], rng, rgba[..., 3])
    return out, labels


# ----------------------------------------------------------------------------------------------- scripts
SCRIPTS = {
    "latin": ("NotoSans-Regular.ttf", "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"),
    "greek": ("NotoSans-Regular.ttf", "αβγδεζηθικλμνξοπρστυφχψωΓΔΘΛΞΠΣΦΨΩ"),
    "cyrillic": ("NotoSans-Regular.ttf", "абвгдежзийклмнопрстуфхцчшщыэюяБГДЖЗИЛПФЦЧШЩЭЮЯ"),
    "hebrew": ("NotoSansHebrew-Regular.ttf", "אבגדהוזחטיכלמנסעפצקרשתךםןףץ"),
    "arabic": ("NotoSansArabic-Regular.ttf", "ابتثجحخدذرزسشصضطظعغفقكلمنهوي"),
    "devanagari": ("NotoSansDevanagari-Regular.ttf", "अआइईउएऐओऔकखगघचछजझटठडढणतथदधनपफबभमयरलवशषसह"),
    "thai": ("NotoSansThai-Regular.ttf", "กขคฆงจฉชซญฎฏฐฑฒณดตถทธนบปผฝพฟภมยรลวศษสหฬอฮ"),
    "georgian": ("NotoSansGeorgian-Regular.ttf", "აბგდევზთიკლმნოპჟრსტუფქღყშჩცძწჭხჯჰ"),
}


@functools.cache
def _font(path: Path, size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(str(path), size)


def gen_script(rng: np.random.Generator, n: int, split: str):
    """2-4 random letters of one writing system on a plain background; size, colours and position random."""
    names = list(SCRIPTS)
    labels = balanced_labels(rng, n, len(names))
    out = np.empty((n, SIZE, SIZE, 3), np.uint8)
    for i, c in enumerate(labels):
        font_file, alphabet = SCRIPTS[names[c]]
        text = "".join(rng.choice(list(alphabet), rng.integers(2, 5)))
        dark_text = rng.random() < 0.5
        image = Image.new("RGB", (SIZE, SIZE), tuple(int(v) for v in random_colour(rng, light=dark_text)))
        draw = ImageDraw.Draw(image)
        font = _font(NOTO_DIR / font_file, int(rng.integers(22, 38)))
        left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
        x = rng.integers(-left, max(-left + 1, SIZE - right))
        y = rng.integers(-top, max(-top + 1, SIZE - bottom))
        draw.text((int(x), int(y)), text, fill=tuple(int(v) for v in random_colour(rng, light=not dark_text)),
                  font=font)
        out[i] = np.asarray(image)
    return out, labels


# ----------------------------------------------------------------------------------------------- emoji
EMOJI_RANGES = {
    "faces": ((0x1F600, 0x1F637), (0x1F910, 0x1F92F), (0x1F970, 0x1F97A)),
    "hands": ((0x1F446, 0x1F450), (0x1F590, 0x1F596), (0x1F918, 0x1F91F)),
    "animals": ((0x1F400, 0x1F43D), (0x1F980, 0x1F9AE)),
    "plants": ((0x1F330, 0x1F344), (0x1F490, 0x1F490), (0x1FAB4, 0x1FABB)),
    "food": ((0x1F345, 0x1F37F), (0x1F950, 0x1F96F)),
    "transport": ((0x1F680, 0x1F6A4), (0x1F6B2, 0x1F6B2), (0x1F6E9, 0x1F6FC)),
    "buildings": ((0x1F3D8, 0x1F3DF), (0x1F3E0, 0x1F3F0), (0x1F54B, 0x1F54D)),
}
FLAGS = ("AR", "AT", "AU", "BE", "BR", "CA", "CH", "CL", "CN", "CO", "CU", "CZ", "DE", "DK", "EG", "ES", "FI", "FR",
         "GB", "GR", "HU", "ID", "IE", "IL", "IN", "IS", "IT", "JM", "JP", "KE", "KR", "MA", "MX", "NG", "NL", "NO",
         "NP", "NZ", "PE", "PH", "PK", "PL", "PT", "RO", "RU", "SA", "SE", "SG", "TH", "TR", "UA", "US", "VN", "ZA")
EMOJI = (*EMOJI_RANGES, "flags")


@functools.cache
def _emoji_items(category: str, split: str) -> tuple[str, ...]:
    if category == "flags":
        items = ["".join(chr(0x1F1E6 + ord(c) - ord("A")) for c in code) for code in FLAGS]
    else:
        from fontTools.ttLib import TTFont

        cmap = TTFont(str(EMOJI_FONT), lazy=True).getBestCmap()
        items = [chr(c) for lo, hi in EMOJI_RANGES[category] for c in range(lo, hi + 1) if c in cmap]
    keys = {f"{ord(e[0]):x}-{ord(e[-1]):x}": e for e in items}
    return tuple(keys[k] for k in split_items(sorted(keys))[split])


@functools.cache
def _emoji_image(text: str) -> Image.Image:
    """The colour bitmap of one emoji (NotoColorEmoji only has a 109 px strike), cropped to its ink."""
    image = Image.new("RGBA", (300, 160))
    ImageDraw.Draw(image).text((4, 4), text, font=_font(EMOJI_FONT, 109), embedded_color=True)
    return image.crop(image.getbbox())


def gen_emoji(rng: np.random.Generator, n: int, split: str):
    """One emoji on a plain background; its category is the label; splits hold disjoint emoji."""
    labels = balanced_labels(rng, n, len(EMOJI))
    out = np.empty((n, SIZE, SIZE, 3), np.uint8)
    for i, c in enumerate(labels):
        pool = _emoji_items(EMOJI[c], split)
        item = pool[rng.integers(len(pool))]
        _note(("emoji", item))
        image = resized(_emoji_image(item), int(rng.integers(50, 92)))
        out[i] = random_colour(rng)
        rgba = np.asarray(image)
        place(out[i], rgba[..., :3], rng, rgba[..., 3])
    return out, labels


# ----------------------------------------------------------------------------------------------- photo scenes
SCENES = ("aero1.jpg", "aloeL.jpg", "baboon.jpg", "board.jpg", "building.jpg", "butterfly.jpg", "fruits.jpg",
          "graf1.png", "leuvenA.jpg", "starry_night.jpg")
GRID = 4
CELLS = {"train": 9, "exemplar": 1, "val": 3, "test": 3}


@functools.cache
def _scene(name: str) -> np.ndarray:
    """The photo resized so that its shorter side is ``GRID`` × ``SIZE`` px (uint8 RGB)."""
    image = Image.open(OPENCV_DIR / name).convert("RGB")
    scale = GRID * SIZE / min(image.size)
    return np.asarray(image.resize((round(image.width * scale), round(image.height * scale)),
                                   Image.Resampling.LANCZOS))


def _scene_cells(name: str, split: str) -> list[tuple[int, int]]:
    """The grid cells of photo ``name`` that belong to ``split`` (a fixed random assignment per photo)."""
    order = np.random.default_rng(zlib.crc32(name.encode())).permutation(GRID * GRID)
    start = sum(CELLS[s] for s in SPLITS[: SPLITS.index(split)])
    return [divmod(int(c), GRID) for c in order[start:start + CELLS[split]]]


def gen_scene(rng: np.random.Generator, n: int, split: str):
    """A square crop (60-100 % of a grid cell) of one photo, inside a cell of its split: splits never overlap."""
    labels = balanced_labels(rng, n, len(SCENES))
    out = np.empty((n, SIZE, SIZE, 3), np.uint8)
    for i, c in enumerate(labels):
        photo = _scene(SCENES[c])
        cell_h, cell_w = photo.shape[0] // GRID, photo.shape[1] // GRID
        row, col = _scene_cells(SCENES[c], split)[rng.integers(CELLS[split])]
        _note((SCENES[c], row, col))
        side = int(rng.integers(int(0.6 * min(cell_h, cell_w)), min(cell_h, cell_w) + 1))
        y = row * cell_h + int(rng.integers(0, cell_h - side + 1))
        x = col * cell_w + int(rng.integers(0, cell_w - side + 1))
        crop = Image.fromarray(photo[y:y + side, x:x + side])
        if rng.random() < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        out[i] = np.asarray(crop.resize((SIZE, SIZE), Image.Resampling.BILINEAR))
    return out, labels


# ----------------------------------------------------------------------------------------------- procedural
TEXTURES = ("stripes", "checker", "dots", "grid", "waves", "rings", "blobs", "bricks")
_YX = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)


def _texture_mask(rng: np.random.Generator, kind: str) -> np.ndarray:
    """Boolean [SIZE, SIZE] pattern of one texture family, random period, angle and phase."""
    period = rng.uniform(8, 22)
    angle = rng.uniform(0, math.pi)
    y, x = _YX - rng.uniform(0, SIZE, 2)[:, None, None]
    u, v = x * math.cos(angle) + y * math.sin(angle), -x * math.sin(angle) + y * math.cos(angle)
    k = 2 * math.pi / period
    if kind == "stripes":
        return np.sin(k * u) > 0
    if kind == "checker":
        return np.sin(k * u) * np.sin(k * v) > 0
    if kind == "dots":
        return (np.cos(k * u) + 1) * (np.cos(k * v) + 1) > 2.2
    if kind == "grid":
        return (np.abs(np.sin(k * u / 2)) < 0.2) | (np.abs(np.sin(k * v / 2)) < 0.2)
    if kind == "waves":
        return np.sin(k * u + rng.uniform(1.5, 3) * np.sin(k * v / 2)) > 0
    if kind == "rings":
        return np.sin(k * np.hypot(u, v)) > 0
    if kind == "blobs":
        noise = rng.standard_normal((SIZE // 8 + 2, SIZE // 8 + 2)).astype(np.float32)
        smooth = np.asarray(Image.fromarray(noise).resize((SIZE + 16, SIZE + 16), Image.Resampling.BICUBIC))
        return smooth[8:SIZE + 8, 8:SIZE + 8] > 0
    if kind == "bricks":
        row = np.floor(v / period)
        shifted = u + (row % 2) * period
        mortar = np.abs(np.sin(math.pi * v / period)) <= 0.25
        return ~mortar & (np.abs(np.sin(math.pi * shifted / (2 * period))) > 0.12)
    raise ValueError(kind)


def _two_colours(rng: np.random.Generator, mask: np.ndarray) -> np.ndarray:
    bg, fg = random_colour(rng), random_colour(rng)
    while np.abs(bg.astype(int) - fg.astype(int)).sum() < 150:
        fg = random_colour(rng)
    image = np.where(mask[..., None], fg, bg).astype(np.float32)
    image += rng.normal(0, rng.uniform(0, 12), image.shape)
    return image.clip(0, 255).astype(np.uint8)


def gen_texture(rng: np.random.Generator, n: int, split: str):
    labels = balanced_labels(rng, n, len(TEXTURES))
    return np.stack([_two_colours(rng, _texture_mask(rng, TEXTURES[c])) for c in labels]), labels


SHAPES = ("circle", "triangle", "square", "pentagon", "hexagon", "star", "cross", "crescent")


def _shape_points(shape: str, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    def polar(radii: list[float]) -> list[tuple[float, float]]:
        m = len(radii)
        return [(cx + rho * math.cos(angle + 2 * math.pi * i / m), cy + rho * math.sin(angle + 2 * math.pi * i / m))
                for i, rho in enumerate(radii)]

    sides = {"triangle": 3, "square": 4, "pentagon": 5, "hexagon": 6}
    if shape in sides:
        return polar([r] * sides[shape])
    if shape == "star":
        return polar([r, 0.42 * r] * 5)
    if shape == "cross":
        a, b = r, r / 3
        pts = [(b, a), (b, b), (a, b), (a, -b), (b, -b), (b, -a), (-b, -a), (-b, -b), (-a, -b), (-a, b), (-b, b),
               (-b, a)]
        c, s = math.cos(angle), math.sin(angle)
        return [(cx + px * c - py * s, cy + px * s + py * c) for px, py in pts]
    raise ValueError(shape)


def _shape_mask(rng: np.random.Generator, shape: str) -> np.ndarray:
    image = Image.new("L", (SIZE, SIZE), 0)
    draw = ImageDraw.Draw(image)
    r = rng.uniform(16, 36)
    cx, cy = rng.uniform(r, SIZE - r, 2)
    angle = rng.uniform(0, 2 * math.pi)
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=255)
    elif shape == "crescent":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=255)
        dx, dy = 0.45 * r * math.cos(angle), 0.45 * r * math.sin(angle)
        draw.ellipse((cx + dx - 0.85 * r, cy + dy - 0.85 * r, cx + dx + 0.85 * r, cy + dy + 0.85 * r), fill=0)
    else:
        draw.polygon(_shape_points(shape, cx, cy, r, angle), fill=255)
    return np.asarray(image) > 127


def gen_shapes(rng: np.random.Generator, n: int, split: str):
    """One filled shape on a plain or textured background, random size, angle, position and colours."""
    labels = balanced_labels(rng, n, len(SHAPES))
    out = []
    for c in labels:
        image = _two_colours(rng, _shape_mask(rng, SHAPES[c]))
        if rng.random() < 0.5:  # clutter: a faint texture over the background
            clutter = _texture_mask(rng, TEXTURES[rng.integers(len(TEXTURES))])
            image = np.where(clutter[..., None], (0.8 * image + 0.2 * 255).astype(np.uint8), image)
        out.append(image)
    return np.stack(out), labels


# ----------------------------------------------------------------------------------------------- registry
DOMAINS: dict[str, Domain] = {d.name: d for d in (
    Domain("fashion", FASHION, gen_fashion, "Fashion-MNIST, light garment on black (apt: dataset-fashion-mnist)",
           (FASHION_DIR / "t10k-images-idx3-ubyte.gz",)),
    Domain("digits", tuple("0123456789"), gen_digits, "OpenCV's 5000 handwritten digits (apt: opencv-doc)",
           (OPENCV_DIR / "digits.png",)),
    Domain("clipart", CLIPART, gen_clipart, "openclipart top-level category (apt: openclipart-png)",
           (CLIPART_DIR / "animals",)),
    Domain("script", tuple(SCRIPTS), gen_script, "writing system of rendered letters (apt: fonts-noto-core)",
           (NOTO_DIR / "NotoSansThai-Regular.ttf",)),
    Domain("emoji", EMOJI, gen_emoji, "colour emoji category (apt: fonts-noto-color-emoji)", (EMOJI_FONT,)),
    Domain("scene", tuple(s.split(".")[0] for s in SCENES), gen_scene,
           "which photo a crop comes from, disjoint regions per split (apt: opencv-doc)",
           tuple(OPENCV_DIR / s for s in SCENES)),
    Domain("texture", TEXTURES, gen_texture, "procedural texture family (no package)"),
    Domain("shapes", SHAPES, gen_shapes, "procedural filled shape on plain or cluttered background (no package)"),
)}


def missing_sources(names: list[str]) -> list[str]:
    """'path (apt package)' for every required file of the named domains that is absent."""
    out = []
    for name in names:
        domain = DOMAINS[name]
        package = domain.source.split("apt: ")[-1].rstrip(")") if "apt: " in domain.source else "?"
        out += [f"{path} (apt-get install {package})" for path in domain.required if not path.exists()]
    return out


_ITEMS: list | None = None
"""The source items of the images being generated, while :func:`generate_with_items` records them."""


def _note(*keys) -> None:
    """Record the source item of each image just drawn (no random draw: the images are the same either way)."""
    if _ITEMS is not None:
        _ITEMS.extend(keys)


def generate_with_items(name: str, rng: np.random.Generator, n: int, split: str
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``DOMAINS[name].generate`` plus an int64 item id per image (0, 1, ... in order of first appearance): images
    with one id come from one source item; a domain that records none gives every image its own."""
    global _ITEMS
    _ITEMS = []
    try:
        images, labels = DOMAINS[name].generate(rng, n, split)
        keys = _ITEMS
    finally:
        _ITEMS = None
    if len(keys) != len(labels):
        keys = list(range(len(labels)))
    first: dict = {}
    return images, labels, np.array([first.setdefault(k, len(first)) for k in keys], dtype=np.int64)


def domain_rng(seed: int, name: str, split: str) -> np.random.Generator:
    """The random stream of ``(seed, domain, split)``: independent across domains and splits, stable across runs."""
    return np.random.default_rng([seed, zlib.crc32(name.encode()), SPLITS.index(split)])
