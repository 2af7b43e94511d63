"""Child script run *inside the fusion-bench venv* by ``run_peer.py``.

It must not import hf_mloss (that package is not installed there).  Usage::

    <fusion-bench venv>/bin/python _fusion_bench_child.py SPEC.json

SPEC.json keys: ``method`` ("ties" | "task_arithmetic" | "tsv_m" | "iso_c" |
"iso_cts" | "wudi" | "average"), ``base_dir``, ``model_dirs`` (list), ``out_dir``,
``scaling_factor`` (TSV-M: its ``alpha``), ``threshold`` (TIES only, in
fusion-bench's own form), ``merge_func`` (TIES only),
``common_space_fraction`` (Iso-CTS only), ``iter_num`` (WUDI only),
``svc_alpha`` (optional: the merge then calibrated by fusion-bench's
``SingularValueCalibration`` at that alpha, as its ``singular_value_calibration``
configurations run it), ``seed`` and ``model_class`` ("module:Class", default
"transformers:CLIPVisionModel").

TSV-M, Iso-C, Iso-CTS and WUDI run fusion-bench's own algorithm classes on a
``BaseModelPool`` of the loaded models, with a one-device CPU Lightning Fabric.

The merged model's ``state_dict()`` is written with safetensors ``save_file``
to ``out_dir/model.safetensors`` (plus ``config.json`` so it reloads with
``from_pretrained``); ``out_dir/fusion_bench_run.json`` records the timings
and which keys were merged.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path


def main(spec_path: str) -> None:
    """Load the models, merge them with fusion-bench and save the result."""
    spec = json.loads(Path(spec_path).read_text())
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(int(spec.get("seed", 0)))
    module_name, cls_name = spec.get("model_class", "transformers:CLIPVisionModel").split(":")
    model_cls = getattr(importlib.import_module(module_name), cls_name)

    t0 = time.perf_counter()
    from fusion_bench.method import TaskArithmeticAlgorithm, TiesMergingAlgorithm

    t1 = time.perf_counter()

    def load(path: str):
        return model_cls.from_pretrained(path, dtype=torch.float32).eval()

    pool = {"_pretrained_": load(spec["base_dir"])}
    for i, path in enumerate(spec["model_dirs"]):
        pool[f"ft{i}"] = load(path)
    keys = sorted(pool["_pretrained_"].state_dict().keys())
    t2 = time.perf_counter()

    if spec["method"] == "ties":
        algo = TiesMergingAlgorithm(
            scaling_factor=float(spec["scaling_factor"]),
            threshold=spec["threshold"],
            remove_keys=[],
            merge_func=spec.get("merge_func", "mean"),
        )
    elif spec["method"] == "task_arithmetic":
        algo = TaskArithmeticAlgorithm(scaling_factor=float(spec["scaling_factor"]))
    elif spec["method"] == "average":
        from fusion_bench.method import SimpleAverageAlgorithm

        algo = SimpleAverageAlgorithm()
    elif spec["method"] in ("tsv_m", "iso_c", "iso_cts", "wudi"):
        algo = _svd_algorithm(spec)
    else:
        raise SystemExit(f"unsupported fusion-bench method {spec['method']!r}")
    from fusion_bench.modelpool import BaseModelPool

    if spec["method"] in ("tsv_m", "iso_c", "iso_cts", "wudi", "average"):
        merged = algo.run(BaseModelPool(dict(pool)))
    else:
        merged = algo.run(dict(pool))
    t3 = time.perf_counter()
    if spec.get("svc_alpha") is not None:  # as SingularValueCalibrationWithBaseMethod: the merge, then SVC
        from fusion_bench.method.singular_value_calibration import SingularValueCalibration

        # a pool read afresh, as fusion-bench's path-based pools give every load_model (its merges write into the
        # in-memory pretrained model they were handed, which would otherwise read as the base here)
        fresh = {"_pretrained_": load(spec["base_dir"])}
        fresh.update({f"ft{i}": load(path) for i, path in enumerate(spec["model_dirs"])})
        calibrated = BaseModelPool({**fresh, "_merged_": merged})
        merged = SingularValueCalibration(alpha=float(spec["svc_alpha"]), accelerator="cpu").run(calibrated)
    t3b = time.perf_counter()

    out_dir = Path(spec["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous().clone() for k, v in merged.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    if hasattr(merged, "config"):
        merged.config.save_pretrained(out_dir)
    t4 = time.perf_counter()

    info = {
        "import_s": round(t1 - t0, 3),
        "load_s": round(t2 - t1, 3),
        "merge_s": round(t3 - t2, 3),
        "svc_s": round(t3b - t3, 3),
        "save_s": round(t4 - t3, 3),
        "merged_keys": keys,
        "buffers_not_in_state_dict": sorted(name for name, _ in merged.named_buffers() if name not in state),
    }
    (out_dir / "fusion_bench_run.json").write_text(json.dumps(info, indent=2) + "\n")


def _svd_algorithm(spec: dict):
    """fusion-bench's TSV-M / Iso-C / Iso-CTS / WUDI, on the CPU."""
    import lightning as L
    from fusion_bench.method import ISO_C_Merge, ISO_CTS_Merge, TaskSingularVectorMerging, WUDIMerging

    scale = float(spec["scaling_factor"])
    if spec["method"] == "wudi":
        algo = WUDIMerging(iter_num=int(spec.get("iter_num", 400)), exclude_keys=[])
    elif spec["method"] == "tsv_m":
        algo = TaskSingularVectorMerging(alpha=scale, exclude_keys=[])
    elif spec["method"] == "iso_c":
        algo = ISO_C_Merge(scaling_factor=scale, exclude_keys=[])
    else:
        algo = ISO_CTS_Merge(scaling_factor=scale, common_space_fraction=float(spec["common_space_fraction"]),
                             exclude_keys=[])
    algo.fabric = L.Fabric(accelerator="cpu", devices=1)
    return algo


if __name__ == "__main__":
    main(sys.argv[1])
