"""Training helpers shared by the offline suites: frozen task heads, fine-tuning, atomic cache entries, logging.

The suites (:mod:`benchmarks.suites.tiny`, and the real-weights suite under ``benchmarks/real``) build their
fine-tuned encoders with these, so both follow the same protocol: a frozen cosine head per task on the pretrained
encoder's pooled features, the whole encoder fine-tuned against it, only encoders merged.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedModel


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
class Suite:
    """A built merging benchmark: base + fine-tuned encoders (``save_pretrained`` folders), frozen heads, splits."""

    base_dir: Path
    """``save_pretrained`` folder of the pretrained encoder (+ its image processor)."""
    finetuned: dict[str, Path]
    """task → ``save_pretrained`` folder of the encoder fine-tuned on it."""
    heads: dict[str, TaskHead]
    val: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """task → (pixel_values [N, 3, H, W] normalised as the processor would, labels [N])."""
    test: dict[str, tuple[torch.Tensor, torch.Tensor]]
    unlabeled: torch.Tensor
    """[M, 3, H, W] normalised images mixed from all tasks' train splits (no labels), for M-Loss scoring."""
    info: dict
    """Timings, configuration, versions, training losses, per-task fine-tuned and pretrained-head accuracies."""

    @property
    def tasks(self) -> list[str]:
        return list(self.finetuned)


class Log:
    def __init__(self, enabled: bool, name: str = "suite"):
        self.enabled = enabled
        self.name = name
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"[{self.name} {time.perf_counter() - self.start:6.1f}s] {message}", file=sys.stderr, flush=True)


def progress(iterable: Iterable, desc: str, *, total: int | None = None, enabled: bool = True) -> Iterable:
    """A transient progress bar on stderr for a stage that can run longer than a few seconds (the suites print a line
    when a stage ends; the bar shows the stage is moving meanwhile and disappears when it ends)."""
    return tqdm(iterable, desc=desc, total=total, leave=False, file=sys.stderr, mininterval=1.0, dynamic_ncols=True,
                disable=not enabled)


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
def torch_threads(n: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextmanager
def stage(info: dict, name: str) -> Iterator[None]:
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    info.setdefault("timings", {})[name] = {"wall_s": round(time.perf_counter() - wall, 2),
                                            "cpu_s": round(time.process_time() - cpu, 2)}


@contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
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


def lr_lambda(steps: int, warmup: float):
    warm = max(1, int(round(warmup * steps)))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, steps - warm)
        return 0.5 * (1 + np.cos(np.pi * min(progress, 1.0)))

    return factor


@torch.inference_mode()
def features(model: PreTrainedModel, pixels: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """Pooled features (``pooler_output``) of ``pixels`` in eval mode."""
    model.eval()
    return torch.cat([model(pixel_values=b).pooler_output for b in pixels.split(batch)])


def fit_head(model: PreTrainedModel, x: torch.Tensor, y: torch.Tensor, num_classes: int, scale: float,
             prompts: tuple[torch.Tensor, torch.Tensor] | None = None) -> TaskHead:
    """A cosine classifier × ``scale`` on centred, L2-normalised pretrained pooled features.

    The centre is the mean feature of the task's images ``x``; the class vectors are the normalised class means of
    the centred, normalised features of ``prompts`` (canonical renderings, centred on their own mean) — or of ``x``
    itself (labels ``y``) when no prompts are given."""
    feats = features(model, x)
    center = feats.mean(0)
    if prompts is not None:
        pf = features(model, prompts[0])
        z, y = F.normalize(pf - pf.mean(0), dim=-1), prompts[1]
    else:
        z = F.normalize(feats - center, dim=-1)
    means = torch.stack([z[y == c].mean(0) if (y == c).any() else torch.zeros_like(center)
                         for c in range(num_classes)])
    return TaskHead(weight=F.normalize(means, dim=-1).contiguous(), bias=None, center=center.contiguous(),
                    normalize=True, scale=float(scale))


def finetune(base: PreTrainedModel, head: TaskHead, x: torch.Tensor, y: torch.Tensor, *, steps: int, batch: int,
             lr: float, weight_decay: float, warmup: float, seed: int) -> tuple[PreTrainedModel, list[float]]:
    """Fine-tune a copy of the whole encoder ``base`` against the frozen ``head`` (AdamW, warm-up + cosine, gradient
    clipping at 1); returns the model (in eval mode) and the mean loss of each fifth of the steps."""
    torch.manual_seed(seed)
    model = copy.deepcopy(base)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(steps, warmup))
    gen = torch.Generator().manual_seed(seed)
    losses, running = [], 0.0
    every = max(1, steps // 5)
    for step in range(steps):
        idx = torch.randint(len(x), (batch,), generator=gen)
        loss = F.cross_entropy(head.logits(model(pixel_values=x[idx]).pooler_output), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        running += loss.item()
        if (step + 1) % every == 0 or step + 1 == steps:
            losses.append(round(running / ((step % every) + 1), 4))
            running = 0.0
    model.eval()
    return model, losses


def head_accuracy(model: PreTrainedModel, head: TaskHead, x: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 accuracy of ``head`` on the features of ``x``, rounded to 4 decimals."""
    return round((head.logits(features(model, x)).argmax(-1) == y).float().mean().item(), 4)


def save_heads(heads: dict[str, TaskHead], folder: Path) -> None:
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


def load_heads(folder: Path) -> dict[str, TaskHead]:
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "heads.safetensors"))
    meta = json.loads((folder / "heads.json").read_text())
    return {name: TaskHead(weight=tensors[f"{name}.weight"], bias=tensors.get(f"{name}.bias"),
                           center=tensors.get(f"{name}.center"), normalize=m["normalize"], scale=m["scale"])
            for name, m in meta.items()}
