"""``build_moe``: a Mixtral, Qwen2-MoE or Qwen3-MoE model from dense fine-tunes of one base, as mergekit-moe
builds it, written as a Hub-ready folder (weights, config, tokenizer, model card, recipe, routing report).

Every check runs before anything is computed; the folder is written beside its target and renamed into place, so it
appears complete or not at all. Before that rename the folder is loaded back with plain ``from_pretrained`` (nothing
may be missing) and the experts' prompts are routed through it (:mod:`hf_mloss.moe.routing`).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..errors import HfMLossError
from .config import MOE_CONFIG_NAME, MoEConfig, as_moe_config
from .inputs import MoEInputs, load_tokenizer, open_inputs
from .routing import RoutingReport

ROUTING_NAME = "routing.json"


@dataclass
class MoEResult:
    """What :func:`build_moe` wrote.

    Attributes:
        path: the output folder.
        architecture: ``Mixtral``, ``Qwen2-MoE`` or ``Qwen3-MoE``; ``model_class`` its transformers class.
        config: the recipe as run (Hub models pinned to the commit read); ``hf_mloss_moe.yaml`` in the folder.
        routing: where the built MoE routes each expert's own prompts (``None`` without prompts).
        mloss: each pair of experts' M-Loss on the prompts (``{(i, j): value}``, mean over layers), or ``None`` with
            ``mloss_note`` saying why it could not be measured.
        degenerate_layers: layers whose router rows are nearly dependent (mergekit's warning).
    """

    path: Path
    architecture: str
    model_class: str
    config: MoEConfig
    routing: RoutingReport | None
    mloss: dict[tuple[int, int], float] | None
    mloss_note: str | None
    degenerate_layers: list[int] = field(default_factory=list)
    device: str = ""

    def summary(self) -> str:
        c = self.config
        lines = [f"Built a {self.architecture} ({self.model_class}) of {len(c.experts)} experts, "
                 f"{c.experts_per_token} per token{', one shared' if c.shared_experts else ''}, "
                 f"gate_mode {c.gate_mode}",
                 f"  base:    {_label(c.base_model)}",
                 "  experts: " + ", ".join(f"{i}: {e.label}" for i, e in enumerate(c.experts)),
                 f"  device:  {self.device}"]
        if self.routing is not None:
            lines += ["", self.routing.summary()]
        if self.mloss is not None:
            pairs = ", ".join(f"({i}, {j}) {v:.4g}" for (i, j), v in self.mloss.items())
            lines += ["", f"M-Loss of each expert pair on the prompts (lower merges more like an ensemble): {pairs}"]
        elif self.mloss_note:
            lines += ["", f"M-Loss not measured: {self.mloss_note}"]
        lines += ["", f"Saved to {self.path}"]
        return "\n".join(lines)


def _label(model: str) -> str:
    return Path(model).name if os.path.isabs(model) else model


def build_moe(config: MoEConfig | Mapping[str, Any] | str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
              overwrite: bool = False, device: Any = None, token: str | bool | None = None, progress: bool = True,
              mloss: bool = True, max_shard_size: int | str = "5GB") -> MoEResult:
    """Build a mixture of experts from dense fine-tunes (mergekit-moe's YAML) and write it to ``out_dir``.

    Args:
        config: an :class:`~hf_mloss.moe.MoEConfig`, a mapping with mergekit-moe's keys, or its YAML file.
        out_dir: the folder to write (refused if it exists and is not empty, unless ``overwrite``).
        device: where the prompts are read (``"auto"``: the accelerator when there is one, else the CPU).
        token: Hub token for private models (never stored).
        progress: show progress bars.
        mloss: measure each expert pair's M-Loss on the prompts (for the card).
        max_shard_size: shard the weights above this size.

    Returns:
        An :class:`MoEResult`: where it was written, the routing report and the experts' M-Loss.

    Example:
        ```python
        >>> result = hf_mloss.build_moe("moe.yaml", "my-moe")
        >>> print(result.routing.summary())       # each expert's own prompts: the share routed to it, per layer
        ```
    """
    from ..distributed import describe_device
    from ..loading.inputs import resolve_device
    from ..saving import atomic_folder, check_output_dir

    config = as_moe_config(config)
    protected = config.input_paths()
    target = check_output_dir(out_dir, overwrite=overwrite, protected=protected)
    run_device = resolve_device(device)
    inputs = open_inputs(config, token=token)
    try:
        num_gates = len(config.experts) + (1 if config.shared_experts else 0)
        target = check_output_dir(target, overwrite=overwrite, protected=protected,
                                  needed_bytes=inputs.output_bytes(len(config.experts)))
        generator = torch.Generator().manual_seed(config.seed)
        gates = _gates(config, inputs, num_gates, generator, run_device, progress)
        degenerate = _warn_degenerate(gates)
        recorded = _recorded(config, inputs)
        with atomic_folder(target, overwrite=overwrite) as tmp:
            _write_model(tmp, config, inputs, gates, generator, progress, max_shard_size)
            routing = _routing(tmp, config, inputs, run_device, progress)
            pairs, note = _pair_mloss(config, inputs, run_device, progress) if mloss else (None, "not asked for")
            result = MoEResult(path=target, architecture=inputs.architecture.pretty,
                               model_class=inputs.config.architectures[0], config=recorded, routing=routing,
                               mloss=pairs, mloss_note=note, degenerate_layers=degenerate,
                               device=describe_device(run_device))
            _write_records(tmp, target, result, inputs)
    finally:
        inputs.close()
    return result


# ------------------------------------------------------------------------------------------------------ gates
def _gates(config: MoEConfig, inputs: MoEInputs, num_gates: int, generator: torch.Generator, device: Any,
           progress: bool) -> torch.Tensor:
    from .gates import (embedding_representation, hidden_representation, prompt_gates, prompt_tokenizer,
                        random_gates)

    layers, hidden = inputs.num_layers, inputs.hidden_size
    if config.gate_mode in ("random", "uniform_random"):
        return random_gates(config.gate_mode, layers, num_gates, hidden, generator)
    specs = list(config.experts) + list(config.shared_experts[: num_gates - len(config.experts)])
    tokenizer = prompt_tokenizer(load_tokenizer(inputs.base))
    if config.gate_mode == "cheap_embed":
        embeddings = inputs.store(inputs.base).get("model.embed_tokens.weight")
        return prompt_gates(specs, embedding_representation(embeddings, tokenizer, layers), progress=progress)
    from transformers import AutoModelForCausalLM

    from .._logging import quiet_transformers

    with quiet_transformers(True):  # mergekit reads the prompts with the base in bfloat16
        model = AutoModelForCausalLM.from_pretrained(inputs.base.path, dtype=torch.bfloat16).to(device).eval()
    try:
        represent = hidden_representation(model, tokenizer, average=config.gate_mode == "hidden_avg")
        return prompt_gates(specs, represent, progress=progress)
    finally:
        del model


def _warn_degenerate(gates: torch.Tensor) -> list[int]:
    from .gates import degenerate_layers

    layers = degenerate_layers(gates)
    if layers:
        warnings.warn(f"The router rows of layer(s) {', '.join(map(str, layers))} are nearly dependent (condition "
                      "number above 5): the prompts may be too similar for the router to tell some experts apart.",
                      UserWarning, stacklevel=3)
    return layers


# ------------------------------------------------------------------------------------------------------ weights
def _write_model(folder: Path, config: MoEConfig, inputs: MoEInputs, gates: torch.Tensor,
                 generator: torch.Generator, progress: bool, max_shard_size: int | str) -> None:
    """config.json (+ the keys transformers 4.x reads), generation config, weights, tokenizer."""
    from tqdm.auto import tqdm

    from .architectures import expert_order, expert_tensor_name, legacy_keys, router_names
    from .writer import ShardWriter

    arch, dtype = inputs.architecture, inputs.dtype
    inputs.config.save_pretrained(folder)
    path = folder / "config.json"
    content = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**content, **legacy_keys(arch, inputs.config)}, indent=2, sort_keys=True) + "\n",
                    encoding="utf-8")
    _copy_generation_config(inputs, folder)

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if dtype is None else tensor.to(dtype)

    writer = ShardWriter(folder, max_shard_size)
    base = inputs.store(inputs.base)
    for name in inputs.base_names():
        writer.add(name, cast(base.get(name)))
    for name, shape in inputs.zero_biases.items():
        writer.add(name, torch.zeros(shape, dtype=dtype or torch.float32))
    specs = [*config.experts, *config.shared_experts]
    refs = [*inputs.experts, *inputs.shared]
    num = len(config.experts)
    for layer in tqdm(range(inputs.num_layers), desc="Writing the experts", unit="layer", disable=not progress):
        for expert, projection in expert_order(arch, num, bool(config.shared_experts)):
            index = num if expert is None else expert
            spec, store = specs[index], inputs.store(refs[index])
            tensor = store.get(f"model.layers.{layer}.mlp.{projection}.weight")
            if spec.noise_scale is not None:  # drawn in the tensor's own dtype, in mergekit's order
                tensor = tensor + torch.randn(tensor.shape, dtype=tensor.dtype, generator=generator) * spec.noise_scale
            if projection == "down_proj" and spec.residual_scale is not None:
                tensor = tensor * spec.residual_scale
            writer.add(expert_tensor_name(arch, layer, expert, projection), cast(tensor))
        router, shared_gate = router_names(arch, layer)
        writer.add(router, cast(gates[layer, :num].contiguous()))
        if shared_gate is not None:
            writer.add(shared_gate, cast(gates[layer, num:num + 1].contiguous()))
    writer.finish()
    load_tokenizer(inputs.base).save_pretrained(folder)


def _copy_generation_config(inputs: MoEInputs, folder: Path) -> None:
    if not (Path(inputs.base.path) / "generation_config.json").is_file():
        return
    from transformers import GenerationConfig

    GenerationConfig.from_pretrained(inputs.base.path).save_pretrained(folder)


# ------------------------------------------------------------------------------------------------------ reports
def _routing(folder: Path, config: MoEConfig, inputs: MoEInputs, device: Any, progress: bool
             ) -> RoutingReport | None:
    """Load the written folder with plain ``from_pretrained`` (nothing missing) and route the experts' prompts."""
    from transformers import AutoModelForCausalLM

    from .._logging import quiet_transformers
    from .gates import prompt_tokenizer
    from .routing import route_prompts

    with quiet_transformers(True):
        model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if problems:  # a bug of this module, never the user's: say what transformers reported
        raise RuntimeError(f"The written {inputs.architecture.pretty} does not load cleanly: {problems}")
    prompts = [(p, i) for i, e in enumerate(config.experts) for p in e.positive_prompts]
    if not prompts:
        return None
    model = model.to(device).eval()
    try:
        tokenizer = prompt_tokenizer(load_tokenizer(inputs.base))
        return route_prompts(model, tokenizer, [p for p, _ in prompts], [i for _, i in prompts],
                             [e.label for e in config.experts], top_k=config.experts_per_token,
                             progress=progress)  # Mixtral and the Qwen MoEs written here renormalise the top k
    finally:
        del model


def _pair_mloss(config: MoEConfig, inputs: MoEInputs, device: Any, progress: bool
                ) -> tuple[dict[tuple[int, int], float] | None, str | None]:
    """Each pair of experts' M-Loss on every prompt (``hf_mloss.compatibility`` on the dense experts), or why not."""
    prompts = list(dict.fromkeys(p for e in config.all_experts for p in (*e.positive_prompts, *e.negative_prompts)))
    if not prompts:
        return None, "the config has no prompts to measure it on (gate_mode random without prompts)"
    distinct = list(dict.fromkeys(ref.path for ref in inputs.experts))
    if len(distinct) < 2:
        return None, "the experts are all one model"
    from ..api import compatibility

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # e.g. fewer prompts than a default sample size
            report = compatibility(inputs.base.path, distinct, data=prompts, num_samples=len(prompts),
                                   leave_one_out=False, baselines=False, device=device, progress=progress)
    except HfMLossError as err:
        return None, " ".join(str(err).split())
    matrix = report.matrix()
    where = {path: k for k, path in enumerate(distinct)}
    pairs = {}
    for i in range(len(inputs.experts)):
        for j in range(i + 1, len(inputs.experts)):
            a, b = where[inputs.experts[i].path], where[inputs.experts[j].path]
            pairs[i, j] = 0.0 if a == b else float(matrix[a, b])
    return pairs, None


def _recorded(config: MoEConfig, inputs: MoEInputs) -> MoEConfig:
    """The config as run: Hub models pinned to the commit that was read."""
    def pin(spec, ref):
        return replace(spec, revision=ref.revision) if ref.repo_id and ref.revision else spec

    return replace(config, base_revision=inputs.base.revision if inputs.base.repo_id else config.base_revision,
                   experts=tuple(pin(s, r) for s, r in zip(config.experts, inputs.experts, strict=True)),
                   shared_experts=tuple(pin(s, r) for s, r in zip(config.shared_experts, inputs.shared, strict=True)),
                   source=None)


def _write_records(folder: Path, target: Path, result: MoEResult, inputs: MoEInputs) -> None:
    """The recipe, the routing report and the model card."""
    from .card import build_card

    (folder / MOE_CONFIG_NAME).write_text(result.config.to_yaml(root=target), encoding="utf-8")
    if result.routing is not None:
        (folder / ROUTING_NAME).write_text(json.dumps(result.routing.to_dict(), indent=1) + "\n", encoding="utf-8")
    build_card(result, inputs).save(folder / "README.md")
