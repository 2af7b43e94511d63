"""``MergeResult``: the merged model plus everything needed to publish and reproduce it."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..spec.config import MERGE_CONFIG_NAME, MergeConfig
from ..saving import atomic_folder, check_output_dir
from ..spec.schedule import split_parameters

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..adapters import ModelAdapter
    from ..loading.data import DataInfo
    from ..loading.hub import ModelRef
    from .adapter import LoraOutput
    from .report import MLossReport
    from .spill import SpilledWeights


@dataclass
class MergeResult:
    """Result of :func:`hf_mloss.merge`.

    Attributes:
        model: the merged model (the base's class, or the tower with ``output="tower"``), in ``eval()`` mode.
        config: the recorded recipe (:class:`MergeConfig`): Hub models pinned to their commit, local folders with
            a content fingerprint; ``hf_mloss.run(result.config)`` reproduces the merge.
        report: the M-Loss the merge used (data-guided methods); for a data-free merge, a report with no layers whose
            ``summary()`` says how to measure it (``report.computed`` is ``False``).
        eval_results: optional evaluation results (``{task: accuracy}``) recorded in the model card.
    """

    model: PreTrainedModel
    config: MergeConfig
    report: MLossReport | None
    base: ModelRef
    models: list[ModelRef]
    adapter: ModelAdapter
    data_info: DataInfo | None = None
    method_description: str = ""
    eval_results: dict[str, float] = field(default_factory=dict)
    lora: LoraOutput | None = None
    """``output="adapter"``: the merged LoRA adapter that ``save_pretrained`` writes (``model`` is then the merged
    model it was factored from)."""
    device: str = ""
    """Where the merge was computed (``cpu``, ``cuda:0 (NVIDIA ...)``, ``mps``), as the card records it."""
    tokenizer: Any = None
    """The merged vocabulary's tokenizer (``tokenizer_source``), saved beside the weights instead of the base's."""
    model_data_info: dict[str, list[DataInfo | None]] = field(default_factory=dict)
    """Where each model's own data came from (``{"data": [info or None per model], "text_data": [...]}``; empty
    when every model read the shared data), as the card lists it."""
    model_loader: Callable[[], PreTrainedModel] | None = field(default=None, repr=False, compare=False)
    """Builds :attr:`model` on first access (an adapter output written from the inputs' factors alone, whose
    merged model nothing else needs: the base loaded and ΔW = B·A added, once)."""
    spilled: SpilledWeights | None = field(default=None, repr=False, compare=False)
    """A large merge written block by block (:mod:`hf_mloss.output.spill`): its weights files, which
    ``save_pretrained`` links into the folder; :attr:`model` is then read from them on first access."""

    @property
    def method(self) -> str:
        return self.config.method

    @property
    def params(self) -> dict[str, Any]:
        """The method's parameters, defaults filled in (values that vary over the model as given)."""
        scheduled = split_parameters(self.config.merge_method(), self.config.parameters)[1]
        return {**self.config.method_params().to_dict(), **{k: s.to_plain() for k, s in scheduled.items()}}

    @property
    def weights(self) -> list[float]:
        alpha = self.config.weights
        if alpha is not None:
            return alpha
        q = len(self.models)
        method = self.config.merge_method().weighted_as(self.config.method_params())
        return [1.0 if method.default_weight == "one" else 1.0 / q] * q

    def save_pretrained(self, save_directory: str | os.PathLike[str], *, max_shard_size: int | str = "5GB",
                        overwrite: bool = False, push_to_hub: bool = False, repo_id: str | None = None,
                        **push_kwargs: Any) -> Path:
        """Write a Hub-ready folder: safetensors (+ index), config, processor, model card, merge config, M-Loss
        report, and the list of the files written (``hf_mloss_files.json``, what a push uploads).

        The folder is written next to its final place and renamed into it, so it appears complete or not at all.
        Under ``torchrun`` / ``accelerate launch`` only the main process writes (and pushes); the others wait for it.
        An existing non-empty folder is refused unless ``overwrite=True``, and then replaced only at the final
        rename. An output folder that overlaps an input is refused.

        Args:
            save_directory: the folder to write.
            max_shard_size: shard the weights above this size (``"5GB"``, or bytes).
            overwrite: replace an existing non-empty folder.
            push_to_hub: then upload the folder to ``repo_id`` (default: the folder name) in one commit.
            **push_kwargs: ``private``, ``token``, ``revision``, ``create_pr``, ``commit_message``.

        Returns:
            The folder written.

        Example:
            ```python
            >>> result = hf_mloss.merge(base, models, "ties")
            >>> result.save_pretrained("merged", push_to_hub=True, repo_id="me/merged", private=True)
            ```
        """
        from ..distributed import main_process_only

        if push_to_hub:
            from .push import check_repo_id

            check_repo_id(repo_id or Path(save_directory).name)
        target = Path(os.fspath(save_directory)).expanduser()
        with main_process_only() as main:  # under torchrun / accelerate launch: one writer, the others wait
            if main:
                target = check_output_dir(save_directory, overwrite=overwrite, protected=self.input_paths(),
                                          needed_bytes=self.output_bytes(target))
                with atomic_folder(target, overwrite=overwrite) as tmp:
                    self._write(tmp, max_shard_size=max_shard_size, final=target)
                if push_to_hub:
                    from .push import push_folder

                    push_folder(target, repo_id or target.name, **push_kwargs)
        return target

    def push_to_hub(self, repo_id: str, *, private: bool | None = None, token: str | bool | None = None,
                    revision: str | None = None, create_pr: bool = False, commit_message: str | None = None,
                    max_shard_size: int | str = "5GB") -> Any:
        """Write the folder to a temporary directory and upload it to ``repo_id`` in ONE commit.

        The temporary copy is removed whatever happens; to keep a local copy, use ``save_pretrained(folder,
        push_to_hub=True)`` (a failed push then leaves the folder and says how to retry).

        Args:
            repo_id: the Hub repo (``org/name``), created if needed.
            private: create the repo as private.
            token: passed to the Hub; never stored or printed (default: ``hf auth login`` / ``HF_TOKEN``).
            revision, create_pr, commit_message: where and how to commit.
            max_shard_size: shard the weights above this size.

        Returns:
            The ``CommitInfo`` of the commit (``None`` on the other processes of a ``torchrun`` job: only the main
            one uploads).

        Example:
            ```python
            >>> hf_mloss.merge(base, models, "m_ties", data="tanganke/dtd").push_to_hub("me/merged-clip")
            ```
        """
        from ..distributed import main_process_only
        from .push import check_repo_id, push_folder

        check_repo_id(repo_id)
        info = None
        with main_process_only() as main:  # one commit per job (the other processes get None)
            if main:
                tmp = Path(tempfile.mkdtemp(prefix="hf_mloss-push-"))
                try:
                    folder = tmp / "merged"
                    with atomic_folder(folder) as out:
                        self._write(out, max_shard_size=max_shard_size, final=None)
                    info = push_folder(folder, repo_id, private=private, token=token, revision=revision,
                                       create_pr=create_pr, commit_message=commit_message, keep_hint=False)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
        return info

    def _write(self, folder: Path, *, max_shard_size: int | str, final: Path | None) -> None:
        from .card import build_model_card
        from .checkpoint import save_weights

        if self.lora is not None:  # a PEFT adapter: adapter_model.safetensors + adapter_config.json
            self.lora.save(folder)
        elif self.spilled is not None:  # written while merging: its files, linked (or copied) into the folder
            self.spilled.save_into(folder, base_path=self.base.path)
            self._save_processor(folder)
        else:
            save_weights(self.model, self.adapter, folder, max_shard_size=max_shard_size, base_path=self.base.path)
            self._save_processor(folder)
        # local paths in the saved config are relative to where the folder ends up (absolute without one)
        if final is None:
            (folder / MERGE_CONFIG_NAME).write_text(self.config.to_yaml(), encoding="utf-8")
        else:
            self.config.save_pretrained(folder, location=final)
        heatmap = None
        if self.report is not None and self.report.computed:
            self.report.save(folder)
            from .plots import draw_heatmap

            heatmap = draw_heatmap(self.report, folder)
        build_model_card(self, heatmap=heatmap).save(folder / "README.md")

    def _save_processor(self, folder: Path) -> None:
        """Copy the base's processor beside the weights: with its tokenizer when the output is a whole model (a
        CLIPModel needs both for zero-shot classification), else the image processor (or the one given)."""
        if self.tokenizer is not None:  # a merged vocabulary: its tokenizer numbers the rows of the weights
            self.tokenizer.save_pretrained(folder)
            return
        source = self.config.processor
        if source is not None and not isinstance(source, (str, os.PathLike)):
            source.save_pretrained(folder)
            return
        where = os.fspath(source) if source is not None else self.base.path
        if getattr(self.adapter, "modality", "image") == "text":  # a text family: the base's tokenizer
            self._save_tokenizer(where or "the loaded base model", folder)
            return
        if not where or not Path(where).is_dir():
            self._warn_no_processor(where or "the loaded base model")
            return
        from .spill import describe

        whole = not isinstance(describe(self), self.adapter.model_class)
        try:
            self.adapter.load_processor(where, full=whole).save_pretrained(folder)
        except (OSError, ValueError, TypeError):
            try:
                self.adapter.load_processor(where).save_pretrained(folder)
            except (OSError, ValueError):  # the base has no preprocessor config
                self._warn_no_processor(where)

    @staticmethod
    def _save_tokenizer(where: str, folder: Path) -> None:
        import warnings

        from transformers import AutoTokenizer

        try:
            AutoTokenizer.from_pretrained(where, trust_remote_code=False).save_pretrained(folder)
        except (OSError, ValueError, TypeError, KeyError):
            warnings.warn(f"The merged folder has no tokenizer: none could be loaded from {where!r}. Save the "
                          "base's tokenizer into the folder.", UserWarning, stacklevel=4)

    @staticmethod
    def _warn_no_processor(where: str) -> None:
        import warnings

        warnings.warn(f"The merged folder has no image processor: {where!r} has no preprocessor_config.json, so "
                      "users of the merge cannot preprocess images with AutoImageProcessor.from_pretrained on it. "
                      "Merge with processor='<the base's Hub id or a folder with one>' (YAML: `processor: ...`), or "
                      "save one into the folder.", UserWarning, stacklevel=4)

    def input_paths(self) -> list[str]:
        """Local paths this merge read: models, base, processor, data, selection heads and shares (the output must
        not overlap them)."""
        paths = [r.path for r in [self.base, *self.models] if r.path and r.repo_id is None and Path(r.path).exists()]
        return [*paths, *self.config.input_paths()]

    def output_bytes(self, into: Path | None = None) -> int:
        """Approximate size of the saved weights (the new space they take in folder ``into``: none for weights
        already spilled on its file system, which are linked)."""
        if self.lora is not None:
            return self.lora.nbytes()
        if self.spilled is not None:
            return self.spilled.bytes_to_save(into)
        return sum(math.prod(t.shape) * t.element_size() for t in self.model.state_dict().values())

    def __repr__(self) -> str:
        return (f"MergeResult(method={self.method!r}, base={self.base.name!r}, models={[m.name for m in self.models]}, "
                f"params={self.config.parameters})")


def _get_model(self: MergeResult) -> PreTrainedModel:
    model = self.__dict__.get("_model")
    if model is None and self.__dict__.get("model_loader") is not None:
        model = self.__dict__["_model"] = self.model_loader()
        self.model_loader = None
    return model


def _set_model(self: MergeResult, value: PreTrainedModel | None) -> None:
    self.__dict__["_model"] = value


MergeResult.model = property(_get_model, _set_model, doc="The merged model (built on first access for an adapter "
                             "output written from its factors).")  # type: ignore[assignment]


__all__ = ["MERGE_CONFIG_NAME", "MergeResult"]
