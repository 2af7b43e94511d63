"""The public entry points: ``merge``, ``score``, ``compatibility`` and ``run`` (a recipe).

Each call builds a :class:`~hf_mloss.MergeConfig` (a pure description: it validates, reads and writes recipes, and
runs nothing) and hands it to the engine: the merge driver (:mod:`hf_mloss.merging.driver`), the scorer
(:mod:`hf_mloss.engine.score`) or the compatibility report (:mod:`hf_mloss.compatibility`). The keyword arguments the three
share (which weights, which data, where to run) are declared once, in :class:`RunOptions`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from .spec.config import MergeConfig
from .errors import InvalidParameterError
from .spec.options import ScoringOptions
from .spec.selection import selection_options

if TYPE_CHECKING:
    import torch

    from .engine.compatibility import CompatibilityReport
    from .output.report import MLossReport
    from .output.result import MergeResult

__all__ = ["RunOptions", "compatibility", "merge", "run", "run_score", "score"]

RUNTIME_OPTIONS = ("device", "token", "progress")
"""Options of the run, not of the recipe: never written to a config."""


class RunOptions(TypedDict, total=False):
    """Keyword arguments shared by :func:`merge`, :func:`score` and :func:`compatibility`.

    How the models are read:
        weights: α, one per fine-tuned model (default uniform 1/q; 1 for task arithmetic and ``dare_linear``).
        revision: Hub branch, tag or commit for every Hub model, or one per model (base first; None for folders).
        seed: seeds DARE masks, random ranks and the data sample (results are reproducible).
    How the unlabeled data is read (see :class:`~hf_mloss.spec.config.DataSpec`):
        num_samples: samples to use (default 128, the paper's); split: the dataset split (``"train"``);
        image_column / text_column: the image or text column (auto-detected); max_length: tokens per sequence at
        most (text, default 128); batch_size: forward batch size (16);
        processor: image processor for ``data`` (Hub id, folder or object; default: the base's);
        compute_dtype: dtype of the scoring forwards (``"float32"`` or ``"bfloat16"``).
    Where it runs (never recorded in a config):
        device: ``"auto"`` (default: the accelerator when present — this process's under ``torchrun`` /
            ``accelerate launch``, else CUDA, then MPS — else the CPU), ``"cpu"``, ``"cuda:1"``, ``"mps"``.
        token: passed to the Hub for private models; never stored or printed.
        progress: show progress bars (default True).
    """

    weights: Sequence[float] | None
    revision: str | Sequence[str | None] | None
    seed: int
    num_samples: int
    split: str
    image_column: str | None
    text_column: str | None
    max_length: int | None
    batch_size: int
    processor: Any
    compute_dtype: str
    device: str | torch.device | None
    token: str | bool | None
    progress: bool


def _split_runtime(options: dict[str, Any]) -> dict[str, Any]:
    """Pop the run's own options (device, token, progress) out of ``options``."""
    run = {key: options.pop(key) for key in RUNTIME_OPTIONS if key in options}
    run.setdefault("progress", True)
    return run


def merge(base: Any, models: Sequence[Any], method: str = "ties", *, data: Any = None, text_data: Any = None,
          select: str | Mapping[str, Any] | None = None, grid: Mapping[str, Sequence[Any]] | None = None,
          criterion: str | None = None, heads: Sequence[Any] | None = None, **options: Any) -> MergeResult:
    """Merge fine-tuned models of one base into one model.

    Args:
        base: the pretrained model the others were fine-tuned from (Hub id, local folder or loaded model).
        models: the q fine-tuned models (Hub ids, local folders or loaded models), or PEFT LoRA adapters of the base
            (folders or Hub ids holding ``adapter_config.json``), read as their merged models, tensor by tensor.
        method: a registered method (``hf_mloss.list_methods()``): ``auto``, ``average``, ``task_arithmetic``,
            ``ties``, ``dare_ties``, ``tsv_m``, ``iso_c``, ``iso_cts``, ``wudi``, ``cart``, ``m_ties``, ``regmean``,
            ``regmean_plusplus``, ``adamerging``, mergekit's ``slerp``, ``model_stock``, ``della``...
        data: unlabeled data for the data-guided methods (``auto``, ``m_ties``, ``regmean``, the learned merges) and
            selection, shared by every model (a model's own goes in its entry, ``{"model": ..., "data": ...}``):
            for image families a Hub dataset id, local image folder, ``datasets`` object, list of images or a
            preprocessed ``[N, 3, H, W]`` tensor; for text families a list of strings, a text or data file, a folder
            of text files, or a ``datasets`` text split (tokenised with the base's tokenizer).
        text_data: a whole two-tower model (a ``CLIPModel`` with both towers fine-tuned, or a LLaVA / Qwen2-VL,
            whose ``data`` is images for the vision tower): text for the text tower or language model, in any form
            ``data`` takes for text families (``text_column``, ``max_length`` apply to it). Each tower is scored on
            its own data; a tower without data is merged by the method's data-free rule (M-TIES: TIES trim at k),
            as the report's ``towers`` and the card say.
        select: ``"unlabeled"`` chooses the parameters in ``grid`` on ``data`` without labels (or a mapping of
            :class:`~hf_mloss.spec.selection.SelectionOptions`: ``num_samples``, ``share``, ``shares``,
            ``compare``).
        grid: the candidates, e.g. ``{"k": [0.2, 0.5, 0.8], "lam": [0.5, 1.0, 1.5]}`` (every combination).
        criterion: ``"output"`` (discrepancy with each expert, default; a causal LM's: the KL of next-token
            distributions), ``"entropy"`` (encoders: needs ``heads``; a causal LM: of its own next-token
            distribution) or ``"mloss"`` (merged-prefix M-Loss); see :mod:`hf_mloss.merging.selection`.
        heads: encoders: one classification head per model (for ``"entropy"``, and the logit KL of ``"output"``).
        **options: the shared :class:`RunOptions` (``weights``, ``num_samples``, ``device``...); config fields
            ``dtype`` (of the merged model, default the base's; arithmetic runs in float32) and ``output``
            (``"auto"``: the base's class; ``"tower"``: only the merged tower; ``"adapter"``: a PEFT LoRA adapter,
            with ``combination`` and ``lora_rank``, see :mod:`hf_mloss.output.adapter`), ``tokenizer_source``
            (text models whose fine-tunes added tokens: ``"union"``, ``"base"`` or a model; the rows are aligned as
            mergekit aligns them and the merged tokenizer is saved, see :mod:`hf_mloss.loading.vocab`); and the
            method's parameters (``k``, ``e``, ``lam``, ``p``, ``t``, ``scope``, ``layers``...), which data-free
            methods may vary over the model as in mergekit (``k=[0.2, 0.8]``, filter lists; see
            :mod:`hf_mloss.spec.schedule`), as keywords or as one mapping, a recipe's ``parameters={"k": 0.2}``.

    Returns:
        A :class:`~hf_mloss.MergeResult`: ``.model`` (the merged model), ``.config`` (the recorded recipe),
        ``.report``.

    Example:
        ```python
        >>> import hf_mloss
        >>> result = hf_mloss.merge("openai/clip-vit-base-patch32", ["org/ft-cars", "org/ft-dtd"], "ties", k=0.2)
        >>> result.save_pretrained("merged-clip")
        >>> chosen = hf_mloss.merge(base, models, "ties", data="path/to/images", select="unlabeled",
        ...                         grid={"k": [0.2, 0.5, 0.8], "lam": [0.5, 1.0, 1.5]})
        >>> chosen.config.select.chosen                          # the label-free choice, recorded
        ```
    """
    run_options = _split_runtime(options)
    if heads is not None and select is None and _takes(method, "heads"):  # a learned merge's or auto's heads
        options["heads"], heads = heads, None
    if criterion is not None and select is None and _takes(method, "criterion"):  # auto's criterion
        options["criterion"], criterion = criterion, None
    selection = selection_options(select, grid=grid, criterion=criterion, heads=heads)
    config = MergeConfig.from_kwargs(base, models, method, data=data, text_data=text_data, select=selection,
                                     **options)
    return run(config, **run_options)


def _takes(method: str, parameter: str) -> bool:
    """Whether ``method`` is a registered method with this parameter (a learned merge's ``heads``, auto's
    ``heads`` and ``criterion``): the keyword is then the method's, not label-free selection's."""
    import dataclasses

    from .methods import get_method

    try:
        return parameter in {f.name for f in dataclasses.fields(get_method(method).params_class)}
    except KeyError:  # an unknown method is refused, with its hint, by the config
        return False


def score(base: Any, models: Sequence[Any], data: Any = None, *, text_data: Any = None, prefix: str = "own",
          reduction: str = "abs", activation: str | None = None, eps: float = 1e-4,
          layers: Sequence[int] | None = None, method: str = "m_ties", **options: Any) -> MLossReport:
    """Measure mergeability without merging: node and layer M-Loss of ``models`` over unlabeled ``data``.

    Args:
        base, models, data, text_data: as in :func:`merge` (``text_data``: a whole CLIPModel's text tower or a
            vision-language model's language model is scored too; the report's layers are then named as in the
            whole model, ``text_model.encoder.layers.0.mlp.fc1``, ``model.language_model.layers.0.mlp.gate_proj``).
        prefix: where each scored linear's input comes from: ``"own"`` (each model's own forward, the paper's
            definition; q forwards), ``"base"`` (the base model's forward, shared), or ``"merged"`` (the
            merged-so-far model of a ``method`` merge, M-TIES by default, with its parameters such as ``k``/``e``).
        reduction: ``"abs"`` (mean |g|, the paper) or ``"sq"`` (mean g², the authors' code).
        activation: override the model's own activation (e.g. ``"gelu_pytorch_tanh"`` as in the reference code).
        eps: ε of the per-position normalised M-Loss.
        layers: blocks to score (default: all).
        method: the data-guided method whose merged prefix ``prefix="merged"`` scores.
        **options: the shared :class:`RunOptions`; with ``prefix="merged"`` also the method's parameters.

    Returns:
        An :class:`~hf_mloss.output.report.MLossReport` (``.summary()`` prints the per-layer table).

    Example:
        ```python
        >>> report = hf_mloss.score("openai/clip-vit-base-patch32", ["org/ft-a", "org/ft-b"], data="tanganke/dtd")
        >>> print(report.summary())
        ```
    """
    run_options = _split_runtime(options)
    scoring = ScoringOptions(prefix=prefix, reduction=reduction, activation=activation, eps=eps,
                             layers=tuple(layers) if layers is not None else None)
    config_fields = set(MergeConfig.__dataclass_fields__) | set(RunOptions.__annotations__)
    method_params = sorted(k for k in options if k not in config_fields or k == "parameters")
    if prefix != "merged" and method_params:
        raise InvalidParameterError(f"Unknown argument(s) {method_params} for score() with prefix={prefix!r} "
                                    "(method parameters apply only with prefix='merged').")
    config = MergeConfig.from_kwargs(base, models, method, data=data, text_data=text_data, score=scoring, **options)
    return run_score(config, **run_options)


def compatibility(base: Any, models: Sequence[Any], data: Any = None, *,
                  subsets: Sequence[Sequence[int | str]] | None = None, leave_one_out: bool = True,
                  baselines: bool = True, output_gap: bool = False, per_node: bool = False, reduction: str = "abs",
                  activation: str | None = None, eps: float = 1e-4, layers: Sequence[int] | None = None,
                  **options: Any) -> CompatibilityReport:
    """Which candidate fine-tunes merge well together, from a few unlabeled samples and ONE forward per model.

    Args:
        base, models, data: as in :func:`merge`; ``text_data=`` (in ``options``) scores the text tower of a whole
            CLIPModel or the language model of a LLaVA / Qwen2-VL beside ``data``'s images (layers of both towers).
        subsets: more subsets to score besides every pair, leave-one-out and the whole set (model indices or names).
        leave_one_out: also score the set without each model (q ≥ 3).
        baselines: add the task-vector baselines (cosine, distance, norms, TIES sign conflicts).
        output_gap: add the output-level gap between each scored subset's average merge and the ensemble of its
            members' pooled features (one more forward per subset and per model).
        per_node: keep every subset's per-node M-Loss (``report.node``).
        reduction, activation, eps, layers: as in :func:`score` (the prefix is always ``"own"``).
        **options: the shared :class:`RunOptions`.

    Returns:
        A :class:`~hf_mloss.engine.compatibility.CompatibilityReport`.

    Example:
        ```python
        >>> report = hf_mloss.compatibility("openai/clip-vit-base-patch32", ["org/ft-a", "org/ft-b", "org/ft-c"],
        ...                                 data="tanganke/dtd", num_samples=64)
        >>> print(report.summary())
        ```
    """
    from .engine.compatibility import run_compatibility

    run_options = _split_runtime(options)
    scoring = ScoringOptions(prefix="own", reduction=reduction, activation=activation, eps=eps,
                             layers=tuple(layers) if layers is not None else None)
    config = MergeConfig.from_kwargs(base, models, "average", data=data, score=scoring, **options)
    return run_compatibility(config, subsets=subsets, leave_one_out=leave_one_out, baselines=baselines,
                             output_gap=output_gap, per_node=per_node, **run_options)


def run(config: MergeConfig | str | os.PathLike[str], *, device: Any = None, token: str | bool | None = None,
        progress: bool = True) -> MergeResult:
    """Run a recipe: a :class:`~hf_mloss.MergeConfig`, a YAML file, or a merged folder / Hub repo holding one.

    Args:
        config: the recipe (``MergeConfig.from_yaml`` / ``from_pretrained`` are called for a path or repo id).
        device: where to compute (see :class:`RunOptions`); a property of the run, not of the recipe.
        token: Hub token for private models (never stored).
        progress: show progress bars.

    Returns:
        The :class:`~hf_mloss.MergeResult`, whose ``config`` records what ran.

    Example:
        ```python
        >>> hf_mloss.run("merge.yaml", device="cuda").save_pretrained("merged")
        >>> hf_mloss.run("me/clip-vit-b32-8tasks-mties")        # re-run a published merge, bit for bit
        ```
    """
    from .merging.auto import choose_and_merge
    from .merging.driver import run_merge
    from .merging.selection import select_and_merge

    config = as_config(config, token=token)
    config.validate()
    return run_merge(config, device=device, token=token, progress=progress, select_and_merge=select_and_merge,
                     choose_method=choose_and_merge)


def run_score(config: MergeConfig | str | os.PathLike[str], *, device: Any = None, token: str | bool | None = None,
              progress: bool = True) -> MLossReport:
    """Measure a recipe's M-Loss with its ``score`` options (no merge unless ``prefix="merged"``).

    Example:
        ```python
        >>> print(hf_mloss.run_score("merge.yaml").summary())
        ```
    """
    from .engine.score import score_config

    config = as_config(config, token=token)
    config.validate()
    if not config.has_data() and not config.has_data("text_data"):
        raise InvalidParameterError("Scoring needs unlabeled data and the config has no `data`: add e.g. "
                                    "`data: {id: tanganke/dtd, split: train, num_samples: 128}` or "
                                    "`data: {path: ./images}`.")
    options = config.scoring_options()
    if options.prefix == "merged":
        return _score_merged(config, options, device=device, token=token, progress=progress)
    return score_config(config, device=device, token=token, progress=progress)


def _score_merged(config: MergeConfig, options: ScoringOptions, **run_options: Any) -> MLossReport:
    """The M-Loss a data-guided merge measures on its merged prefix (the merge is run and dropped)."""
    import dataclasses

    method = config.merge_method()
    scoring_keys = {"reduction", "activation", "eps"}
    if not method.needs_data or not scoring_keys <= {f.name for f in dataclasses.fields(method.params_class)}:
        raise InvalidParameterError(f"prefix='merged' scores the merged prefix of an M-Loss-guided merge (m_ties, "
                                    f"m_dare); method {config.method!r} does not merge by M-Loss: use prefix "
                                    "'own' or 'base', or method m_ties.")
    scoring = {k: v for k, v in options.to_dict().items() if k != "prefix" and v is not None}
    parameters = {**config.parameters, **scoring}  # the score options win, as documented for `score:`
    from .merging.driver import run_merge

    config = config.replace(parameters=parameters)
    # with text_data, every tower of the whole model is merged and scored
    return run_merge(config, scored_part_only=not config.has_data("text_data"), **run_options).report


def as_config(config: MergeConfig | str | os.PathLike[str], *, token: str | bool | None = None) -> MergeConfig:
    """A :class:`MergeConfig` from itself, a YAML file, or a folder / Hub repo holding ``hf_mloss_config.yaml``."""
    if isinstance(config, MergeConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isfile(path):
            return MergeConfig.from_yaml(path)
        return MergeConfig.from_pretrained(path, token=token)
    raise InvalidParameterError(f"run() takes a MergeConfig, a YAML file, or a folder or Hub repo holding a "
                                f"recipe, got {type(config).__name__}.")
