"""The offline "tiny" merging benchmark: a small CLIP vision tower pretrained in-process, fine-tuned on 8 tasks.

```python
from hf_mloss.suites.tiny import build_tiny_suite

suite = build_tiny_suite()                 # ~5-8 min on 2 CPU cores the first time, < 1 s once cached
suite.base_dir, suite.finetuned["digits"]  # save_pretrained folders (CLIPVisionModel + image processor)
logits = suite.heads["digits"].logits(model(pixel_values=suite.test["digits"][0]).pooler_output)
```

Pipeline (everything seeded, every stage cached under ``cache``):

1. **Data** (:mod:`hf_mloss.suites.tasks`): 8 evaluation tasks of 32×32 RGB images built from data that packages
   ship (sklearn digits and photos, matplotlib's fonts and sample rasters, procedural drawing), with train / val /
   test splits, canonical "prompt" renderings per class, and a labelled pretraining mix whose labels are its own
   (printed glyphs in DejaVu fonts, filled/outlined shapes, coarse grating orientation, counting squares, texture
   families, small photo crops): the tower learns related concepts in other renderings, never the tasks' images.
2. **Pretraining**: a ``CLIPVisionModel`` (hidden 128, 4 layers, patch 8: 0.8 M parameters, the state-dict keys of
   a real CLIP tower) trained from scratch on the mix with one linear head per source (the heads are dropped).
3. **Heads**: per task, a frozen cosine classifier on the pretrained pooled features, the analogue of CLIP's
   zero-shot text heads: features are centred on the task images' mean and L2-normalised; the class vectors are
   the normalised class means of the canonical renderings (black on white, upright, centred — the "class name"),
   so the heads know the classes but not the task's domain (``head_source="train"``: class means of the training
   images instead).
4. **Fine-tuning**: per task, the whole encoder with AdamW + warmup/cosine against its frozen head, as in
   task-vector work; only the encoders are merged.

Cache layout: ``<cache>/<VERSION>/<full|fast>-seed<seed>/data-<hash>/pre-<hash>/ft-<hash>/``, each level keyed by
the configuration it depends on, so changing fine-tuning settings reuses the data and the pretrained tower.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import CLIPVisionConfig, CLIPVisionModel

from . import tasks as T

VERSION = "v4"
"""Bumped whenever a change alters the data, the models or the heads."""


@dataclass
class TaskHead:
    """Frozen per-task classifier on the encoder's pooled feature (``model(pixel_values).pooler_output``)."""

    weight: torch.Tensor  # [C, D]
    bias: torch.Tensor | None = None  # [C]
    center: torch.Tensor | None = None  # [D], subtracted before normalisation
    normalize: bool = True  # L2-normalise features before the linear map
    scale: float = 1.0  # logit scale

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to(features.device, features.dtype)
        if self.center is not None:
            features = features - self.center.to(features.device, features.dtype)
        if self.normalize:
            features = F.normalize(features, dim=-1)
        out = self.scale * features @ weight.T
        if self.bias is not None:
            out = out + self.bias.to(features.device, features.dtype)
        return out


@dataclass
class TinySuite:
    base_dir: Path
    """``save_pretrained`` folder of the pretrained ``CLIPVisionModel`` (+ its image processor)."""
    finetuned: dict[str, Path]
    """task → ``save_pretrained`` folder of the encoder fine-tuned on it."""
    heads: dict[str, TaskHead]
    val: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """task → (pixel_values [N, 3, 32, 32] normalised as the processor would, labels [N])."""
    test: dict[str, tuple[torch.Tensor, torch.Tensor]]
    unlabeled: torch.Tensor
    """[M, 3, 32, 32] normalised images mixed from all tasks' train splits (no labels), for M-Loss scoring."""
    info: dict
    """Timings, configuration, versions, training losses, per-task fine-tuned and pretrained-head accuracies."""

    @property
    def tasks(self) -> list[str]:
        return list(self.finetuned)


@dataclass
class TinyConfig:
    """Everything that determines the suite (the cache key is derived from it)."""

    # model: CLIP ViT with 4×4 = 16 patches of 8 px
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    patch_size: int = 8
    # data
    n_train: int = 3000
    n_val: int = 200
    n_test: int = 500
    n_pretrain_per_source: int = 6000
    n_unlabeled: int = 512
    n_prompt: int = 8
    """Canonical renderings per class for the zero-shot heads."""
    # pretraining
    pre_steps: int = 2000
    pre_batch: int = 128
    pre_lr: float = 2e-3
    pre_weight_decay: float = 0.05
    # heads
    head_source: str = "prompt"
    """``prompt``: class means of canonical renderings (the analogue of CLIP's text prompts); ``train``: class means
    of the task's training images."""
    head_scale: float = 10.0
    head_samples: int = 2000
    # fine-tuning
    ft_steps: int = 300
    ft_batch: int = 64
    ft_lr: float = 5e-4
    ft_weight_decay: float = 0.1
    warmup: float = 0.1
    """Fraction of the fine-tuning steps with a linear warm-up (pretraining uses 0.05)."""

    @classmethod
    def fast(cls) -> TinyConfig:
        """CI smoke mode: same model, a handful of steps, tiny splits."""
        return cls(n_train=128, n_val=32, n_test=64, n_pretrain_per_source=64, n_unlabeled=256, pre_steps=8,
                   pre_batch=32, head_samples=128, ft_steps=4, ft_batch=32)

    def part(self, *names: str) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k in names}


DATA_KEYS = ("n_train", "n_val", "n_test", "n_pretrain_per_source", "n_prompt")
PRE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "patch_size", "pre_steps", "pre_batch",
            "pre_lr", "pre_weight_decay")
FT_KEYS = ("n_unlabeled", "head_source", "head_scale", "head_samples", "ft_steps", "ft_batch", "ft_lr",
           "ft_weight_decay", "warmup")


def default_cache() -> Path:
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache")), "huggingface")
    return Path(home) / "hf_mloss" / "tiny_suite"


def _digest(obj) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:10]


# ----------------------------------------------------------------------------------------------------------------
# Small utilities
# ----------------------------------------------------------------------------------------------------------------


class _Log:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"[tiny suite {time.perf_counter() - self.start:6.1f}s] {message}", file=sys.stderr, flush=True)


def default_threads() -> int:
    """Torch intra-op threads: the idle cores, at most 4, at least 1.

    On a shared machine OpenMP workers spin-wait for each other: measured on 2 cores with ~4 other busy processes, a
    training step took 0.84-1.7 s with 2 threads and 0.23-0.25 s with 1."""
    cores = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0]
    except (AttributeError, OSError):
        busy = 0.0
    return max(1, min(4, cores - int(round(busy))))


@contextmanager
def _threads(n: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextmanager
def _stage(info: dict, name: str) -> Iterator[None]:
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    info.setdefault("timings", {})[name] = {"wall_s": round(time.perf_counter() - wall, 2),
                                            "cpu_s": round(time.process_time() - cpu, 2)}


@contextmanager
def _atomic_dir(target: Path) -> Iterator[Path]:
    """Write into a temporary sibling, then rename: a cache entry is either complete or absent."""
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _lr_lambda(steps: int, warmup: float):
    warm = max(1, int(round(warmup * steps)))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, steps - warm)
        return 0.5 * (1 + np.cos(np.pi * min(progress, 1.0)))

    return factor


def _vision_config(cfg: TinyConfig) -> CLIPVisionConfig:
    return CLIPVisionConfig(hidden_size=cfg.hidden_size, intermediate_size=4 * cfg.hidden_size,
                            num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                            image_size=T.SIZE, patch_size=cfg.patch_size, hidden_act="quick_gelu",
                            attn_implementation="sdpa")


def _save(model: CLIPVisionModel, path: Path) -> None:
    from transformers.utils import logging as hf_logging

    from ..testing import save_model

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        save_model(model, path, image_size=T.SIZE)
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


@torch.inference_mode()
def _features(model: CLIPVisionModel, pixels: torch.Tensor, batch: int = 256) -> torch.Tensor:
    model.eval()
    return torch.cat([model(pixel_values=b).pooler_output for b in pixels.split(batch)])


# ----------------------------------------------------------------------------------------------------------------
# Stages
# ----------------------------------------------------------------------------------------------------------------


def _build_data(folder: Path, cfg: TinyConfig, task_names: Sequence[str], seed: int, log: _Log) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    sizes = {"train": cfg.n_train, "val": cfg.n_val, "test": cfg.n_test}
    for name in task_names:
        path = folder / f"{name}.npz"
        if not path.exists():
            splits = T.make_task(name, {**sizes, "prompt": cfg.n_prompt * len(T.TASKS[name].classes)}, seed)
            tmp = folder / f".{name}.tmp{os.getpid()}.npz"
            np.savez(tmp, **{f"{s}_{k}": arr for s, (x, y) in splits.items() for k, arr in (("x", x), ("y", y))})
            os.replace(tmp, path)
            log(f"data: {name} ({', '.join(f'{s} {n}' for s, n in sizes.items())})")
    path = folder / "pretrain.npz"
    if not path.exists():
        mix = T.make_pretrain_mix(cfg.n_pretrain_per_source, seed)
        tmp = folder / f".pretrain.tmp{os.getpid()}.npz"
        np.savez(tmp, **{f"{s}_{k}": arr for s, (x, y) in mix.items() for k, arr in (("x", x), ("y", y))})
        os.replace(tmp, path)
        log(f"data: pretraining mix ({len(mix)} sources × {cfg.n_pretrain_per_source})")


def _load_task(folder: Path, name: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    with np.load(folder / f"{name}.npz") as z:
        return {s: (z[f"{s}_x"], z[f"{s}_y"]) for s in ("train", "val", "test", "prompt")}


def _pretrain(cfg: TinyConfig, data_dir: Path, seed: int, log: _Log) -> tuple[CLIPVisionModel, dict]:
    with np.load(data_dir / "pretrain.npz") as z:
        sources = {s: (T.to_pixel_values(z[f"{s}_x"]), torch.from_numpy(z[f"{s}_y"])) for s in T.PRETRAIN_SOURCES}
    torch.manual_seed(seed)
    model = CLIPVisionModel(_vision_config(cfg))
    heads = torch.nn.ModuleDict({s: torch.nn.Linear(cfg.hidden_size, len(spec.classes))
                                 for s, spec in T.PRETRAIN_SOURCES.items()})
    params = list(model.parameters()) + list(heads.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.pre_lr, weight_decay=cfg.pre_weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg.pre_steps, 0.05))
    gen = torch.Generator().manual_seed(seed + 1)
    per_source = max(1, cfg.pre_batch // len(sources))
    history: dict[str, list[float]] = {s: [] for s in sources}
    running = {s: 0.0 for s in sources}
    every = max(1, cfg.pre_steps // 10)
    model.train()
    for step in range(cfg.pre_steps):
        xs, sizes = [], []
        for s, (x, y) in sources.items():
            idx = torch.randint(len(x), (per_source,), generator=gen)
            xs.append(x[idx])
            sizes.append((s, y[idx]))
        pooled = model(pixel_values=torch.cat(xs)).pooler_output
        losses = {s: F.cross_entropy(heads[s](f), y) for (s, y), f in zip(sizes, pooled.split(per_source))}
        loss = sum(losses.values()) / len(losses)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        for s, value in losses.items():
            running[s] += value.item()
        if (step + 1) % every == 0 or step + 1 == cfg.pre_steps:
            n = (step % every) + 1
            for s in sources:
                history[s].append(round(running[s] / n, 4))
                running[s] = 0.0
            log(f"pretraining step {step + 1}/{cfg.pre_steps}: "
                + ", ".join(f"{s} {history[s][-1]:.3f}" for s in sources))
    model.eval()
    return model, {"pretrain_loss": history}


def _fit_head(model: CLIPVisionModel, x: torch.Tensor, y: torch.Tensor, num_classes: int, scale: float,
              prompts: tuple[torch.Tensor, torch.Tensor] | None = None) -> TaskHead:
    """A cosine classifier × ``scale`` on centred, L2-normalised pretrained pooled features.

    The centre is the mean feature of the task's images ``x``; the class vectors are the normalised class means of
    the centred, normalised features of ``prompts`` (canonical renderings, centred on their own mean) — or of ``x``
    itself (labels ``y``) when no prompts are given."""
    feats = _features(model, x)
    center = feats.mean(0)
    if prompts is not None:
        pf = _features(model, prompts[0])
        z, y = F.normalize(pf - pf.mean(0), dim=-1), prompts[1]
    else:
        z = F.normalize(feats - center, dim=-1)
    means = torch.stack([z[y == c].mean(0) if (y == c).any() else torch.zeros_like(center)
                         for c in range(num_classes)])
    return TaskHead(weight=F.normalize(means, dim=-1).contiguous(), bias=None, center=center.contiguous(),
                    normalize=True, scale=float(scale))


def _finetune(base: CLIPVisionModel, head: TaskHead, x: torch.Tensor, y: torch.Tensor, cfg: TinyConfig,
              seed: int) -> tuple[CLIPVisionModel, list[float]]:
    torch.manual_seed(seed)
    model = CLIPVisionModel(base.config)
    model.load_state_dict(base.state_dict())
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.ft_lr, weight_decay=cfg.ft_weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg.ft_steps, cfg.warmup))
    gen = torch.Generator().manual_seed(seed)
    losses, running = [], 0.0
    every = max(1, cfg.ft_steps // 5)
    for step in range(cfg.ft_steps):
        idx = torch.randint(len(x), (cfg.ft_batch,), generator=gen)
        loss = F.cross_entropy(head.logits(model(pixel_values=x[idx]).pooler_output), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        running += loss.item()
        if (step + 1) % every == 0 or step + 1 == cfg.ft_steps:
            losses.append(round(running / ((step % every) + 1), 4))
            running = 0.0
    model.eval()
    return model, losses


def _accuracy(model: CLIPVisionModel, head: TaskHead, x: torch.Tensor, y: torch.Tensor) -> float:
    return round((head.logits(_features(model, x)).argmax(-1) == y).float().mean().item(), 4)


def _save_heads(heads: dict[str, TaskHead], folder: Path) -> None:
    from safetensors.torch import save_file

    tensors, meta = {}, {}
    for name, head in heads.items():
        tensors[f"{name}.weight"] = head.weight.contiguous()
        if head.bias is not None:
            tensors[f"{name}.bias"] = head.bias.contiguous()
        if head.center is not None:
            tensors[f"{name}.center"] = head.center.contiguous()
        meta[name] = {"normalize": head.normalize, "scale": head.scale}
    save_file(tensors, str(folder / "heads.safetensors"))
    (folder / "heads.json").write_text(json.dumps(meta, indent=2) + "\n")


def _load_heads(folder: Path) -> dict[str, TaskHead]:
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "heads.safetensors"))
    meta = json.loads((folder / "heads.json").read_text())
    return {name: TaskHead(weight=tensors[f"{name}.weight"], bias=tensors.get(f"{name}.bias"),
                           center=tensors.get(f"{name}.center"), normalize=m["normalize"], scale=m["scale"])
            for name, m in meta.items()}


def _versions() -> dict:
    import transformers

    from .. import __version__

    return {"hf_mloss": __version__, "suite": VERSION, "torch": torch.__version__,
            "transformers": transformers.__version__, "numpy": np.__version__, "python": platform.python_version()}


# ----------------------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------------------


def build_tiny_suite(cache: str | Path | None = None, *, tasks: list[str] | None = None, fast: bool = False,
                     seed: int = 0, progress: bool = True, config: TinyConfig | None = None,
                     num_threads: int | None = None) -> TinySuite:
    """Build (or load from ``cache``) the tiny offline merging benchmark.

    Args:
        cache: root folder of the cache (default ``$HF_HOME/hf_mloss/tiny_suite``, i.e.
            ``~/.cache/huggingface/hf_mloss/tiny_suite``); entries live under ``<cache>/<VERSION>/...``.
        tasks: evaluation tasks (default: all of :data:`hf_mloss.suites.tasks.TASKS`, in that order).
        fast: CI smoke mode (a few training steps, tiny splits): checks the pipeline, not the numbers.
        seed: seeds the data, the initialisation and the batch order.
        progress: log stages and losses to stderr.
        config: override the default :class:`TinyConfig` (or :meth:`TinyConfig.fast` when ``fast``).
        num_threads: torch CPU threads while building (default: :func:`default_threads`).
    """
    task_names = list(tasks or T.TASKS)
    unknown = [t for t in task_names if t not in T.TASKS]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; available: {list(T.TASKS)}")
    cfg = config or (TinyConfig.fast() if fast else TinyConfig())
    log = _Log(progress)
    root = Path(cache) if cache is not None else default_cache()
    data_dir = root / VERSION / f"{'fast' if fast else 'full'}-seed{seed}" / f"data-{_digest(cfg.part(*DATA_KEYS))}"
    pre_dir = data_dir / f"pre-{_digest(cfg.part(*PRE_KEYS))}"
    run_dir = pre_dir / f"ft-{_digest([cfg.part(*FT_KEYS), task_names])}"
    threads = num_threads or default_threads()
    with _threads(threads):
        if not (run_dir / "info.json").exists():
            _build(cfg, task_names, seed, data_dir, pre_dir, run_dir, log, threads, fast)
        else:
            log(f"loading from cache {run_dir}")
        return _load(run_dir, data_dir, pre_dir, task_names, cfg, log)


def _build(cfg: TinyConfig, task_names: list[str], seed: int, data_dir: Path, pre_dir: Path, run_dir: Path,
           log: _Log, threads: int, fast: bool) -> None:
    info: dict = {"version": VERSION, "seed": seed, "fast": fast, "tasks": task_names,
                  "config": dataclasses.asdict(cfg), "versions": _versions(), "num_threads": threads}
    start = time.perf_counter()
    with _stage(info, "data"):
        _build_data(data_dir, cfg, task_names, seed, log)

    base_dir = pre_dir / "base"
    with _stage(info, "pretraining"):
        if (base_dir / "config.json").exists():
            base = CLIPVisionModel.from_pretrained(base_dir).eval()
            pre_info = json.loads((pre_dir / "pretrain.json").read_text())
            log(f"pretrained tower from cache {base_dir}")
        else:
            pre_start = time.perf_counter()
            base, pre_info = _pretrain(cfg, data_dir, seed, log)
            pre_info["wall_s"] = round(time.perf_counter() - pre_start, 2)
            with _atomic_dir(base_dir) as tmp:
                _save(base, tmp)
            (pre_dir / "pretrain.json").write_text(json.dumps(pre_info, indent=2) + "\n")
    info["pretraining"] = pre_info
    info["parameters"] = sum(p.numel() for p in base.parameters())

    run_dir.mkdir(parents=True, exist_ok=True)
    data = {name: _load_task(data_dir, name) for name in task_names}
    heads: dict[str, TaskHead] = {}
    with _stage(info, "heads"):
        for name in task_names:
            x, y = data[name]["train"]
            x, y = x[: cfg.head_samples], y[: cfg.head_samples]
            prompts = None
            if cfg.head_source == "prompt":
                prompts = (T.to_pixel_values(data[name]["prompt"][0]), torch.from_numpy(data[name]["prompt"][1]))
            elif cfg.head_source != "train":
                raise ValueError(f"head_source must be 'prompt' or 'train', not {cfg.head_source!r}")
            heads[name] = _fit_head(base, T.to_pixel_values(x), torch.from_numpy(y), len(T.TASKS[name].classes),
                                    cfg.head_scale, prompts)
        _save_heads(heads, run_dir)

    info["finetune_loss"], info["accuracy"] = {}, {"pretrained": {}, "finetuned": {}}
    info["accuracy_val"] = {"pretrained": {}, "finetuned": {}}
    for i, name in enumerate(task_names):
        target = run_dir / "finetuned" / name
        x, y = T.to_pixel_values(data[name]["train"][0]), torch.from_numpy(data[name]["train"][1])
        with _stage(info, f"finetune/{name}"):
            model, losses = _finetune(base, heads[name], x, y, cfg, seed * 1000 + i + 1)
            with _atomic_dir(target) as tmp:
                _save(model, tmp)
        info["finetune_loss"][name] = losses
        for split, key in (("test", "accuracy"), ("val", "accuracy_val")):
            xs, ys = T.to_pixel_values(data[name][split][0]), torch.from_numpy(data[name][split][1])
            info[key]["pretrained"][name] = _accuracy(base, heads[name], xs, ys)
            info[key]["finetuned"][name] = _accuracy(model, heads[name], xs, ys)
        log(f"fine-tuned {name}: loss {losses[0]:.3f} → {losses[-1]:.3f}, test acc "
            f"{info['accuracy']['pretrained'][name]:.3f} (pretrained head) → "
            f"{info['accuracy']['finetuned'][name]:.3f}")
    for key in ("accuracy", "accuracy_val"):
        for which in ("pretrained", "finetuned"):
            values = info[key][which]
            values["mean"] = round(sum(values.values()) / len(values), 4)
    info["timings"]["total_wall_s"] = round(time.perf_counter() - start, 2)
    (run_dir / "info.json").write_text(json.dumps(info, indent=2) + "\n")


def _load(run_dir: Path, data_dir: Path, pre_dir: Path, task_names: list[str], cfg: TinyConfig,
          log: _Log) -> TinySuite:
    info = json.loads((run_dir / "info.json").read_text())
    info["cache_dir"] = str(run_dir)
    val, test, pool = {}, {}, []
    for name in task_names:
        splits = _load_task(data_dir, name)
        val[name] = (T.to_pixel_values(splits["val"][0]), torch.from_numpy(splits["val"][1]))
        test[name] = (T.to_pixel_values(splits["test"][0]), torch.from_numpy(splits["test"][1]))
        pool.append(splits["train"][0][-(-cfg.n_unlabeled // len(task_names)):])
    rng = np.random.default_rng(info["seed"])
    mixed = np.concatenate(pool)
    mixed = mixed[rng.permutation(len(mixed))[: cfg.n_unlabeled]]
    return TinySuite(base_dir=pre_dir / "base", finetuned={t: run_dir / "finetuned" / t for t in task_names},
                     heads=_load_heads(run_dir), val=val, test=test, unlabeled=T.to_pixel_values(mixed), info=info)
