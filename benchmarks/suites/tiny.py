"""The offline "tiny" merging benchmark: a small CLIP vision tower pretrained in-process, fine-tuned on 8 tasks.

```python
from benchmarks.suites.tiny import build_tiny_suite

suite = build_tiny_suite()                 # ~5-8 min on 2 CPU cores the first time, < 1 s once cached
suite.base_dir, suite.finetuned["digits"]  # save_pretrained folders (CLIPVisionModel + image processor)
logits = suite.heads["digits"].logits(model(pixel_values=suite.test["digits"][0]).pooler_output)
```

Pipeline (everything seeded, every stage cached under ``cache``):

1. **Data** (:mod:`benchmarks.suites.tasks`): 8 evaluation tasks of 32×32 RGB images built from data that packages
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
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import CLIPVisionConfig, CLIPVisionModel

from benchmarks.suites import tasks as T
from benchmarks.suites.protocol import Replicate, State
from benchmarks.suites.training import (
    Log,
    Suite,
    TaskHead,
    atomic_dir,
    default_threads,
    features,
    finetune,
    fit_head,
    head_accuracy,
    load_heads,
    lr_lambda,
    save_heads,
    stage,
    torch_threads,
)

VERSION = "v4"
"""Bumped whenever a change alters the data, the models or the heads."""


TinySuite = Suite
"""The tiny suite's built artifacts (see :class:`benchmarks.suites.training.Suite`)."""


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


def _vision_config(cfg: TinyConfig) -> CLIPVisionConfig:
    return CLIPVisionConfig(hidden_size=cfg.hidden_size, intermediate_size=4 * cfg.hidden_size,
                            num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                            image_size=T.SIZE, patch_size=cfg.patch_size, hidden_act="quick_gelu",
                            attn_implementation="sdpa")


def _save(model: CLIPVisionModel, path: Path) -> None:
    from transformers.utils import logging as hf_logging

    from examples.tiny import save_model

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        save_model(model, path, image_size=T.SIZE)
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


# ----------------------------------------------------------------------------------------------------------------
# Stages
# ----------------------------------------------------------------------------------------------------------------


def _build_data(folder: Path, cfg: TinyConfig, task_names: Sequence[str], seed: int, log: Log) -> None:
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


def _pretrain(cfg: TinyConfig, data_dir: Path, seed: int, log: Log) -> tuple[CLIPVisionModel, dict]:
    with np.load(data_dir / "pretrain.npz") as z:
        sources = {s: (T.to_pixel_values(z[f"{s}_x"]), torch.from_numpy(z[f"{s}_y"])) for s in T.PRETRAIN_SOURCES}
    torch.manual_seed(seed)
    model = CLIPVisionModel(_vision_config(cfg))
    heads = torch.nn.ModuleDict({s: torch.nn.Linear(cfg.hidden_size, len(spec.classes))
                                 for s, spec in T.PRETRAIN_SOURCES.items()})
    params = list(model.parameters()) + list(heads.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.pre_lr, weight_decay=cfg.pre_weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.pre_steps, 0.05))
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


def _versions() -> dict:
    import transformers

    from hf_mloss import __version__

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
        tasks: evaluation tasks (default: all of :data:`benchmarks.suites.tasks.TASKS`, in that order).
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
    log = Log(progress, "tiny suite")
    root = Path(cache) if cache is not None else default_cache()
    data_dir = root / VERSION / f"{'fast' if fast else 'full'}-seed{seed}" / f"data-{_digest(cfg.part(*DATA_KEYS))}"
    pre_dir = data_dir / f"pre-{_digest(cfg.part(*PRE_KEYS))}"
    run_dir = pre_dir / f"ft-{_digest([cfg.part(*FT_KEYS), task_names])}"
    threads = num_threads or default_threads()
    with torch_threads(threads):
        if not (run_dir / "info.json").exists():
            _build(cfg, task_names, seed, data_dir, pre_dir, run_dir, log, threads, fast)
        else:
            log(f"loading from cache {run_dir}")
        return _load(run_dir, data_dir, pre_dir, task_names, cfg, log)


def _build(cfg: TinyConfig, task_names: list[str], seed: int, data_dir: Path, pre_dir: Path, run_dir: Path,
           log: Log, threads: int, fast: bool) -> None:
    info: dict = {"version": VERSION, "seed": seed, "fast": fast, "tasks": task_names,
                  "config": dataclasses.asdict(cfg), "versions": _versions(), "num_threads": threads}
    start = time.perf_counter()
    with stage(info, "data"):
        _build_data(data_dir, cfg, task_names, seed, log)

    base_dir = pre_dir / "base"
    with stage(info, "pretraining"):
        if (base_dir / "config.json").exists():
            base = CLIPVisionModel.from_pretrained(base_dir).eval()
            pre_info = json.loads((pre_dir / "pretrain.json").read_text())
            log(f"pretrained tower from cache {base_dir}")
        else:
            pre_start = time.perf_counter()
            base, pre_info = _pretrain(cfg, data_dir, seed, log)
            pre_info["wall_s"] = round(time.perf_counter() - pre_start, 2)
            with atomic_dir(base_dir) as tmp:
                _save(base, tmp)
            (pre_dir / "pretrain.json").write_text(json.dumps(pre_info, indent=2) + "\n")
    info["pretraining"] = pre_info
    info["parameters"] = sum(p.numel() for p in base.parameters())

    run_dir.mkdir(parents=True, exist_ok=True)
    data = {name: _load_task(data_dir, name) for name in task_names}
    heads: dict[str, TaskHead] = {}
    with stage(info, "heads"):
        for name in task_names:
            x, y = data[name]["train"]
            x, y = x[: cfg.head_samples], y[: cfg.head_samples]
            prompts = None
            if cfg.head_source == "prompt":
                prompts = (T.to_pixel_values(data[name]["prompt"][0]), torch.from_numpy(data[name]["prompt"][1]))
            elif cfg.head_source != "train":
                raise ValueError(f"head_source must be 'prompt' or 'train', not {cfg.head_source!r}")
            heads[name] = fit_head(base, T.to_pixel_values(x), torch.from_numpy(y), len(T.TASKS[name].classes),
                                    cfg.head_scale, prompts)
        save_heads(heads, run_dir)

    info["finetune_loss"], info["accuracy"] = {}, {"pretrained": {}, "finetuned": {}}
    info["accuracy_val"] = {"pretrained": {}, "finetuned": {}}
    for i, name in enumerate(task_names):
        target = run_dir / "finetuned" / name
        x, y = T.to_pixel_values(data[name]["train"][0]), torch.from_numpy(data[name]["train"][1])
        with stage(info, f"finetune/{name}"):
            model, losses = finetune(base, heads[name], x, y, steps=cfg.ft_steps, batch=cfg.ft_batch, lr=cfg.ft_lr,
                                     weight_decay=cfg.ft_weight_decay, warmup=cfg.warmup, seed=seed * 1000 + i + 1)
            with atomic_dir(target) as tmp:
                _save(model, tmp)
        info["finetune_loss"][name] = losses
        for split, key in (("test", "accuracy"), ("val", "accuracy_val")):
            xs, ys = T.to_pixel_values(data[name][split][0]), torch.from_numpy(data[name][split][1])
            info[key]["pretrained"][name] = head_accuracy(base, heads[name], xs, ys)
            info[key]["finetuned"][name] = head_accuracy(model, heads[name], xs, ys)
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
          log: Log) -> TinySuite:
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
                     heads=load_heads(run_dir), val=val, test=test, unlabeled=T.to_pixel_values(mixed), info=info)


@dataclass
class TinyBench:
    """The tiny suite as a :class:`~benchmarks.suites.protocol.Bench`: full CLIP towers on pixels, and one replicate
    (the suite fine-tunes every task once)."""

    suite: TinySuite

    def __post_init__(self) -> None:
        self.base_dir = self.suite.base_dir
        self.heads = self.suite.heads
        self.model = CLIPVisionModel.from_pretrained(self.base_dir).eval()
        self.replicates = [Replicate(self.suite.info["seed"], dict(self.suite.finetuned))]

    @property
    def tasks(self) -> list[str]:
        return self.suite.tasks

    def labels(self, split: str) -> dict[str, torch.Tensor]:
        return {t: y for t, (_, y) in getattr(self.suite, split).items()}

    def features(self, state: State, split: str, tasks: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        self.model.load_state_dict(state)
        data = getattr(self.suite, split)
        return {t: features(self.model, data[t][0]) for t in tasks or self.tasks}

    def state_of(self, model: CLIPVisionModel) -> State:
        return {k: v.clone() for k, v in model.state_dict().items()}

    def load_state(self, folder: Path) -> State:
        return self.state_of(CLIPVisionModel.from_pretrained(folder))

    def scoring_data(self, seed: int, num_samples: int = 128) -> torch.Tensor:
        order = torch.randperm(len(self.suite.unlabeled), generator=torch.Generator().manual_seed(seed))
        return self.suite.unlabeled[order[:num_samples]]


def main(args, out: Path, command: str = "", start: float | None = None) -> None:
    """``python -m benchmarks.suites tiny``: build (or load) the tiny suite, run the gated protocol, write the M-TIES
    merge and the results; ``start``: when the command started, so that the record's total is the one it prints."""
    from benchmarks.suites.run import machine, method_specs, run_protocol, save_m_ties, write_results

    begin, load = time.perf_counter(), os.getloadavg()
    start = begin if start is None else start
    suite = build_tiny_suite(args.cache, fast=args.fast)
    log = Log(True, "suite tiny")
    log.start = start  # the log's clock is the record's: the command's
    built = time.perf_counter() - begin
    log(f"suite ready in {built:.0f} s: {len(suite.finetuned)} fine-tuned CLIP vision towers")
    torch.use_deterministic_algorithms(True)
    with torch_threads(args.threads):
        bench = TinyBench(suite)
        # num_tasks=4: task arithmetic's grid as written, the one the committed tiny table was searched on.
        specs = method_specs(range(bench.model.config.num_hidden_layers), "smoke" if args.fast else "main",
                             num_tasks=4)
        results, gates, diffs = run_protocol(bench, specs, num_samples=args.num_samples, log=log)
        out.mkdir(parents=True, exist_ok=True)
        save_m_ties(bench, results[0], out / "m_ties_merge", args.num_samples)
        extra = {"suite": "tiny", "command": command, "config": suite.info["config"],
                 "machine": machine(args.threads, load, os.getloadavg()),
                 "timings": {"build_s": round(built, 1), "total_s": round(time.perf_counter() - start, 1)}}
        cfg = suite.info["config"]
        title = (f"# Suite `tiny`: a {cfg['num_hidden_layers']}-layer CLIP tower pretrained in-process, "
                 f"{len(bench.tasks)} tasks × 1 replicate")
        setup = (f"Command: `{command}`. Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, "
                 f"{args.threads} torch threads. Time: build (or cache load) {built:.0f} s, total "
                 f"{extra['timings']['total_s']:.0f} s. One set of fine-tunes ({cfg['ft_steps']} AdamW steps × "
                 f"{cfg['ft_batch']}, lr {cfg['ft_lr']:g}, whole encoder); {cfg['n_val']} val / {cfg['n_test']} "
                 "test images per task at most (fewer where a task's sources run out).")
        header = [title, "", setup]
        write_results(out, results, gates, diffs, header, extra)
