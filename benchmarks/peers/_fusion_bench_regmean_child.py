"""Child script run *inside the fusion-bench venv*: fusion-bench's CLIP RegMean or RegMean++ on local checkpoints.

It must not import hf_mloss.  Usage::

    <fusion-bench venv>/bin/python _fusion_bench_regmean_child.py SPEC.json

SPEC.json keys: ``method`` (``"regmean"`` | ``"regmean_plusplus"``), ``base_dir``, ``model_dirs``, ``out_dir``,
``data`` (a safetensors file holding ``pixels`` [N, 3, H, W], preprocessed: every model's "train set"; or
``pixels.{i}``, model i's own train set, as fusion-bench gives each model its task's images), ``batch_size``,
``reduce_non_diagonal_ratio``. It runs ``RegMeanAlgorithmForCLIP`` / ``RegMeanAlgorithmForCLIPPlusPlus`` unchanged in
their math, with ``num_regmean_examples`` the largest set's size (every image of every set used once), except for
what 0.2.33 cannot run under transformers 5:

* the zero-shot head (``on_regmean_start``) is replaced by a stand-in: its logits are discarded by both methods;
* RegMean++ 0.2.33 cannot be constructed (its ``_config_mapping`` is a plain dict, not the bidict the parent's
  registration reads), addresses the vision tower as ``model.vision_model`` (transformers 5's ``CLIPVisionModel`` has
  no such level) and takes ``layer(...)[0]`` of an encoder layer, which transformers 5 returns as a bare tensor (the
  first image of the batch). Each model is wrapped to restore the ``vision_model`` level and the layer forward keeps
  the whole batch, as fusion-bench's later releases do.

``out_dir/model.safetensors`` holds the merged vision tower's ``state_dict()`` (keys without ``vision_model.``).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    import torch
    from fusion_bench.method import (RegMeanAlgorithmForCLIP, RegMeanAlgorithmForCLIPPlusPlus,
                                     RegMeanAlgorithmPlusPlus)
    from fusion_bench.modelpool import CLIPVisionModelPool
    from safetensors.torch import load_file, save_file
    from torch import nn
    from torch.utils.data import TensorDataset
    from transformers import CLIPVisionModel

    torch.manual_seed(0)
    data = load_file(spec["data"])
    names = [f"ft{i}" for i in range(len(spec["model_dirs"]))]
    own = {n: data["pixels"] if "pixels" in data else data[f"pixels.{i}"] for i, n in enumerate(names)}
    datasets = {n: TensorDataset(x, torch.zeros(len(x), dtype=torch.long)) for n, x in own.items()}
    largest = max(len(x) for x in own.values())

    def load(path: str) -> nn.Module:
        return CLIPVisionModel.from_pretrained(path, dtype=torch.float32).eval()

    class Pool(CLIPVisionModelPool):
        def load_train_dataset(self, name, *args, **kwargs):
            return datasets[name]

        def load_processor(self, *args, **kwargs):
            return lambda image: image  # the pixels are preprocessed already

    plus = spec["method"] == "regmean_plusplus"

    class Wrapped(nn.Module):
        """``CLIPVisionModel`` under a ``vision_model`` attribute, as RegMean++ 0.2.33 addresses it."""

        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.vision_model = model

        @property
        def device(self):
            return next(self.parameters()).device

    class RegMean(RegMeanAlgorithmForCLIP):
        def on_regmean_start(self):  # the logits are discarded: a stand-in head
            width = pool_models["_pretrained_"].config.hidden_size
            self.visual_projection = nn.Linear(width, 4, bias=False)
            self.logit_scale_exp = torch.tensor(1.0)
            self.zeroshot_weights = {n: torch.zeros(2, 4) for n in names}

    class RegMeanPlusPlus(RegMeanAlgorithmForCLIPPlusPlus):
        _config_mapping = RegMeanAlgorithmPlusPlus._config_mapping.copy()
        _config_mapping["_dataloader_kwargs"] = "dataloader_kwargs"

        def on_regmean_start(self):
            pass

        def layer_batches_forward(self, layer, batches):
            outputs = []
            for batch in batches:
                out = layer(batch.to(next(layer.parameters()).device), attention_mask=None,
                            causal_attention_mask=None)
                outputs.append((out[0] if isinstance(out, tuple) else out).detach().cpu())
            return outputs

    pool_models = {"_pretrained_": load(spec["base_dir"]), **{n: load(p) for n, p in zip(names, spec["model_dirs"])}}
    options = dict(num_regmean_examples=largest, exclude_param_names_regex=[],
                   reduce_non_diagonal_ratio=float(spec["reduce_non_diagonal_ratio"]), weight_transpose=True,
                   dataloader_kwargs={"batch_size": int(spec["batch_size"]), "num_workers": 0})
    if plus:
        models = {k: Wrapped(copy.deepcopy(v)) for k, v in pool_models.items()}
        merged = RegMeanPlusPlus(**options).run(Pool(models=models)).vision_model
    else:
        merged = RegMean(**options).run(Pool(models={k: copy.deepcopy(v) for k, v in pool_models.items()}))
    out_dir = Path(spec["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous().clone() for k, v in merged.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "regmean.json").write_text(json.dumps({"method": spec["method"],
                                                      "images": {n: len(x) for n, x in own.items()}}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
