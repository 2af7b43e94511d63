"""Upload a merged-model folder to the Hub in ONE commit (weights, config, card and M-Loss report together).

Only the files the save wrote are uploaded: the folder's ``hf_mloss_files.json`` is the allow-list, every file is
checked to be a regular file inside the folder (never a symbolic link) with the size the save recorded, so hidden
files, ``.git/``, secrets or anything added afterwards never leave the machine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import InvalidParameterError, PushError
from ..loading.hub import redact as _redact
from ..saving import MANIFEST_NAME, read_manifest


def check_repo_id(repo_id: Any) -> str:
    """Refuse a malformed Hub repo id before anything is written or uploaded."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except (HFValidationError, TypeError) as err:
        raise InvalidParameterError(f"{str(repo_id)[:100]!r} is not a valid Hub repo id (expected org/name or name): "
                                    f"{' '.join(str(err).split())[:200]}") from None
    return repo_id


def files_to_push(folder: Path) -> list[Path]:
    """The files of a saved merge, from its manifest, each checked (see the module docstring)."""
    try:
        listed = read_manifest(folder)
    except FileNotFoundError:
        raise PushError(f"{str(folder)!r} has no {MANIFEST_NAME}: it was not written by hf_mloss save_pretrained / "
                        "hf-mloss merge, so hf_mloss does not know which of its files to upload.") from None
    except (ValueError, KeyError, TypeError) as err:
        raise PushError(f"{str(folder / MANIFEST_NAME)!r} is malformed ({err}); save the merge again.") from None
    root = folder.resolve()
    files = []
    for name, size in listed.items():
        path = folder / name
        if path.is_symlink() or not path.is_file() or not path.resolve().is_relative_to(root) or \
                any(part.startswith(".") for part in Path(name).parts):
            raise PushError(f"{name!r} in {str(folder)!r} is not a regular file inside the folder (a symbolic link, a "
                            "hidden or missing file); refusing to upload. Save the merge again.")
        if path.suffix == ".safetensors" and path.stat().st_size != size:  # the card may be edited, weights not
            raise PushError(f"{name!r} in {str(folder)!r} changed after the merge was saved ({path.stat().st_size} "
                            f"bytes, {size} when saved); save the merge again.")
        files.append(path)
    files.append(folder / MANIFEST_NAME)
    described = (folder / "config.json").is_file() or (folder / "adapter_config.json").is_file()  # a model, an adapter
    if not any(p.suffix == ".safetensors" for p in files) or not described:
        raise PushError(f"{str(folder)!r} has no safetensors weights or no config.json (adapter_config.json for a "
                        "merged adapter): it is not a saved merge.")
    return files


def push_folder(
    folder: str | os.PathLike[str],
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
    keep_hint: bool = True,
) -> Any:
    """Create ``repo_id`` if needed and commit the saved merge in ``folder`` in one commit; returns the ``CommitInfo``.

    The model card's YAML is checked before anything is uploaded. The token is only passed to ``HfApi``; it never
    reaches a file, a log line or an error message (errors are re-raised without the underlying exception chain,
    whose HTTP details could echo it). On failure the local folder is left untouched.
    """
    from huggingface_hub import CommitOperationAdd, HfApi, ModelCard

    check_repo_id(repo_id)
    folder = Path(folder)
    if not folder.is_dir():
        raise PushError(f"Cannot push {str(folder)!r}: it is not a folder. Save the merge first (save_pretrained).")
    files = files_to_push(folder)
    readme = folder / "README.md"
    if readme.exists():
        try:
            ModelCard.load(readme, ignore_metadata_errors=False)
        except Exception as err:  # noqa: BLE001 - any parse failure means: do not upload
            raise PushError(f"The model card {readme} has invalid YAML metadata ({_redact(str(err), token)[:200]}); fix "
                            "it before pushing.") from None
    retry = (f" The local folder {str(folder)!r} is intact; retry with: hf-mloss push {folder} {repo_id}"
             if keep_hint else " Nothing was kept locally; save with save_pretrained(..., push_to_hub=True) to keep a "
             "copy to retry from.")
    api = HfApi(token=token)
    try:
        repo = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        operations = [CommitOperationAdd(path_in_repo=p.relative_to(folder).as_posix(), path_or_fileobj=str(p))
                      for p in files]
        return api.create_commit(repo.repo_id, operations=operations,
                                 commit_message=commit_message or "Upload merged model (hf_mloss)",
                                 revision=revision, create_pr=create_pr)
    except Exception as err:  # noqa: BLE001 - report every failure the same way, with the retry hint
        raise PushError(f"Pushing to {repo_id!r} failed: {_describe(err, token)}.{retry}") from None


def _describe(err: Exception, token: str | bool | None) -> str:
    """A short, secret-free description of a Hub failure (status code and server message, no request headers)."""
    response = getattr(err, "response", None)
    status = getattr(response, "status_code", None)
    if status is None:
        return _redact(f"{type(err).__name__}: {' '.join(str(err).split())}", token)[:400]
    kind = {401: "not authenticated (log in with `hf auth login` or set HF_TOKEN)",
            403: "permission denied for this repo or token",
            404: "not found"}.get(status, "server error" if status >= 500 else "request refused")
    server = getattr(err, "server_message", None) or " ".join(str(err).split()).split(" for url ")[0]
    return _redact(f"HTTP {status} ({kind}): {' '.join(str(server).split())}", token)[:400]
