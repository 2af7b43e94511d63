"""``MergeResult``: the merged model plus everything needed to publish and reproduce it."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from transformers import PreTrainedModel

from .errors import OutputExistsError
from .hub import ModelRef
from .report import MLossReport

if TYPE_CHECKING:
    from .adapters import ModelAdapter

MERGE_CONFIG_NAME = "hf_mloss_config.yaml"


@dataclass
class MergeResult:
    """Result of :func:`hf_mloss.merge`.

    Attributes:
        model: the merged model, same class and config as the base, in ``eval()`` mode.
        report: the M-Loss the merge used (data-guided methods), else ``None``.
        eval_results: optional evaluation results (``{task: accuracy}``) recorded in the model card.
    """

    model: PreTrainedModel
    method: str
    params: dict[str, Any]
    base: ModelRef
    models: list[ModelRef]
    weights: list[float]
    seed: int
    report: MLossReport | None
    data: dict[str, Any] | None
    adapter: ModelAdapter
    dtype: str
    method_description: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    """Run options that affect a data-guided result (batch size, scoring compute dtype)."""
    eval_results: dict[str, float] = field(default_factory=dict)

    def merge_config(self) -> dict[str, Any]:
        """The configuration that reproduces this merge (the same schema ``hf-mloss merge CONFIG`` reads)."""
        from . import __version__

        def model_entry(ref: ModelRef, weight: float | None = None) -> dict[str, Any]:
            entry: dict[str, Any] = {"model": ref.repo_id or ref.name}
            if ref.revision:
                entry["revision"] = ref.revision
            if weight is not None:
                entry["weight"] = weight
            return entry

        params = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.params.items()}
        config: dict[str, Any] = {
            "hf_mloss_version": __version__,
            "base": model_entry(self.base),
            "models": [model_entry(r, w) for r, w in zip(self.models, self.weights)],
            "method": self.method,
            "parameters": params,
            "seed": self.seed,
            "dtype": self.dtype,
        }
        config.update(self.options)
        if self.data:
            config["data"] = dict(self.data)
        return config

    def save_pretrained(
        self,
        save_directory: str | os.PathLike[str],
        *,
        max_shard_size: int | str = "5GB",
        overwrite: bool = False,
        push_to_hub: bool = False,
        repo_id: str | None = None,
        **push_kwargs: Any,
    ) -> Path:
        """Write a Hub-ready folder: safetensors (+ index), config, image processor config, model card, merge config
        and M-Loss report.

        The folder is written next to its final place and renamed into it, so it appears complete or not at all.
        An existing non-empty folder is refused unless ``overwrite=True``, and then replaced only once the new one
        is complete. With ``push_to_hub=True`` the folder is then uploaded to ``repo_id`` (default: the folder name)
        in one commit.
        """
        target = Path(save_directory)
        if target.exists() and (not target.is_dir() or any(target.iterdir())) and not overwrite:
            raise OutputExistsError(
                f"Output folder {str(target)!r} already exists and is not empty; pass overwrite=True "
                "(CLI: --overwrite) to replace it, or choose another folder."
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            self._write(tmp, max_shard_size=max_shard_size)
            _replace_dir(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if push_to_hub:
            from .hub_push import push_folder

            push_folder(target, repo_id or target.name, **push_kwargs)
        return target

    def _write(self, folder: Path, *, max_shard_size: int | str) -> None:
        from .card import build_model_card

        self.model.save_pretrained(folder, max_shard_size=max_shard_size)
        if self.base.path and Path(self.base.path).is_dir():
            try:
                self.adapter.load_processor(self.base.path).save_pretrained(folder)
            except OSError:  # the base has no preprocessor config: the card says so
                pass
        config = self.merge_config()
        (folder / MERGE_CONFIG_NAME).write_text(yaml.safe_dump(config, sort_keys=False))
        if self.report is not None:
            self.report.save(folder)
        build_model_card(self, folder).save(folder / "README.md")

    def push_to_hub(self, repo_id: str, *, private: bool | None = None, token: str | bool | None = None,
                    revision: str | None = None, create_pr: bool = False, commit_message: str | None = None,
                    max_shard_size: int | str = "5GB") -> Any:
        """Write the folder to a temporary directory and upload it to ``repo_id`` in ONE commit."""
        from .hub_push import push_folder

        tmp = Path(tempfile.mkdtemp(prefix="hf_mloss-push-"))
        folder = tmp / "merged"
        self._write_to(folder, max_shard_size)
        # On failure the written folder is kept (the error names it and how to retry); on success it is removed.
        info = push_folder(folder, repo_id, private=private, token=token, revision=revision, create_pr=create_pr,
                           commit_message=commit_message)
        shutil.rmtree(tmp, ignore_errors=True)
        return info

    def _write_to(self, folder: Path, max_shard_size) -> None:
        folder.mkdir(parents=True)
        self._write(folder, max_shard_size=max_shard_size)

    def __repr__(self) -> str:
        return (f"MergeResult(method={self.method!r}, base={self.base.name!r}, models={[m.name for m in self.models]}, "
                f"params={self.params})")


def _replace_dir(new: Path, target: Path) -> None:
    """Move the complete folder ``new`` to ``target``, replacing an existing one only after ``new`` is complete."""
    if not target.exists():
        os.replace(new, target)
        return
    backup = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    backup.rmdir()
    os.replace(target, backup)
    try:
        os.replace(new, target)
    except BaseException:
        os.replace(backup, target)
        raise
    shutil.rmtree(backup, ignore_errors=True)


def read_merge_config(folder: str | os.PathLike[str]) -> dict[str, Any]:
    return yaml.safe_load((Path(folder) / MERGE_CONFIG_NAME).read_text())


__all__ = ["MERGE_CONFIG_NAME", "MergeResult", "read_merge_config"]
