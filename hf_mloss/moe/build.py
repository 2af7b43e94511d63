"""``build_moe``: a Mixtral, Qwen2-MoE or Qwen3-MoE model from dense fine-tunes of one base, as mergekit-moe
builds it, written as a Hub-ready folder (weights, config, tokenizer, model card, recipe, routing report).

Every check runs before anything is computed; the folder is written beside its target and renamed into place, so it
appears complete or not at all. Before that rename the folder is checked by ``from_pretrained``'s own loading report
(nothing may be missing) and the experts' prompts are routed through it (:mod:`hf_mloss.moe.routing`), its tensors made
again from the sources as they were written (:class:`~hf_mloss.loading.store.ProducedStore`) rather than read back.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, CorruptCheckpointError, DataError, InvalidParameterError
from ..spec.config import MOE_CONFIG_NAME
from .config import MoEConfig, as_moe_config
from .inputs import MoEInputs, load_tokenizer, open_inputs
from .layered import release_memory
from .result import MoEResult
from .routing import RoutingReport

ROUTING_NAME = "routing.json"
REPORT_POSITIONS = 256
"""The most token positions the routing report and the experts' M-Loss (one pass) read by default. Prompts that hold
more are each cut to their first t tokens (the BOS included), t the largest that fits: the pass is a causal forward,
so every value at those positions is what the whole prompt gives there (exact), on fewer positions. The report then
costs a bounded share of the build whatever the prompts (0.5B experts, 44 prompts of 8-31 tokens: 69 s of forwards
over every token against a 54 s build by mergekit-moe, when the M-Loss was a forward of its own)."""


def build_moe(config: MoEConfig | Mapping[str, Any] | str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
              overwrite: bool = False, device: Any = None, token: str | bool | None = None, progress: bool = True,
              mloss: bool = True, report: bool = True, report_positions: int | None = REPORT_POSITIONS,
              max_shard_size: int | str = "5GB") -> MoEResult:
    """Build a mixture of experts from dense fine-tunes (mergekit-moe's YAML) and write it to ``out_dir``.

    Args:
        config: an :class:`~hf_mloss.moe.MoEConfig`, a mapping with mergekit-moe's keys, or its YAML file.
        out_dir: the folder to write (refused if it exists and is not empty, unless ``overwrite``).
        device: where the prompts are read (``"auto"``: the accelerator when there is one, else the CPU).
        token: Hub token for private models (never stored).
        progress: show progress bars.
        mloss: measure each expert pair's M-Loss on the routed prompts, in the routing pass (for the card).
        report: route the experts' prompts through the built model and measure the M-Loss (``False``: the build
            alone; the folder is still checked to load).
        report_positions: the most token positions the report reads (:data:`REPORT_POSITIONS`; ``None``: every
            token of every prompt).
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
    from ..output.shards import direct_writes
    from ..saving import atomic_folder, check_output_dir
    from .writer import parse_size

    direct_writes()  # HF_MLOSS_DIRECT_WRITES, checked before any work
    if not isinstance(out_dir, (str, os.PathLike)):
        raise InvalidParameterError(f"out_dir must be a folder path, got {type(out_dir).__name__}.")
    parse_size(max_shard_size)
    if report_positions is not None and (isinstance(report_positions, bool) or not isinstance(report_positions, int)
                                         or report_positions < 1):
        raise InvalidParameterError(f"report_positions must be a positive integer or None (every token), got "
                                    f"{report_positions!r:.40}.")
    config = as_moe_config(config)
    protected = config.input_paths()
    target = check_output_dir(out_dir, overwrite=overwrite, protected=protected)
    run_device = resolve_device(device)
    timings: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        # what the stage freed goes back to the system before the next one allocates; the other stages' tensors are
        # freed by reference counting (their peaks did not change without it), so the full collection, 0.2 s with
        # transformers' modules loaded, runs once, after the routing pass and its model skeleton
        release_memory(collect=stage == "routing")
        now = time.perf_counter()
        timings[stage], clock = now - clock, now

    inputs = open_inputs(config, token=token)
    try:
        num_gates = len(config.experts) + (1 if config.shared_experts else 0)
        target = check_output_dir(target, overwrite=overwrite, protected=protected,
                                  needed_bytes=inputs.output_bytes(len(config.experts)))
        generator = torch.Generator().manual_seed(config.seed)
        lap("inputs")
        gates = _gates(config, inputs, num_gates, generator, run_device, progress)
        degenerate = _warn_degenerate(gates)
        recorded = _recorded(config, inputs)
        lap("gates")
        tokens, positions = _report_cut(config, inputs, report_positions) if report else (None, None)
        with atomic_folder(target, overwrite=overwrite) as tmp:
            # the report makes each tensor again from its sources (still in the page cache) instead of reading the
            # folder back, except after noise_scale draws: then it reads the folder, and the weights go through the
            # page cache; else with O_DIRECT where allowed
            noise = any(e.noise_scale is not None for e in (*config.experts, *config.shared_experts))
            producers = _write_model(tmp, config, inputs, gates, generator, progress, max_shard_size,
                                     direct=not (report and noise))
            lap("write")
            model = _check_loads(tmp, inputs)
            routing, pairs, note = (_routing(tmp, model, config, inputs, run_device, progress, tokens, mloss,
                                             producers=None if noise else producers)
                                    if report else (None, None, "not asked for (the build alone, without a report)"))
            lap("routing")
            result = MoEResult(path=target, architecture=inputs.architecture.pretty,
                               model_class=inputs.config.architectures[0], config=recorded, routing=routing,
                               mloss=pairs, mloss_note=note, degenerate_layers=degenerate,
                               device=describe_device(run_device), timings=timings,
                               report_tokens=tokens, report_positions=positions)
            _write_records(tmp, target, result, inputs)
        lap("records")
    finally:
        inputs.close()
    return result


# ------------------------------------------------------------------------------------------------------ gates
def _gates(config: MoEConfig, inputs: MoEInputs, num_gates: int, generator: torch.Generator, device: Any,
           progress: bool) -> torch.Tensor:
    from .gates import (check_prompt_ids, embedding_representation, hidden_representation, prompt_gates,
                        prompt_tokenizer, random_gates)

    layers, hidden = inputs.num_layers, inputs.hidden_size
    if config.gate_mode in ("random", "uniform_random"):
        return random_gates(config.gate_mode, layers, num_gates, hidden, generator)
    specs = list(config.experts) + list(config.shared_experts[: num_gates - len(config.experts)])
    tokenizer = prompt_tokenizer(load_tokenizer(inputs.base))
    base = inputs.store(inputs.base)
    check_prompt_ids(tokenizer, specs, base.shapes["model.embed_tokens.weight"][0])
    if config.gate_mode == "cheap_embed":
        gates = prompt_gates(specs, embedding_representation(base.get("model.embed_tokens.weight"), tokenizer, layers),
                             progress=progress)
    else:
        from ..parallel import cpu_workers
        from .layered import LayeredModel, skeleton

        model, _ = skeleton(inputs.base.path, dtype=getattr(torch, config.prompt_dtype))  # mergekit's: bfloat16
        layered = LayeredModel(model, base, device)
        with cpu_workers(device):  # as many threads as the cores other processes leave idle (the rows do not change)
            represent = hidden_representation(layered, tokenizer, specs, average=config.gate_mode == "hidden_avg",
                                              progress=progress)
        gates = prompt_gates(specs, represent)
    if not bool(torch.isfinite(gates).all()):
        for name in base.keys():  # the usual cause: a corrupt base
            _check_finite(base.get(name), name, f"base_model ({inputs.base.name})")
        raise DataError(f"The prompts' hidden states in the base (read in {config.prompt_dtype}) are not finite, so "
                        f"no router rows can be made from them: the base overflows {config.prompt_dtype} on these "
                        "prompts.")
    return gates


def _check_finite(tensor: torch.Tensor, name: str, model: str) -> None:
    """Refuse a tensor holding NaN or infinity (one reduction first: a finite sum means every value is finite)."""
    if not bool(torch.isfinite(tensor.sum())) and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise CorruptCheckpointError(f"{name!r} of {model} holds {bad} non-finite value(s) (NaN/Inf): the checkpoint "
                                     "is corrupt or was saved after a diverged training run.")


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
                 generator: torch.Generator, progress: bool, max_shard_size: int | str, *, direct: bool
                 ) -> dict[str, Any]:
    """config.json (+ the keys transformers 4.x reads), generation config, weights (``direct``: with ``O_DIRECT``
    where allowed, :class:`~hf_mloss.output.shards.DirectFile`), tokenizer. Returns each written tensor's producer
    (:func:`_planned_tensors`), by its name in the files."""
    from tqdm.auto import tqdm

    from .architectures import legacy_keys
    from .writer import ShardWriter

    arch = inputs.architecture
    inputs.config.save_pretrained(folder)
    path = folder / "config.json"
    content = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**content, **legacy_keys(arch, inputs.config)}, indent=2, sort_keys=True) + "\n",
                    encoding="utf-8")
    _copy_generation_config(inputs, folder)

    planned = _planned_tensors(config, inputs, gates, generator)
    writer = ShardWriter(folder, [(name, shape, dtype) for name, shape, dtype, _ in planned], max_shard_size,
                         direct=direct)
    for name, _, _, produce in tqdm(planned, desc="Writing the MoE", unit="tensor", disable=not progress):
        writer.add(name, produce())  # straight to its place in the file: one tensor in memory at a time
    writer.finish()
    load_tokenizer(inputs.base).save_pretrained(folder)
    return {name: produce for name, _, _, produce in planned}


def _planned_tensors(config: MoEConfig, inputs: MoEInputs, gates: torch.Tensor, generator: torch.Generator
                     ) -> list[tuple[str, tuple[int, ...], torch.dtype, Any]]:
    """Every tensor of the MoE in the order it is written (the base's, the zero biases, then per layer the experts in
    mergekit's order, whose noise draws follow it, and the router rows): ``(name, shape, dtype, produce)``, where
    ``produce()`` reads or computes the tensor (call them in order; a tensor read as stored is a view of one reused
    buffer, valid until the next call: write it first)."""
    from .architectures import expert_order, expert_tensor_name, router_names

    arch, dtype = inputs.architecture, inputs.dtype
    scratch: list[torch.Tensor] = []  # the reused buffer (no fresh pages for each of the thousands of tensors)

    def cast(tensor: torch.Tensor, name: str, where: str) -> torch.Tensor:
        out = tensor if dtype is None else tensor.to(dtype)
        if out is tensor:  # no conversion: the tensor was checked when it was read or scaled
            return out
        try:
            _check_finite(out, name, where)
        except CorruptCheckpointError:  # finite before the cast: the values overflow the output dtype
            raise ConfigError(f"{where}: {name!r} overflows dtype {config.dtype} (values beyond its range); choose "
                              "a wider dtype (bfloat16 or float32).") from None
        return out

    def read(store: Any, name: str, where: str) -> torch.Tensor:
        shape, stored = tuple(store.shapes[name]), store.dtypes[name]
        nbytes = math.prod(shape) * stored.itemsize
        if not scratch or scratch[0].numel() < nbytes:
            scratch[:] = [torch.empty(nbytes, dtype=torch.uint8)]
        tensor = store.read_into(name, scratch[0][:nbytes].view(stored).view(shape))
        _check_finite(tensor, name, where)
        return tensor

    base = inputs.store(inputs.base)
    base_label = f"base_model ({inputs.base.name})"
    planned: list[tuple[str, tuple[int, ...], torch.dtype, Any]] = [
        (name, tuple(base.shapes[name]), dtype or base.dtypes[name],
         lambda name=name: cast(read(base, name, base_label), name, base_label))
        for name in inputs.base_names()]
    planned += [(name, tuple(shape), dtype or torch.float32,
                 lambda shape=shape: torch.zeros(shape, dtype=dtype or torch.float32))
                for name, shape in inputs.zero_biases.items()]
    specs = [*config.experts, *config.shared_experts]
    refs = [*inputs.experts, *inputs.shared]
    num = len(config.experts)

    places = [*(f"experts[{i}]" for i in range(num)), *(f"shared_experts[{i}]" for i in range(len(refs) - num))]

    def expert_tensor(store: Any, index: int, source: str, projection: str) -> torch.Tensor:
        spec, where = specs[index], f"{places[index]} ({store.ref.name})"
        tensor = read(store, source, where)
        if spec.noise_scale is not None:  # drawn in the tensor's own dtype, in mergekit's order
            tensor = tensor + torch.randn(tensor.shape, dtype=tensor.dtype, generator=generator) * spec.noise_scale
            _check_scaled(tensor, source, places[index], "noise_scale", spec.noise_scale)
        if projection == "down_proj" and spec.residual_scale is not None:
            tensor = tensor * spec.residual_scale
            _check_scaled(tensor, source, places[index], "residual_scale", spec.residual_scale)
        return cast(tensor, source, where)

    for layer in range(inputs.num_layers):
        for expert, projection in expert_order(arch, num, bool(config.shared_experts)):
            index = num if expert is None else expert
            store = inputs.store(refs[index])
            source = f"model.layers.{layer}.mlp.{projection}.weight"
            planned.append((expert_tensor_name(arch, layer, expert, projection), tuple(store.shapes[source]),
                            dtype or store.dtypes[source],
                            lambda store=store, index=index, source=source, projection=projection:
                            expert_tensor(store, index, source, projection)))
        router, shared_gate = router_names(arch, layer)
        planned.append((router, (num, gates.shape[-1]), dtype or gates.dtype,
                        lambda layer=layer, router=router: cast(gates[layer, :num].contiguous(), router, "router")))
        if shared_gate is not None:
            planned.append((shared_gate, (1, gates.shape[-1]), dtype or gates.dtype,
                            lambda layer=layer, shared_gate=shared_gate:
                            cast(gates[layer, num:num + 1].contiguous(), shared_gate, "router")))
    return planned


def _check_scaled(tensor: torch.Tensor, name: str, where: str, key: str, value: float) -> None:
    """A finite expert tensor that ``noise_scale`` or ``residual_scale`` made non-finite: the setting's fault."""
    try:
        _check_finite(tensor, name, where)
    except CorruptCheckpointError:
        raise ConfigError(f"{where}.{key} {value:g} makes {name!r} overflow its dtype (NaN/Inf); use a smaller "
                          "value.") from None


def _copy_generation_config(inputs: MoEInputs, folder: Path) -> None:
    if not (Path(inputs.base.path) / "generation_config.json").is_file():
        return
    from transformers import GenerationConfig

    GenerationConfig.from_pretrained(inputs.base.path).save_pretrained(folder)


# ------------------------------------------------------------------------------------------------------ reports
def _check_loads(folder: Path, inputs: MoEInputs) -> Any:
    """Check that the written folder loads with plain ``from_pretrained`` (transformers' own loading report on the
    ``meta`` device, from the files' headers: nothing missing, unexpected or mismatched); returns that skeleton, in
    float32 (the routing report's dtype, :mod:`hf_mloss.moe.routing`)."""
    from .layered import checked_skeleton

    model, info = checked_skeleton(folder, dtype=torch.float32)
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if problems:  # a bug of this module, never the user's: say what transformers reported
        raise RuntimeError(f"The written {inputs.architecture.pretty} does not load cleanly: {problems}")
    return model


def _report_prompts(config: MoEConfig) -> list[tuple[str, int]]:
    """The prompts the report reads: each routed expert's positive ones, with the expert's index."""
    return [(p, i) for i, e in enumerate(config.experts) for p in e.positive_prompts]


def _report_cut(config: MoEConfig, inputs: MoEInputs, budget: int | None
                ) -> tuple[int | None, tuple[int, int] | None]:
    """The first tokens of each prompt the report reads (``None``: all of them, the prompts fit ``budget``), and the
    token positions that leaves of all the prompts'."""
    prompts = [p for p, _ in _report_prompts(config)]
    if not prompts:
        return None, None
    from .gates import encode, prompt_tokenizer

    lengths = encode(prompt_tokenizer(load_tokenizer(inputs.base)), prompts)["attention_mask"].sum(-1).tolist()
    total = int(sum(lengths))
    if budget is None or total <= budget:
        return None, (total, total)
    tokens = 1
    while sum(min(n, tokens + 1) for n in lengths) <= budget:
        tokens += 1
    return max(tokens, 2), (int(sum(min(n, max(tokens, 2)) for n in lengths)), total)


def _routing(folder: Path, model: Any, config: MoEConfig, inputs: MoEInputs, device: Any, progress: bool,
             tokens: int | None, mloss: bool, *, producers: dict[str, Any] | None = None
             ) -> tuple[RoutingReport | None, dict[tuple[int, int], float] | None, str | None]:
    """Route the experts' prompts (their first ``tokens`` tokens) through the written model, one layer in memory at
    a time, and with ``mloss`` measure each expert pair's M-Loss in the same pass: the report, the pairs' values
    and, where they are not measured, why."""
    from ..adapters import adapter_for
    from ..loading.hub import resolve_model
    from ..loading.store import CheckpointStore, ProducedStore
    from ..parallel import cpu_workers
    from .gates import prompt_tokenizer
    from .layered import LayeredModel
    from .routing import ExpertPairGaps, route_prompts

    prompts = _report_prompts(config)
    if not prompts:
        return None, None, "the config has no prompts to measure it on (gate_mode random without prompts)"
    ref, adapter = resolve_model(str(folder)), adapter_for(model.config)
    store = CheckpointStore(ref, adapter) if producers is None else ProducedStore(ref, adapter, producers)
    gaps = ExpertPairGaps(len(config.experts)) if mloss else None
    try:
        tokenizer = prompt_tokenizer(load_tokenizer(inputs.base))
        with cpu_workers(device):
            report = route_prompts(LayeredModel(model, store, device), tokenizer, [p for p, _ in prompts],
                                   [i for _, i in prompts], [e.label for e in config.experts],
                                   top_k=config.experts_per_token, max_tokens=tokens, pair_gaps=gaps,
                                   progress=progress)  # Mixtral and the Qwen MoEs written here renormalise the top k
    finally:
        store.close()
    if gaps is None:
        return report, None, "not asked for"
    values = gaps.values()
    return report, values, None if values is not None else "the prompts hold no token past the BOS to measure it on"


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
