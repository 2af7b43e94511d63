"""Resolve a model reference (local folder or Hub id) to a local folder, without touching the network needlessly.

A local path never triggers a network call. A Hub id goes through ``snapshot_download`` restricted to the files a
merge needs, so a cached snapshot works offline (``HF_HUB_OFFLINE=1``). Tokens are passed through, never stored.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointNotFoundError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
WEIGHT_PATTERNS = ["*.json", "*.safetensors"]
PICKLE_PATTERNS = ["*.bin", "*.bin.index.json"]


@dataclass(frozen=True)
class ModelRef:
    """Where a model came from: its local folder and, for Hub models, the repo id and resolved commit."""

    path: str
    repo_id: str | None = None
    revision: str | None = None

    @property
    def name(self) -> str:
        """Hub id when known, else the folder name (used in reports; local absolute paths stay out of cards)."""
        return self.repo_id or (Path(self.path).name if self.path else "(in-memory model)")

    def to_dict(self) -> dict[str, str | None]:
        return {"repo_id": self.repo_id, "revision": self.revision, "name": self.name}


def is_hub_id(ref: str) -> bool:
    """Whether ``ref`` reads as a Hub repo id (``org/name``) and is not an existing local path."""
    return bool(ref) and bool(_REPO_ID.match(ref)) and not Path(ref).expanduser().exists()


def resolve_model(
    ref: str | os.PathLike[str],
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | None = None,
    allow_pickle: bool = False,
) -> ModelRef:
    """Return a :class:`ModelRef` with a local folder holding ``config.json`` and the weights of ``ref``.

    Raises:
        CheckpointNotFoundError: the local path does not exist, or the Hub id is not cached while offline,
            is unknown, or names an unknown revision. The messages differ so the user knows which.
    """
    ref = os.fspath(ref)
    path = Path(ref).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointNotFoundError(
                f"{ref!r} is a file; hf_mloss expects a model folder holding config.json and the weights "
                "(as written by save_pretrained)."
            )
        return ModelRef(path=str(path.resolve()))
    if ref.startswith((".", "/", "~")) or not _REPO_ID.match(ref):
        raise CheckpointNotFoundError(
            f"Local path {ref!r} does not exist (and it is not a valid Hub repo id such as 'org/name'). "
            "Check the path."
        )
    return _download(ref, revision=revision, token=token, cache_dir=cache_dir, allow_pickle=allow_pickle)


def _download(repo_id: str, *, revision, token, cache_dir, allow_pickle) -> ModelRef:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    patterns = WEIGHT_PATTERNS + (PICKLE_PATTERNS if allow_pickle else [])
    try:
        folder = snapshot_download(
            repo_id, revision=revision, token=token, cache_dir=cache_dir, allow_patterns=patterns
        )
    except LocalEntryNotFoundError as err:
        raise CheckpointNotFoundError(
            f"Hub model {repo_id!r} (revision {revision or 'main'}) is not in the local Hub cache and the Hub "
            "cannot be reached (offline mode or no network). Download it once with network access, "
            "or pass a local folder instead."
        ) from err
    except GatedRepoError as err:
        raise CheckpointNotFoundError(
            f"Hub model {repo_id!r} is gated: accept its terms on the Hub and pass a token (or log in)."
        ) from err
    except RepositoryNotFoundError as err:
        raise CheckpointNotFoundError(
            f"Hub model {repo_id!r} was not found on the Hub (or it is private and no valid token was given)."
        ) from err
    except RevisionNotFoundError as err:
        raise CheckpointNotFoundError(f"Revision {revision!r} of Hub model {repo_id!r} does not exist.") from err
    return ModelRef(path=folder, repo_id=repo_id, revision=Path(folder).name)


def download_file(repo_id: str, filename: str, *, revision: str | None = None, token: str | bool | None = None) -> str:
    """Local path of one file of a Hub model repo (cached; works offline once cached).

    Raises:
        CheckpointNotFoundError: the repo, revision or file does not exist, or it is not cached while offline.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    try:
        return hf_hub_download(repo_id, filename, revision=revision, token=token)
    except LocalEntryNotFoundError:
        raise CheckpointNotFoundError(f"{filename} of Hub repo {repo_id!r} is not in the local cache and the Hub "
                                      "cannot be reached.") from None
    except EntryNotFoundError:
        raise CheckpointNotFoundError(f"Hub repo {repo_id!r} has no {filename}: it was not written by hf_mloss.") from None
    except (HfHubHTTPError, ValueError) as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        raise CheckpointNotFoundError(f"Cannot download {filename} of Hub repo {repo_id!r}"
                                      + (f" (HTTP {status})" if status else "") + ".") from None
