"""Child script run *inside the fusion-bench venv*: fusion-bench's CLIP layer-wise AdaMerging on local checkpoints.

It must not import hf_mloss.  Usage::

    <fusion-bench venv>/bin/python _fusion_bench_adamerging_child.py SPEC.json

SPEC.json keys: ``base_dir``, ``model_dirs``, ``out_dir``, ``data`` (a safetensors file: ``batch.{s}``, the images of
step s, every task's loader yields them in this order; or ``batch.{i}.{s}``, task i's own images of step s),
``heads`` (a safetensors file: ``projection`` [E, D], ``text.{i}`` [classes, E] the zero-shot text embeddings of task
i, ``logit_scale_exp`` []), ``steps``, ``lr``, ``init``, ``granularity`` (``"layer"``, the default, or ``"task"``).
It runs ``CLIPLayerWiseAdaMergingAlgorithm`` or ``CLIPTaskWiseAdaMergingAlgorithm`` unchanged (its merged model,
init, entropy loss, Adam loop, ``compute_logits``) except that the zero-shot head and the test loaders are given
instead of built from a CLIP text tower and datasets. ``out_dir/merging_weights.safetensors`` holds ``merge_weight``
([q, tensors] layer-wise, [q] task-wise) and ``out_dir/adamerging.json`` the parameter name of each column.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    import lightning as L
    import torch
    from fusion_bench.method.adamerging.clip_layer_wise_adamerging import CLIPLayerWiseAdaMergingAlgorithm
    from fusion_bench.method.adamerging.clip_task_wise_adamerging import CLIPTaskWiseAdaMergingAlgorithm
    from fusion_bench.modelpool import BaseModelPool
    from omegaconf import DictConfig
    from safetensors.torch import load_file, save_file
    from transformers import CLIPVisionModel

    data, heads = load_file(spec["data"]), load_file(spec["heads"])
    steps = int(spec["steps"])

    def load(path: str):
        return CLIPVisionModel.from_pretrained(path, dtype=torch.float32).eval()

    names = [f"ft{i}" for i in range(len(spec["model_dirs"]))]
    pool = BaseModelPool({"_pretrained_": load(spec["base_dir"]), **{n: load(p) for n, p in
                                                                       zip(names, spec["model_dirs"])}})

    task_wise = spec.get("granularity", "layer") == "task"
    own = "batch.0.0" in data  # each task's own images

    class GivenHeadsAndLoaders(CLIPTaskWiseAdaMergingAlgorithm if task_wise else CLIPLayerWiseAdaMergingAlgorithm):
        def on_test_time_adaptation_start(self):
            projection = heads["projection"]
            self.visual_projection = torch.nn.Linear(projection.shape[1], projection.shape[0], bias=False)
            self.visual_projection.weight.data.copy_(projection)
            self.visual_projection.requires_grad_(False)
            self.zeroshot_weights = {n: heads[f"text.{i}"] for i, n in enumerate(names)}
            self.logit_scale_exp = heads["logit_scale_exp"]

        def get_shuffled_test_loader_iter(self, task):
            loaders = self.__dict__.setdefault("_given_loaders", {})
            if task not in loaders:
                i = names.index(task)
                images = [data[f"batch.{i}.{s}" if own else f"batch.{s}"] for s in range(steps)]
                # the task-wise loop reads (images, labels); the layer-wise one the images first
                loaders[task] = iter([(x, torch.zeros(len(x), dtype=torch.long)) if task_wise else (x,)
                                      for x in images])
            return loaders[task]

    config = DictConfig({"name": f"clip_{'task' if task_wise else 'layer'}_wise_adamerging", "weights": None,
                         "optimizer": "adam", "lr": float(spec["lr"]), "init_values": float(spec["init"]),
                         "clamp_weights": False, "tie_weights": True, "strict": False, "devices": 1, "batch_size": 0,
                         "num_workers": 0, "max_steps": steps, "fast_dev_run": False, "save_merging_weights": False})
    algo = GivenHeadsAndLoaders(config)
    algo.fabric = L.Fabric(accelerator="cpu", devices=1)
    algo.modelpool = pool
    if task_wise:
        algo._fabric = algo.fabric  # the task-wise loop's backward
        module = algo.construct_task_wise_merged_model(pool)
        columns = ["task"]
    else:
        module = algo.construct_layer_wise_merged_model(pool)
        columns = [n for n, _ in module.pretrained_model.named_parameters()]  # one column of merge_weight each
    module = algo.test_time_adaptation(module)
    weights = module.merge_weight.detach().cpu().contiguous()
    out_dir = Path(spec["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({"merge_weight": weights}, str(out_dir / "merging_weights.safetensors"))
    (out_dir / "adamerging.json").write_text(json.dumps({"columns": columns}, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
