"""Resolve a model reference (local folder or Hub id) to a local folder, without touching the network needlessly.

A local path never triggers a network call. A Hub id goes through ``snapshot_download`` restricted to the files a
merge needs, so a cached snapshot works offline (``HF_HUB_OFFLINE=1``). Weights are looked for in the formats the Hub
holds, safetensors first:

1. safetensors at the requested revision;
2. safetensors on the safetensors-conversion bot's open pull request (``refs/pr/<n>``), found through the repo's
   discussions as transformers finds it (``safetensors_conversion.auto_conversion``, used by ``from_pretrained(...,
   use_safetensors=True)``), and used only when its ``.bin`` and JSON files are byte-identical to the requested
   revision's, so that its safetensors is a conversion of the same weights;
3. ``pytorch_model.bin``, read with the restricted unpickler (``torch.load(weights_only=True)``: it cannot run code).

The :class:`ModelRef` records which file and which commit the weights came from. Tokens are passed through, never
stored.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointNotFoundError, CorruptCheckpointError

logger = logging.getLogger(__name__)

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
PICKLE_INDEX = "pytorch_model.bin.index.json"
PICKLE_SINGLE = "pytorch_model.bin"
WEIGHT_PATTERNS = ["*.json", "*.safetensors"]
PICKLE_PATTERNS = ["*.json", "pytorch_model*.bin"]
WEIGHT_SUFFIXES = (".safetensors", ".bin")
CONVERSION_BOT = "SFconvertbot"
CONVERSION_PR_TITLE = "Adding `safetensors` variant of this model"
"""Author and title of the pull requests the Hub's safetensors-conversion bot opens (as transformers checks them)."""


@dataclass(frozen=True)
class ModelRef:
    """Where a model came from: its local folder and, for Hub models, the repo id and resolved commit.

    ``weights_file`` is the weights file read (``model.safetensors``, ``model.safetensors.index.json``,
    ``pytorch_model.bin``...), ``revision`` the commit it was read at, and ``weights_ref`` the pull-request ref
    (``refs/pr/<n>``) when the weights came from the safetensors-conversion bot's PR instead of the requested revision.
    """

    path: str
    repo_id: str | None = None
    revision: str | None = None
    weights_file: str | None = None
    weights_ref: str | None = None

    @property
    def name(self) -> str:
        """Hub id when known, else the folder name (used in reports; local absolute paths stay out of cards)."""
        return self.repo_id or (Path(self.path).name if self.path else "(in-memory model)")

    def to_dict(self) -> dict[str, str | None]:
        return {"repo_id": self.repo_id, "revision": self.revision, "name": self.name,
                "weights_file": self.weights_file, "weights_ref": self.weights_ref}


@dataclass(frozen=True)
class WeightFiles:
    """The weight files of a model folder: ``entry`` is the single file or the index, ``files`` what it lists."""

    entry: Path
    files: list[Path]

    @property
    def is_pickle(self) -> bool:
        return self.entry.name.startswith("pytorch_model")


def find_weights(folder: str | os.PathLike[str], *, allow_pickle: bool = True) -> WeightFiles | None:
    """The weights of a model folder, safetensors first (sharded or not), then ``pytorch_model.bin`` files."""
    folder = Path(folder)
    candidates = [(SAFETENSORS_INDEX, SAFETENSORS_SINGLE)]
    if allow_pickle:
        candidates.append((PICKLE_INDEX, PICKLE_SINGLE))
    for index_name, single_name in candidates:
        index = folder / index_name
        if index.exists():
            return WeightFiles(index, [folder / name for name in _index_shards(index)])
        if (folder / single_name).exists():
            return WeightFiles(folder / single_name, [folder / single_name])
    return None


def _index_shards(index: Path) -> list[str]:
    """The shard files a ``*.index.json`` names, each a plain file name inside the checkpoint folder.

    Raises:
        CorruptCheckpointError: the index is not JSON, has no ``weight_map`` of name -> file, or names a file outside
            the folder (``../``, an absolute path): shards are never read from anywhere else.
    """
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise TypeError("weight_map is not a non-empty mapping")
        shards = sorted(set(weight_map.values()))
        if not all(isinstance(name, str) and name for name in shards):
            raise TypeError("a shard file name is not a string")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        raise CorruptCheckpointError(
            f"Cannot parse {index.name} in {str(index.parent)!r}: {str(err)[:200]}. The index must hold a "
            "'weight_map' of tensor name -> shard file; download it again or re-save the model.") from None
    for name in shards:
        parts = Path(name).parts
        if Path(name).is_absolute() or ".." in parts or "\\" in name or name.startswith("~"):
            raise CorruptCheckpointError(
                f"{index.name} in {str(index.parent)!r} names the shard {name[:100]!r}, outside the checkpoint "
                "folder; hf_mloss reads shards only from the folder itself. Fix the index or re-save the model.")
    return shards


def resolve_model(
    ref: str | os.PathLike[str],
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | None = None,
    allow_pickle: bool = True,
) -> ModelRef:
    """Return a :class:`ModelRef` with a local folder holding ``config.json`` and the weights of ``ref``.

    Args:
        allow_pickle: also accept ``pytorch_model.bin`` weights (read with the restricted unpickler, which cannot run
            code); ``False`` accepts safetensors only.

    Raises:
        CheckpointNotFoundError: the local path does not exist, or the Hub id is not cached while offline,
            is unknown, or names an unknown revision. The messages differ so the user knows which.
        CorruptCheckpointError: the repo holds no weights in a format hf_mloss reads.
    """
    ref = os.fspath(ref)
    if problem := missing_model(ref, cache_dir=cache_dir):
        raise CheckpointNotFoundError(problem)
    path = expand(ref)
    if path.is_dir():
        weights = find_weights(path, allow_pickle=allow_pickle)
        return ModelRef(path=str(path.resolve()), weights_file=weights.entry.name if weights else None)
    if not _REPO_ID.match(ref):
        raise CheckpointNotFoundError(f"{ref!r} is neither a folder nor a Hub id ('org/name'). Check the path.")
    return _download(ref, revision=revision, token=token, cache_dir=cache_dir, allow_pickle=allow_pickle)


def missing_model(value: str, root: str | os.PathLike[str] | None = None, *, cache_dir=None) -> str | None:
    """Why ``value`` names no model, without asking the Hub; None when it is a folder or reads as a Hub id.

    A value reads as a local path when it is written as one (``./``, ``/``, ``~``), is not spelled like a Hub id, or
    is spelled ``org/name`` while ``org`` is a folder here (``tiny_models/nope`` beside ``tiny_models/``) and the Hub
    cache holds no ``org/name``: such a typo is named at once, not reported as a Hub model that cannot be downloaded.
    So is ``org/name`` when ``org`` is no folder here but a folder named like it holds a model folder named like
    ``name`` (``tiny_model/ft1`` beside ``tiny_models/ft1``): a typo in the parent folder, with a did-you-mean.
    ``root`` is the folder relative paths resolve against (a config file's; default: the working folder).
    """
    path = expand(value)
    full = path if path.is_absolute() or root is None else Path(root) / path
    shown = os.path.abspath(full)
    if full.is_dir():
        return None
    if full.exists():
        return (f"{value!r} is a file, not a model folder: hf_mloss expects a folder holding config.json and the "
                "weights, as save_pretrained writes it.")
    first, hub = (Path(value).parts or ("",))[0], ""
    if value.startswith((".", "/", "~", "\\")) or os.path.isabs(value):
        what, why = "a Hub id", "it is written as a local path"
    elif "/" in value.replace("/", "", 1) or not is_repo_id(value):
        what, why = "a Hub id", "it is not spelled like one ('name' or 'org/name'), so it reads as a local path"
    elif "/" in value and (Path(root or ".") / first).is_dir() and not hub_cached(value, cache_dir):
        where = "here" if root is None else f"in {os.path.abspath(root)}"
        what, why = "a cached Hub id", f"it reads as a local path ({first!r} is a folder {where})"
        hub = f" (a Hub model of that name is read once it is in the Hub cache: hf download {value})"
    elif "/" in value and not hub_cached(value, cache_dir) and (close := _close_parent(Path(root or "."), value)):
        where = "here" if root is None else f"in {os.path.abspath(root)}"
        return (f"{value!r} is neither a folder nor a cached Hub id: it reads as a mistyped local path ({first!r} "
                f"is not a folder {where}, {close!r} is). Did you mean {close!r}? Check the path (a Hub model of "
                f"that name is read once it is in the Hub cache: hf download {value}).")
    else:
        return None
    return (f"{value!r} is neither a folder nor {what}: {why}, and {shown} does not exist. "
            f"{_close_folder(full, value)}Check the path{hub}.")


def _close_parent(root: Path, value: str) -> str | None:
    """For ``org/name`` (a Hub id's spelling) whose ``org`` is no folder in ``root``: ``folder/name`` (or
    ``folder/close-name``) when ``root`` holds a folder named like ``org`` with a model folder (``config.json`` or
    ``adapter_config.json``) named like ``name`` in it (``tiny_models/ft1`` for ``tiny_model/ft1``), else None."""
    import difflib

    first, name = value.split("/", 1)
    try:
        folders = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    except OSError:
        return None
    for folder in difflib.get_close_matches(first, folders, n=3):
        try:
            inside = sorted(p.name for p in (root / folder).iterdir() if p.is_dir())
        except OSError:
            continue
        models = [n for n in inside if any((root / folder / n / f).is_file() for f in _MODEL_FILES)]
        match = [name] if name in models else difflib.get_close_matches(name, models, n=1)
        if match:
            return f"{folder}/{match[0]}"
    return None


_MODEL_FILES = ("config.json", "adapter_config.json")
"""What makes a folder a model's (a checkpoint's or a PEFT adapter's) for a did-you-mean across folders."""


def _close_folder(path: Path, value: str) -> str:
    """``Did you mean '<sibling>'? `` (spelled as ``value``) when the parent of ``path`` holds a folder with a close
    name, else ''."""
    import difflib

    try:
        siblings = sorted(p.name for p in path.parent.iterdir() if p.is_dir()) if path.parent.is_dir() else []
    except OSError:
        return ""
    match = difflib.get_close_matches(path.name, siblings, n=1)
    return f"Did you mean {os.path.join(os.path.dirname(value), match[0])!r}? " if match else ""


def hub_cached(repo_id: str, cache_dir: str | os.PathLike[str] | None = None) -> bool:
    """Whether the Hub cache holds a snapshot of the model repo ``repo_id`` (a look at the folder, no network)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    folder = Path(cache_dir or constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
    return (folder / "snapshots").is_dir()


def _download(repo_id: str, *, revision, token, cache_dir, allow_pickle: bool) -> ModelRef:
    from huggingface_hub import constants

    folder = _snapshot(repo_id, revision, WEIGHT_PATTERNS, token=token, cache_dir=cache_dir)
    if weights := find_weights(folder, allow_pickle=False):
        return _hub_ref(folder, repo_id, weights)
    if not constants.HF_HUB_OFFLINE:
        pr_ref = conversion_pr(repo_id, revision, token=token)
        if pr_ref is not None:
            pr_folder = _snapshot(repo_id, pr_ref, WEIGHT_PATTERNS, token=token, cache_dir=cache_dir)
            if weights := find_weights(pr_folder, allow_pickle=False):
                logger.info("%s has no safetensors at %s; using the safetensors conversion of the same weights "
                            "from %s", repo_id, revision or "main", pr_ref)
                return _hub_ref(pr_folder, repo_id, weights, weights_ref=pr_ref)
    if allow_pickle:
        try:
            folder = _snapshot(repo_id, revision, PICKLE_PATTERNS, token=token, cache_dir=cache_dir)
        except CheckpointNotFoundError:
            if not constants.HF_HUB_OFFLINE:
                raise
        else:
            if weights := find_weights(folder):
                return _hub_ref(folder, repo_id, weights)
    raise _no_weights_error(repo_id, revision, allow_pickle=allow_pickle, cache_dir=cache_dir)


def _no_weights_error(repo_id: str, revision: str | None, *, allow_pickle: bool, cache_dir) -> CorruptCheckpointError:
    from huggingface_hub import constants

    searched = f"{SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}" + (
        f", or {PICKLE_SINGLE} / {PICKLE_INDEX}" if allow_pickle else
        f" (allow_pickle=False: {PICKLE_SINGLE} files were not considered; allow_pickle=True reads them with the "
        "restricted unpickler, which cannot run code)")
    hint = " Pass a revision or a local folder that has PyTorch weights."
    if constants.HF_HUB_OFFLINE:
        cached = _cached_pull_requests(repo_id, cache_dir)
        hint = (" The Hub is offline, so the safetensors-conversion pull request cannot be looked up (nor checked to "
                "hold the same weights). Run once online, or pass the revision (commit sha) recorded in the "
                "hf_mloss_config.yaml of an earlier merge" +
                (f"; cached pull requests: {', '.join(f'{ref} = {sha}' for ref, sha in cached.items())}." if cached
                 else "."))
    return CorruptCheckpointError(
        f"No weights found for Hub model {repo_id!r} (revision {revision or 'main'}): expected {searched}. "
        f"TensorFlow (.h5) and Flax (.msgpack) weights are not read.{hint}"
    )


def _cached_pull_requests(repo_id: str, cache_dir) -> dict[str, str]:
    """``refs/pr/<n>`` -> commit sha of the pull requests of ``repo_id`` that the Hub cache holds a snapshot of."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    refs = Path(cache_dir or constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "refs"
    return {f"refs/pr/{ref.name}": ref.read_text().strip()
            for ref in sorted((refs / "refs" / "pr").glob("*")) if ref.is_file()}


def _hub_ref(folder: str, repo_id: str, weights: WeightFiles, weights_ref: str | None = None) -> ModelRef:
    return ModelRef(path=folder, repo_id=repo_id, revision=Path(folder).name, weights_file=weights.entry.name,
                    weights_ref=weights_ref)


def _snapshot(repo_id: str, revision: str | None, patterns: list[str], *, token, cache_dir) -> str:
    """``snapshot_download`` restricted to ``patterns``, with the Hub's errors turned into clear messages."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return snapshot_download(repo_id, revision=revision, token=token, cache_dir=cache_dir,
                                 allow_patterns=patterns)
    except GatedRepoError:
        raise CheckpointNotFoundError(
            f"Hub model {repo_id!r} is gated: accept its terms on the Hub and pass a token (or log in).") from None
    except RepositoryNotFoundError:
        raise CheckpointNotFoundError(
            f"Hub model {repo_id!r} was not found on the Hub (or it is private and no valid token was given).") \
            from None
    except RevisionNotFoundError:
        raise CheckpointNotFoundError(f"Revision {revision!r} of Hub model {repo_id!r} does not exist.") from None
    except LocalEntryNotFoundError as err:
        raise CheckpointNotFoundError(
            f"Hub model {repo_id!r} (revision {revision or 'main'}) is not in the local Hub cache and "
            f"{hub_failure(err, token)}; nor is it a local folder here. Download it once with network access, or "
            "pass a local folder instead.") from None
    except HfHubHTTPError as err:
        raise CheckpointNotFoundError(f"Cannot download Hub model {repo_id!r} (revision {revision or 'main'}): "
                                      f"{hub_failure(err, token)}.") from None
    except OSError as err:  # after the Hub's own errors (some subclass OSError)
        raise CheckpointNotFoundError(f"Cannot download Hub model {repo_id!r}: {cache_failure(err, cache_dir)}") \
            from None


def cache_failure(err: OSError, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """Why a download could not be stored, with the fix: a read-only or foreign Hugging Face cache (shared clusters)
    is named with ``HF_HOME`` / ``cache_dir=``."""
    import errno

    from huggingface_hub import constants

    where = os.fspath(cache_dir) if cache_dir else getattr(err, "filename", None) or constants.HF_HUB_CACHE
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (f"the Hugging Face cache is not writable ({where!r}: {err.strerror}). Set HF_HOME to a folder you can "
                "write (e.g. export HF_HOME=$HOME/.cache/huggingface), or pass cache_dir=... .")
    if err.errno == errno.ENOSPC:
        return f"the Hugging Face cache is full ({where!r}); free space or set HF_HOME to another disk."
    return f"{err.strerror or type(err).__name__} ({where!r})."


def hub_failure(err: BaseException, token: str | bool | None = None) -> str:
    """Why a Hub call failed, in a few words, secret-free: the HTTP status and server message when the Hub answered,
    else that it could not be reached (the exception chain is searched; it is never re-raised)."""
    seen = err
    while seen is not None:
        response = getattr(seen, "response", None)
        status = getattr(response, "status_code", None)
        if status is not None:
            server = getattr(seen, "server_message", None) or str(seen).split("\n")[0]
            kind = {400: "refused the request", 401: "did not accept the credentials", 403: "denied access",
                    429: "is rate-limiting requests"}.get(status, "failed" if status >= 500 else "refused the request")
            return redact(f"the Hub {kind} (HTTP {status}: {' '.join(str(server).split())[:200]})", token)
        seen = seen.__cause__ or seen.__context__
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "offline mode is on (HF_HUB_OFFLINE=1)"
    return "the Hub cannot be reached (no network or a proxy/endpoint problem)"


def redact(text: str, token: str | bool | None = None) -> str:
    """``text`` without any token hf_mloss can know of (the argument, HF_TOKEN, the saved login) or bearer value."""
    from huggingface_hub import get_token

    from ..errors import redact as redact_shapes

    secrets = {t for t in (token if isinstance(token, str) else None, get_token(), os.environ.get("HF_TOKEN")) if t}
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, "***")
    return redact_shapes(text)


def conversion_pr(repo_id: str, revision: str | None = None, *, token: str | bool | None = None) -> str | None:
    """The ref (``refs/pr/<n>``) of the safetensors-conversion bot's open pull request that converts the ``.bin``
    weights of ``revision``, or None.

    transformers (``safetensors_conversion.previous_pr``) lists the repo's discussions, keeps the open pull request
    titled :data:`CONVERSION_PR_TITLE` by :data:`CONVERSION_BOT`, and accepts it when its parent commit is the head
    of ``main``. This accepts it when every ``.bin`` and JSON file of ``revision`` is byte-identical on the PR (same
    git blob), which also holds after unrelated commits on ``main`` (a README edit). Network errors mean "no PR".
    """
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        wanted = _blobs(api, repo_id, revision)
        if not any(fnmatch.fnmatch(path, "pytorch_model*.bin") for path in wanted):
            return None
        for discussion in api.get_repo_discussions(repo_id, author=CONVERSION_BOT, discussion_type="pull_request",
                                                   discussion_status="open", token=token):
            if discussion.title != CONVERSION_PR_TITLE or discussion.author != CONVERSION_BOT:
                continue
            offered = _blobs(api, repo_id, discussion.git_reference)
            if all(offered.get(path) == blob for path, blob in wanted.items()):
                return discussion.git_reference
            logger.info("%s: %s by %s does not convert the weights of %s (files differ); not used", repo_id,
                        discussion.git_reference, CONVERSION_BOT, revision or "main")
    except _network_errors() as err:
        logger.info("%s: cannot look up a safetensors conversion PR (%s); falling back to .bin", repo_id,
                    type(err).__name__)
    return None


def _blobs(api, repo_id: str, revision: str | None) -> dict[str, str]:
    """Git blob id of every ``.bin`` and JSON file at ``revision``."""
    info = api.model_info(repo_id, revision=revision, files_metadata=True)
    return {s.rfilename: s.blob_id for s in info.siblings or []
            if any(fnmatch.fnmatch(s.rfilename, p) for p in PICKLE_PATTERNS)}


def _network_errors() -> tuple[type[BaseException], ...]:
    """HTTP and connection errors of the client huggingface_hub uses (httpx, or httpx2 from huggingface_hub 2.x)."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        from huggingface_hub.utils import httpx
    except ImportError:
        return (HfHubHTTPError, OSError)
    return (HfHubHTTPError, OSError, httpx.HTTPError)


def download_file(repo_id: str, filename: str, *, revision: str | None = None, token: str | bool | None = None) -> str:
    """Local path of one file of a Hub model repo (cached; works offline once cached).

    Raises:
        CheckpointNotFoundError: the repo, revision or file does not exist, or it is not cached while offline.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    try:
        return hf_hub_download(repo_id, filename, revision=revision, token=token)
    except LocalEntryNotFoundError as err:
        raise CheckpointNotFoundError(f"{filename} of Hub repo {repo_id!r} is not in the local cache and "
                                      f"{hub_failure(err, token)}.") from None
    except EntryNotFoundError:
        raise CheckpointNotFoundError(f"Hub repo {repo_id!r} has no {filename}: it was not written by hf_mloss.") from None
    except (HfHubHTTPError, ValueError) as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        raise CheckpointNotFoundError(f"Cannot download {filename} of Hub repo {repo_id!r}"
                                      + (f" (HTTP {status})" if status else "") + ".") from None
    except OSError as err:
        raise CheckpointNotFoundError(f"Cannot download {filename} of Hub repo {repo_id!r}: {cache_failure(err)}") \
            from None


# ------------------------------------------------------------------------------------------ references
def looks_local(value: str) -> bool:
    """Whether ``value`` names a local path rather than a Hub id (explicit path syntax, or it exists)."""
    if value.startswith((".", "/", "~")) or os.path.isabs(value) or "/" in value.replace("/", "", 1):
        return True
    return expand(value).exists() or not is_repo_id(value)


def is_repo_id(value: str) -> bool:
    """Whether ``value`` is spelled like a Hub repo id (``name`` or ``org/name``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def expand(value: str) -> Path:
    """``Path(value).expanduser()``, or the path as written when ``~user`` names no known home."""
    try:
        return Path(value).expanduser()
    except RuntimeError:
        return Path(value)


def fingerprint_folder(folder: str | os.PathLike[str]) -> str:
    """A content fingerprint of a model folder's weights and config (xxh3-128 over the files, in name order).

    Reads every byte once, in 16 MB chunks into one buffer (a mapped file would count in the process's resident
    memory). A folder fingerprinted earlier in the process is not read again while its files keep their inode, size
    and modification and change times.
    """
    return _fingerprint_files(folder_signature(folder))


Signature = tuple[tuple[str, int, int, int, int], ...]
"""The files a fingerprint covers, in order: path, inode, size, modification and change times."""


def folder_signature(folder: str | os.PathLike[str]) -> Signature:
    """The :data:`Signature` of a model folder: its weights, config and index files, in name order."""
    root = Path(folder)
    configs = ("config.json", "adapter_config.json")  # a PEFT adapter folder: its config and adapter weights
    files = sorted(p for p in root.iterdir() if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name in configs
                                                                  or p.name.endswith(".index.json")))
    return tuple((str(p), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) for p in files for st in [p.stat()])


_HASH_CHUNK = 1 << 24
_FINGERPRINTS: dict[tuple[Signature, str | None], str] = {}
"""Fingerprints computed in this process, by signature: files unchanged since are not hashed again."""
_CACHED = 64
_CACHE_LOCK = threading.Lock()


def _fingerprint_files(signature: Signature, root: str | None = None) -> str:
    """The fingerprint of the files of ``signature``, each named by its file name (``root``: by its path below it)."""
    cached = _FINGERPRINTS.get((signature, root))
    if cached is not None:
        return cached
    hasher = _FilesHash(signature, root)
    while hasher.step():
        pass
    return hasher.value


class _FilesHash:
    """xxh3-128 over a signature's files (each file's name, then its bytes), read one chunk per :meth:`step`."""

    def __init__(self, signature: Signature, root: str | None = None) -> None:
        import xxhash

        self.key, self.root = (signature, root), root
        self.paths = [Path(entry[0]) for entry in signature]
        self.digest, self.handle, self.value = xxhash.xxh3_128(), None, None
        self.buffer = bytearray(_HASH_CHUNK)

    def step(self) -> int:
        """Hash the next chunk; returns the bytes read (0 once the value is known, in :attr:`value`)."""
        while True:
            if self.handle is None:
                if not self.paths:
                    if self.value is None:
                        self.value = f"xxh3-128:{self.digest.hexdigest()}"
                        with _CACHE_LOCK:
                            if len(_FINGERPRINTS) >= _CACHED:
                                _FINGERPRINTS.pop(next(iter(_FINGERPRINTS)))
                            _FINGERPRINTS[self.key] = self.value
                    return 0
                path = self.paths.pop(0)
                name = path.relative_to(self.root).as_posix() if self.root is not None else path.name
                self.digest.update(name.encode() + b"\0")
                self.handle = path.open("rb", buffering=0)  # chunked reads: the file never counts in the RSS
            read = self.handle.readinto(self.buffer)
            if read:
                self.digest.update(memoryview(self.buffer)[:read])
                return read
            self.close()

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


class FolderFingerprints(Mapping[int, str]):
    """The fingerprints of a run's local inputs by input index, hashed on a background thread beside the run.

    A merge reads every byte of its inputs once; hashing them in a pass before it read them all a second time (at
    Llama-2-7B's shape with q = 2, 40 GB, more than the page cache holds). The thread hashes the folders side by side,
    a chunk of each in turn, at most ``ahead`` bytes past what the run has read (``progress()``): the run then reads
    the pages the hash just brought in, and the disk serves each byte once. The values are needed only when the
    recipe is written: reading one lifts the pacing, waits for the thread and raises its error, if any. ``known``
    values (fingerprints already verified) are returned as they are. :meth:`close` stops the thread.
    """

    def __init__(self, known: Mapping[int, str] | None = None,
                 pending: Mapping[int, str | os.PathLike[str]] | None = None, *,
                 progress: Callable[[], int] | None = None, ahead: int = 4 << 30) -> None:
        self._values = dict(known or {})
        self._pending = dict(pending or {})
        self._progress, self._ahead = progress, ahead
        self._error: BaseException | None = None
        self._stop, self._unpaced = threading.Event(), threading.Event()
        self._thread = None
        if self._pending:
            self._thread = threading.Thread(target=self._hash, name="hf_mloss_fingerprints", daemon=True)
            self._thread.start()

    def _hash(self) -> None:
        hashers = {}
        try:
            for index, folder in self._pending.items():
                signature = folder_signature(folder)
                if (cached := _FINGERPRINTS.get((signature, None))) is not None:
                    self._values[index] = cached
                else:
                    hashers[index] = _FilesHash(signature)
            done = 0
            while hashers and not self._stop.is_set():
                for index, hasher in list(hashers.items()):
                    read = hasher.step()
                    done += read
                    if not read:
                        self._values[index] = hasher.value
                        del hashers[index]
                while (self._progress is not None and not self._unpaced.is_set() and not self._stop.is_set()
                       and done > self._progress() + self._ahead):
                    self._unpaced.wait(0.05)  # the run catches up
        except BaseException as err:  # raised where a value is read, in the caller's thread
            self._error = err
        finally:
            for hasher in hashers.values():
                hasher.close()

    def _wait(self) -> dict[int, str]:
        self._unpaced.set()
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        if any(index not in self._values for index in self._pending):  # stopped by close()
            raise RuntimeError("The inputs' fingerprints were not computed: their run has ended.")
        return self._values

    def __getitem__(self, index: int) -> str:
        return self._wait()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._wait())

    def __len__(self) -> int:
        return len(self._wait())

    def close(self) -> None:
        """Stop hashing (the run ended) and wait for the thread to leave its current chunk."""
        self._stop.set()
        self._unpaced.set()
        if self._thread is not None:
            self._thread.join()


def fingerprint_data(path: str | os.PathLike[str]) -> str:
    """A content fingerprint of local data: a file, or every file of a folder (hidden ones left out) by its path
    relative to the folder, in name order (xxh3-128 over names and bytes, as :func:`fingerprint_folder`)."""
    root = Path(path).expanduser()
    if root.is_file():
        files = [root]
    else:
        files = sorted(p for p in root.rglob("*") if p.is_file() and not any(
            part.startswith(".") for part in p.relative_to(root).parts))
    signature = tuple((str(p), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                      for p in files for st in [p.stat()])
    return _fingerprint_files(signature, str(root) if root.is_dir() else None)


def dataset_commit(repo_id: str, revision: str | None = None, *, token: str | bool | None = None) -> str:
    """The commit a Hub dataset's ``revision`` (a branch, tag or commit; default its main branch) points to now, so a
    recipe records the data it read.

    Raises:
        DataError: the Hub cannot say (offline, unknown dataset or revision), secret-free.
    """
    if revision is not None and len(revision) == 40 and all(c in "0123456789abcdef" for c in revision):
        return revision  # already a commit
    from huggingface_hub import HfApi

    from ..errors import DataError

    try:
        info = HfApi().dataset_info(repo_id, revision=revision, token=token)
    except (*_network_errors(), OSError, ValueError) as err:
        at = f" at revision {revision!r}" if revision else ""
        raise DataError(f"Cannot resolve the Hub dataset {repo_id!r}{at} to a commit: {hub_failure(err, token)}. "
                        "Check the id, or pass a local folder (it works offline).") from None
    return str(info.sha)
