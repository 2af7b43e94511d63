"""Upload a merged-model folder to the Hub in ONE commit (weights, config, card and M-Loss report together)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .errors import PushError


def push_folder(
    folder: str | os.PathLike[str],
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
) -> Any:
    """Create ``repo_id`` if needed and commit every file of ``folder`` in one commit; returns the ``CommitInfo``.

    The model card's YAML is checked before anything is uploaded. The token is only passed to ``HfApi``; it never
    reaches a file, a log line or an error message. On failure the local folder is left untouched and the raised
    :class:`PushError` says how to retry.
    """
    from huggingface_hub import CommitOperationAdd, HfApi, ModelCard

    folder = Path(folder)
    if not folder.is_dir():
        raise PushError(f"Cannot push {str(folder)!r}: it is not a folder. Save the merge first (save_pretrained).")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    if not any(p.suffix == ".safetensors" for p in files) or not (folder / "config.json").exists():
        raise PushError(f"{str(folder)!r} has no safetensors weights or no config.json: it is not a saved merge.")
    readme = folder / "README.md"
    if readme.exists():
        try:
            ModelCard.load(readme, ignore_metadata_errors=False)
        except Exception as err:  # noqa: BLE001 - any parse failure means: do not upload
            raise PushError(f"The model card {readme} has invalid YAML metadata ({err}); fix it before pushing.") from err
    retry = f"The local folder {str(folder)!r} is intact; retry with: hf-mloss push {folder} {repo_id}"
    api = HfApi(token=token)
    try:
        repo = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        operations = [CommitOperationAdd(path_in_repo=p.relative_to(folder).as_posix(), path_or_fileobj=str(p))
                      for p in files]
        return api.create_commit(
            repo.repo_id,
            operations=operations,
            commit_message=commit_message or "Upload merged model (hf_mloss)",
            revision=revision,
            create_pr=create_pr,
        )
    except Exception as err:  # noqa: BLE001 - report every failure the same way, with the retry hint
        message = _redact(f"{type(err).__name__}: {err}", token)
        raise PushError(f"Pushing to {repo_id!r} failed: {message}. {retry}") from None


def _redact(text: str, token: str | bool | None) -> str:
    from huggingface_hub import get_token

    for secret in {t for t in (token if isinstance(token, str) else None, get_token()) if t}:
        text = text.replace(secret, "***")
    return text
