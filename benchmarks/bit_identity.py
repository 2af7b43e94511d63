"""Bit identity against a reference revision: the same merges, scores and reports, value for value.

The script builds tiny CLIP, ViT and DINOv2 fixtures (save_pretrained), then runs ONE scenario through the public API
(``hf_mloss.merge`` with the data-free and data-guided methods, ``hf_mloss.score`` with every prefix,
``hf_mloss.compatibility``, label-free selection) twice: with the working tree's package and with a temporary git
worktree of ``--reference`` (default ``main``), each in a subprocess with one thread. Every merged tensor and every
report number is saved, compared bitwise, printed as a table (case, max abs diff, identical) and written to
``benchmarks/results/bit_identity.json``.

    python benchmarks/bit_identity.py                    # this tree against main
    python benchmarks/bit_identity.py --reference HEAD~3 --families clip
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "bit_identity.json"

SCENARIO = r'''
import json, sys, warnings
from pathlib import Path

import torch

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
warnings.filterwarnings("ignore")
import hf_mloss

if len(sys.argv) > 4 and sys.argv[4] == "rows-only":  # node groups without their bias entries: the earlier rule
    from hf_mloss.adapters.base import ModelAdapter

    grouped = ModelAdapter.node_groups
    ModelAdapter.node_groups = lambda self, layer: [(n, d) for n, d in grouped(self, layer) if not n.endswith(".bias")]

fixtures, out_path, families = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(",")
outputs = {}


def keep(case, value, prefix=""):
    """Flatten tensors, numbers and nested containers into outputs[case/...] (float64 lists keep every bit)."""
    if isinstance(value, torch.Tensor):
        outputs[f"{case}::{prefix}"] = value.detach().double().flatten().tolist() if value.is_floating_point() else \
            value.flatten().tolist()
    elif isinstance(value, dict):
        for k, v in value.items():
            keep(case, v, f"{prefix}/{k}")
    elif isinstance(value, (list, tuple)):
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            outputs[f"{case}::{prefix}"] = [float(v) for v in value]
        else:
            for i, v in enumerate(value):
                keep(case, v, f"{prefix}[{i}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        outputs[f"{case}::{prefix}"] = [float(value)]


NUMERIC_REPORT_KEYS = ("node", "node_normalized", "node_ratio", "layer", "layer_normalized", "layer_ratio",
                       "keep_ratios", "num_positions")


def keep_report(case, report):
    if report is None:
        return
    content = report.to_dict(per_row=True) if hasattr(report, "keep_ratios") else report.to_dict()
    if hasattr(report, "keep_ratios"):
        content = {k: content[k] for k in NUMERIC_REPORT_KEYS if k in content}
    else:
        content = {k: v for k, v in content.items() if k not in ("timings", "data")}
    keep(case, content, "/report")


def keep_merge(case, result):
    keep(case, {k: v for k, v in result.model.state_dict().items()}, "/model")
    keep_report(case, result.report)
    select = result.config.select
    if select is not None:
        keep(case, {"candidates": select.candidates, "chosen": select.chosen}, "/select")


for family in families:
    folder = fixtures / family
    base = str(folder / "base")
    models = [str(folder / f"ft{i}") for i in range(3)]
    pixels = torch.load(folder / "pixels.pt")
    common = dict(data=pixels, num_samples=len(pixels), batch_size=4, progress=False, output="tower")
    for method in ("average", "task_arithmetic", "ties", "dare"):
        params = {"dare": {"p": 0.6}, "task_arithmetic": {"lam": 0.7}}.get(method, {})
        keep_merge(f"{family}/merge/{method}", hf_mloss.merge(base, models, method, progress=False, output="tower",
                                                              **params))
    for e in (0.0, 0.1):
        for prefix in ("merged", "base", "own"):
            keep_merge(f"{family}/merge/m_ties/e={e}/{prefix}",
                       hf_mloss.merge(base, models, "m_ties", k=0.4, e=e, prefix=prefix, **common))
    keep_merge(f"{family}/merge/m_dare", hf_mloss.merge(base, models, "m_dare", p=0.6, **common))
    score_common = {k: v for k, v in common.items() if k != "output"}
    for prefix in ("own", "base", "merged"):
        for reduction in ("abs", "sq"):
            keep_report(f"{family}/score/{prefix}/{reduction}",
                        hf_mloss.score(base, models, prefix=prefix, reduction=reduction, **score_common))
    for reduction in ("abs", "sq"):
        report = hf_mloss.compatibility(base, models, reduction=reduction, per_node=True, **score_common)
        keep_report(f"{family}/compatibility/{reduction}", report)
        keep(f"{family}/compatibility/{reduction}", report.node, "/report/node")
    keep_merge(f"{family}/select/ties/mloss", hf_mloss.merge(base, models, "ties", select="unlabeled",
                                                             grid={"k": [0.2, 0.5], "lam": [0.8, 1.0]},
                                                             criterion="mloss", **common))
    keep_merge(f"{family}/select/m_ties/mloss", hf_mloss.merge(base, models, "m_ties", select="unlabeled",
                                                               grid={"k": [0.3, 0.5], "lam": [0.9, 1.1]},
                                                               criterion="mloss", **common))

out_path.write_text(json.dumps(outputs))
'''


def build_fixtures(folder: Path, families: list[str]) -> None:
    """Tiny base + 3 fine-tunes per family, saved with save_pretrained, and the scoring pixels."""
    import torch
    from transformers import BitImageProcessorPil, Dinov2Config, Dinov2Model, ViTConfig, ViTImageProcessorPil, ViTModel

    from examples.tiny import make_base, make_finetune, perturbed, save_model

    common = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    for family in families:
        root = folder / family
        if family == "clip":
            base = make_base(0)
            save_model(base, root / "base")
            for i in range(3):
                save_model(make_finetune(base, i), root / f"ft{i}")
            size = 32
        else:
            torch.manual_seed(0)
            if family == "vit":
                base, size = ViTModel(ViTConfig(**common, intermediate_size=64, image_size=32, patch_size=8)), 32
                processor = ViTImageProcessorPil(size={"height": 32, "width": 32})
            else:
                base, size = Dinov2Model(Dinov2Config(**common, mlp_ratio=2, image_size=42, patch_size=7,
                                                      layerscale_value=0.5)), 28
                processor = BitImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
            for i, model in enumerate([base.eval(), *[perturbed(base.eval(), i, 3e-2) for i in range(3)]]):
                path = root / ("base" if i == 0 else f"ft{i - 1}")
                model.save_pretrained(path)
                processor.save_pretrained(path)
        torch.save(torch.randn(10, 3, size, size, generator=torch.Generator().manual_seed(1)), root / "pixels.pt")


def run_scenario(tree: Path, fixtures: Path, out: Path, families: list[str], rows_only: bool = False) -> dict:
    script = fixtures / "scenario.py"
    script.write_text(SCENARIO)
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "HF_HOME": str(fixtures / f"hf_home_{out.stem}"), "TRANSFORMERS_VERBOSITY": "error",
           "TQDM_DISABLE": "1"}
    subprocess.run([sys.executable, str(script), str(fixtures), str(out), ",".join(families),
                    "rows-only" if rows_only else "groups"], env=env, check=True,
                   cwd=fixtures)
    return json.loads(out.read_text())


def compare(reference: dict, current: dict) -> list[dict]:
    """Per case (the first two path components after the family, e.g. ``clip/merge/ties``): max |diff|, identical."""
    rows: dict[str, dict] = {}
    for key in sorted(set(reference) | set(current)):
        case, field = key.split("::")
        parts = [p for p in re.sub(r"\[\d+\]", "", field).split("/") if p]
        if parts[0] == "model":  # one row per merged model, per report field (per metric for lists of entries)
            parts = parts[:1]
        elif len(parts) > 1:
            parts = [parts[0], parts[-1] if {"subsets", "candidates"} & set(parts) else parts[1]]
        case = f"{case}/{'.'.join(parts[:2])}"
        row = rows.setdefault(case, {"case": case, "values": 0, "max_abs_diff": 0.0, "max_rel_diff": 0.0,
                                     "identical": True, "missing": []})
        a, b = reference.get(key), current.get(key)
        if a is None or b is None or len(a) != len(b):
            row["identical"] = False
            row["missing"].append(key)
            row["max_abs_diff"] = float("inf")
            continue
        row["values"] += len(a)
        if a != b:
            row["identical"] = False
            import math

            diffs = [(abs(x - y), abs(x - y) / max(abs(x), 1e-30)) for x, y in zip(a, b)
                     if x != y and not (math.isnan(x) and math.isnan(y))]
            row["max_abs_diff"] = max(row["max_abs_diff"], *(d for d, _ in diffs))
            row["max_rel_diff"] = max(row["max_rel_diff"], *(r for _, r in diffs))
    return list(rows.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", default="main", help="git revision to compare with (default: main)")
    parser.add_argument("--families", default="clip,vit,dinov2")
    parser.add_argument("--output", default=str(RESULTS))
    parser.add_argument("--rows-only-groups", action="store_true",
                        help="run this tree with node groups of weight rows only (the bias entries trimmed per tensor, "
                             "as before node groups): isolates the rest of a change from the bias rule")
    args = parser.parse_args()
    families = args.families.split(",")
    with tempfile.TemporaryDirectory(prefix="bit_identity_") as tmp:
        tmp = Path(tmp)
        worktree = tmp / "reference"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), args.reference],
                       check=True, capture_output=True)
        try:
            fixtures = tmp / "fixtures"
            build_fixtures(fixtures, families)
            reference = run_scenario(worktree, fixtures, tmp / "reference.json", families)
            current = run_scenario(ROOT, fixtures, tmp / "current.json", families, args.rows_only_groups)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False,
                           capture_output=True)
    rows = compare(reference, current)
    width = max(len(r["case"]) for r in rows)
    print(f"{'case':<{width}}  {'values':>7}  {'max abs diff':>12}  {'max rel diff':>12}  identical")
    for r in rows:
        print(f"{r['case']:<{width}}  {r['values']:>7}  {r['max_abs_diff']:>12.3e}  {r['max_rel_diff']:>12.3e}  "
              f"{'yes' if r['identical'] else 'NO'}")
    same = sum(r["identical"] for r in rows)
    print(f"\n{same}/{len(rows)} cases identical (reference {args.reference}).")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    cases = ",\n".join("  " + json.dumps(r, default=str) for r in rows)  # one line per case
    Path(args.output).write_text(f'{{"reference": {json.dumps(args.reference)}, "families": {json.dumps(families)}, '
                                 f'"rows_only_groups": {json.dumps(args.rows_only_groups)}, '
                                 f'"identical": {same}, "cases": [\n{cases}\n]}}\n')


if __name__ == "__main__":
    main()
