"""A loopback fake of the Hugging Face Hub: the routes that huggingface_hub (downloads, repo info, refs, commits,
discussions, pushes), transformers (``from_pretrained``, the safetensors-conversion PR lookup) and datasets
(``load_dataset(..., streaming=True)`` on parquet, through ``HfFileSystem``) use, for offline tests.

```python
from fake_hub import FakeHub

with FakeHub() as hub, hub.as_endpoint(monkeypatch):      # HfApi() / snapshot_download / push_to_hub use the fake
    hub.add_repo("org/model", {"config.json": b"{}", "model.safetensors": data})
    hub.open_pr("org/model", {"model.safetensors": other}, title="...", author="SFconvertbot")   # refs/pr/1
    HfApi(token="hf_x").upload_folder(repo_id="me/m", folder_path="merged")
assert hub.commits[0].files.keys() == {...}
```

or, in a test module, the ``fake_hub`` fixture (``from fake_hub import fake_hub``), which starts a fake, points
``huggingface_hub`` (and ``datasets``) at it for the test, and stops it afterwards.

Every repo is a small git-like store: commits (full file trees, a parent each), branches (``main``), pull-request
refs (``refs/pr/N``) and discussions. Revisions resolve from a branch, a ``refs/pr/N`` ref or a 40-hex commit oid.
Pushed commits are applied to the store, so what was pushed can be downloaded again.

Routes (``{type}`` is ``models``, ``datasets`` or ``spaces``; ``{rev}`` is URL-quoted, ``refs%2Fpr%2F1``), with
the clients that use them:

* ``GET /api/{type}s/{repo}[/revision/{rev}]`` (``blobs=1``): ``repo_info`` / ``model_info`` / ``dataset_info``,
  ``snapshot_download``, datasets. Reply: ``id``, ``sha``, ``private``, ``siblings`` (+ ``size``, ``blobId``,
  ``lfs`` with ``blobs``).
* ``GET /api/{type}s/{repo}/tree/{rev}[/{path}]`` (``recursive``, ``expand``): ``list_repo_tree``,
  ``snapshot_download``, ``HfFileSystem``. Reply: ``[{type, path, oid, size, lfs?}]``, one page.
* ``POST /api/{type}s/{repo}/paths-info/{rev}``: ``get_paths_info``, ``HfFileSystem.info``. Same entries.
* ``GET /api/{type}s/{repo}/refs`` (``include_prs``): ``list_repo_refs``. ``branches``, ``tags``, ``converts``,
  ``pullRequests``.
* ``GET /api/{type}s/{repo}/commits/{rev}``: ``list_repo_commits`` (transformers' conversion-PR check). Newest first.
* ``GET /api/{type}s/{repo}/discussions`` (``type``, ``status``, ``author``, ``p``): ``get_repo_discussions``
  (transformers' conversion-PR lookup). ``{discussions, count, start}``.
* ``GET /api/{type}s/{repo}/discussions/{num}``: ``get_discussion_details``.
* ``POST /api/{type}s/{repo}/discussions``: ``create_pull_request`` (``upload_folder(create_pr=True)``): a new PR on
  ``refs/pr/N``.
* ``HEAD/GET /[{type}s/]{repo}/resolve/{rev}/{path}`` (``Range``): ``hf_hub_download``, ``file_exists``,
  ``HfFileSystem`` reads. The bytes, ``X-Repo-Commit``, ``ETag``, ``Content-Length``; 206 for a range.
* ``POST /api/repos/create``: ``create_repo``. ``{"url": ..., "name": repo_id}``.
* ``POST /api/validate-yaml``: ``ModelCard.validate``, ``create_commit`` of a README. ``{"errors": [], ...}``, or
  400 after ``hub.reject_yaml([...])``.
* ``POST /api/{type}s/{repo}/preupload/{rev}``: ``create_commit``. Every file ``uploadMode: "regular"`` (inline; no
  LFS/Xet routes).
* ``POST /api/{type}s/{repo}/commit/{rev}``: ``create_commit``. ``{"commitUrl", "commitOid", "pullRequestUrl"}``, or
  500 after ``hub.fail_commits()``.

Errors use the Hub's ``X-Error-Code`` header (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``), which
huggingface_hub turns into its typed errors. Anything else answers 404 and is recorded with route ``unknown``.

The wire format is huggingface_hub's private one (checked against 2.4): pin a version range in the test extra.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import json
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

_API_ROUTE = re.compile(r"^/api/(?P<type>models|datasets|spaces)/(?P<repo>[^/]+/[^/]+)(?:/(?P<rest>.*))?$")
_RESOLVE_ROUTE = re.compile(r"^/(?:(?P<type>datasets|spaces)/)?(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/"
                            r"(?P<path>.+)$")
_OID = re.compile(r"^[0-9a-f]{40}$")
_LFS_SUFFIXES = (".bin", ".safetensors", ".msgpack", ".h5", ".parquet", ".arrow", ".pt", ".pth", ".ckpt", ".onnx",
                 ".zip", ".gz", ".tar")
_DATE = "2024-01-01T00:00:{:02d}.000Z"


@dataclass
class Request:
    """One HTTP request the fake received (headers as sent, lower-cased names)."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes
    route: str
    """``create``, ``validate-yaml``, ``preupload``, ``commit``, ``discussion`` (open / details), ``discussions``
    (listing), ``info``, ``tree``, ``paths-info``, ``refs``, ``commits``, ``resolve`` or ``unknown``."""


@dataclass
class Commit:
    """One pushed commit the fake accepted (or refused, when ``failed``)."""

    repo_id: str
    repo_type: str
    revision: str
    message: str
    description: str
    files: dict[str, bytes]
    """path in repo -> bytes, in the order they were sent."""
    create_pr: bool
    params: dict[str, list[str]]
    headers: dict[str, str]
    failed: bool = False
    oid: str | None = None
    """The commit oid the fake answered (None when refused)."""
    lfs_files: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)

    @property
    def paths(self) -> list[str]:
        return sorted(self.files)


@dataclass
class RepoCommit:
    """One commit of a served repo: the whole file tree at that commit."""

    oid: str
    parent: str | None
    title: str
    author: str
    date: str
    files: dict[str, bytes]


@dataclass
class Repo:
    """A served repository: commits, refs (``main``, other branches, ``refs/pr/N``) and discussions."""

    repo_id: str
    repo_type: str
    private: bool = False
    commits: dict[str, RepoCommit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    """branch name -> commit oid."""
    pulls: dict[int, str] = field(default_factory=dict)
    """PR number -> head commit oid (its ref is ``refs/pr/<number>``)."""
    discussions: list[dict[str, Any]] = field(default_factory=list)

    def resolve(self, revision: str) -> str | None:
        """Commit oid of a branch, ``refs/heads/<branch>``, ``refs/pr/N`` or a full commit oid (None if unknown)."""
        revision = revision.removeprefix("refs/heads/")
        if revision in self.branches:
            return self.branches[revision]
        if match := re.fullmatch(r"refs/pr/(\d+)", revision):
            return self.pulls.get(int(match[1]))
        return revision if revision in self.commits else None

    def history(self, oid: str) -> list[RepoCommit]:
        """Commits reachable from ``oid``, newest first."""
        out = []
        while oid is not None:
            commit = self.commits[oid]
            out.append(commit)
            oid = commit.parent
        return out


class FakeHub:
    """``ThreadingHTTPServer`` on ``127.0.0.1:<free port>`` in a daemon thread; serves repos, records every request
    and every pushed commit."""

    def __init__(self, user: str = "tester") -> None:
        self.user = user
        self.requests: list[Request] = []
        self.commits: list[Commit] = []
        """Accepted pushed commits only (see ``commit_attempts`` for refused ones too)."""
        self.commit_attempts: list[Commit] = []
        self.created: list[dict[str, Any]] = []
        self.validated: list[str] = []
        """README contents sent to ``/api/validate-yaml``, in order."""
        self.repos: dict[tuple[str, str], Repo] = {}
        """(repo type, repo id) -> served repo."""
        self._commit_status: int | None = None
        self._yaml_errors: list[str] | None = None
        self._echo: tuple[str, int] | None = None
        self._clock = 0
        self._lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- lifecycle
    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("FakeHub is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # keep stderr clean (capsys checks it)
                pass

            def do_POST(self) -> None:  # noqa: N802
                hub._handle(self, "POST")

            def do_GET(self) -> None:  # noqa: N802
                hub._handle(self, "GET")

            def do_HEAD(self) -> None:  # noqa: N802
                hub._handle(self, "HEAD")

            def do_PUT(self) -> None:  # noqa: N802
                hub._handle(self, "PUT")

            def do_DELETE(self) -> None:  # noqa: N802
                hub._handle(self, "DELETE")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---------------------------------------------------------------- served repos
    def add_repo(self, repo_id: str, files: Mapping[str, bytes | str | Path], *, repo_type: str = "model",
                 message: str = "initial commit", author: str = "hf-user", private: bool = False) -> str:
        """Create (or replace) a repo whose ``main`` holds ``files``; returns the commit oid."""
        with self._lock:
            self.repos[(repo_type, repo_id)] = Repo(repo_id, repo_type, private=private)
            return self.add_commit(repo_id, files, repo_type=repo_type, message=message, author=author)

    def add_commit(self, repo_id: str, files: Mapping[str, bytes | str | Path] | None = None, *,
                   deleted: tuple[str, ...] = (), repo_type: str = "model", branch: str = "main",
                   message: str = "update", author: str = "hf-user") -> str:
        """Commit ``files`` (added or replaced) and ``deleted`` paths on ``branch`` (created from ``main`` if new)."""
        with self._lock:
            repo = self.repo(repo_id, repo_type)
            parent = repo.branches.get(branch, repo.branches.get("main"))
            oid = self._new_commit(repo, parent, _as_bytes(files or {}), deleted, message, author)
            repo.branches[branch] = oid
            return oid

    def open_pr(self, repo_id: str, files: Mapping[str, bytes | str | Path], *, title: str, author: str,
                repo_type: str = "model", base: str = "main", status: str = "open") -> int:
        """Open a pull request adding ``files`` on top of ``base``'s head (ref ``refs/pr/<num>``); returns num."""
        with self._lock:
            repo = self.repo(repo_id, repo_type)
            num = self._open_discussion(repo, title=title, author=author, status=status, base=base)
            repo.pulls[num] = self._new_commit(repo, repo.branches[base], _as_bytes(files), (), title, author)
            return num

    def repo(self, repo_id: str, repo_type: str = "model") -> Repo:
        try:
            return self.repos[(repo_type, repo_id)]
        except KeyError:
            raise KeyError(f"fake hub: no {repo_type} repo {repo_id!r}") from None

    def _new_commit(self, repo: Repo, parent: str | None, files: dict[str, bytes], deleted, title: str,
                    author: str, oid: str | None = None) -> str:
        tree = dict(repo.commits[parent].files) if parent else {}
        for path in deleted:
            for name in [n for n in tree if n == path or n.startswith(path.rstrip("/") + "/")]:
                del tree[name]
        tree.update(files)
        self._clock += 1
        oid = oid or hashlib.sha1(repr((repo.repo_id, parent, self._clock, sorted(tree))).encode()).hexdigest()
        repo.commits[oid] = RepoCommit(oid, parent, title, author, _DATE.format(self._clock % 60), tree)
        return oid

    def _open_discussion(self, repo: Repo, *, title: str, author: str, status: str = "open",
                         base: str = "main") -> int:
        num = len(repo.discussions) + 1
        repo.discussions.append({
            "num": num, "title": title, "status": status, "isPullRequest": True, "createdAt": _DATE.format(num % 60),
            "author": {"name": author}, "repo": {"name": repo.repo_id, "type": repo.repo_type},
            "pinned": False, "numComments": 1, "topReactions": [],
            "events": [], "filesWithConflicts": [], "changes": {"base": f"refs/heads/{base}"},
            "gitReference": f"refs/pr/{num}", "url": f"{self.url}/{repo.repo_id}/discussions/{num}",
        })
        return num

    # ---------------------------------------------------------------- knobs
    def fail_commits(self, status: int = 500) -> None:
        """Make every later commit POST answer ``status`` (the commit is recorded in ``commit_attempts`` only)."""
        self._commit_status = status

    def echo_auth_errors(self, path_part: str, status: int) -> None:
        """Make requests whose path contains ``path_part`` fail with ``status`` and a body that echoes their
        Authorization header, as a careless proxy or server would (secrets must still never reach the user)."""
        self._echo = (path_part, status)

    def reject_yaml(self, errors: list[str] | None = None) -> None:
        """Make ``/api/validate-yaml`` answer 400 with these error messages."""
        self._yaml_errors = list(errors or ["\"base_model\" must be a valid model id"])

    def reset(self) -> None:
        """Forget recorded requests and pushes and the failure knobs (served repos stay)."""
        with self._lock:
            self.requests.clear()
            self.commits.clear()
            self.commit_attempts.clear()
            self.created.clear()
            self.validated.clear()
        self._commit_status = None
        self._yaml_errors = None
        self._echo = None

    # ---------------------------------------------------------------- queries
    @property
    def routes(self) -> list[str]:
        """Route names of the requests, in arrival order (``unknown`` ones included)."""
        return [r.route for r in self.requests]

    def hub_routes(self) -> list[str]:
        return [r for r in self.routes if r != "unknown"]

    def all_headers(self) -> list[dict[str, str]]:
        return [r.headers for r in self.requests]

    def downloads(self, repo_id: str | None = None) -> list[str]:
        """``<repo>@<rev>:<path>`` of every file GET (not HEAD) on the resolve route, in order."""
        out = []
        for r in self.requests:
            match = _RESOLVE_ROUTE.match(r.path) if r.route == "resolve" and r.method == "GET" else None
            if match and (repo_id is None or match["repo"] == repo_id):
                out.append(f"{match['repo']}@{unquote(match['rev'])}:{unquote(match['path'])}")
        return out

    @contextlib.contextmanager
    def as_endpoint(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
        """Point huggingface_hub (``HfApi()``, downloads, ``push_to_hub``...) and datasets at this fake.

        ``HF_ENDPOINT`` / ``HF_HUB_OFFLINE`` are read once, at the first import of ``huggingface_hub.constants``
        (and of ``datasets.config``), so the module constants are patched; every place that builds a URL reads them
        at call time. ``HF_HUB_OFFLINE`` is forced off for the duration, since the suite runs offline otherwise.
        """
        point_hf_at(monkeypatch, self.url)
        yield self

    # ---------------------------------------------------------------- server side
    def _handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        split = urlsplit(handler.path)
        raw_path, query = split.path, parse_qs(split.query)
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        headers = {k.lower(): v for k, v in handler.headers.items()}
        reply = _Reply(404, {"error": f"fake hub: no route for {method} {unquote(raw_path)}"},
                       {"X-Error-Code": "EntryNotFound"})
        route = "unknown"
        with self._lock:
            try:
                if self._echo is not None and self._echo[0] in raw_path:
                    route = "echo"
                    reply = _Reply(self._echo[1], {"error": f"upstream failure for {headers.get('authorization')}"})
                else:
                    route, reply = self._route(method, raw_path, query, headers, body)
            except _HubError as err:
                route, reply = err.route, err.reply
            self.requests.append(Request(method, unquote(raw_path), query, headers, body, route))
        handler.send_response(reply.status)
        data = reply.data if isinstance(reply.data, bytes) else json.dumps(reply.data).encode()
        out_headers = {"Content-Type": "application/json", **reply.headers, "Content-Length": str(len(data))}
        for key, value in out_headers.items():
            handler.send_header(key, value)
        handler.end_headers()
        if method != "HEAD":
            handler.wfile.write(data)

    def _route(self, method: str, raw_path: str, query: dict[str, list[str]], headers: dict[str, str],
               body: bytes) -> tuple[str, _Reply]:
        if method == "POST" and raw_path == "/api/repos/create":
            return "create", self._create_repo(body)
        if method == "POST" and raw_path == "/api/validate-yaml":
            return "validate-yaml", self._validate_yaml(body)
        if api := _API_ROUTE.match(raw_path):
            return self._api(method, api["type"][:-1], api["repo"], api["rest"] or "", query, headers, body)
        if (res := _RESOLVE_ROUTE.match(raw_path)) and method in ("GET", "HEAD"):
            repo = self._served("resolve", (res["type"] or "models")[:-1], res["repo"])
            return "resolve", self._resolve_file(repo, unquote(res["rev"]), unquote(res["path"]), headers)
        return "unknown", _Reply(404, {"error": f"fake hub: no route for {method} {unquote(raw_path)}"},
                                 {"X-Error-Code": "EntryNotFound"})

    def _api(self, method: str, repo_type: str, repo_id: str, rest: str, query, headers, body) -> tuple[str, _Reply]:
        parts = rest.split("/", 1)
        action, arg = parts[0], unquote(parts[1]) if len(parts) > 1 else ""
        if method == "POST" and action == "preupload":
            return "preupload", _preupload(body)
        if method == "POST" and action == "commit":
            return "commit", self._commit(repo_type, repo_id, arg, query, headers, body)
        if action == "discussions":
            return self._discussions(method, repo_type, repo_id, arg, query, body)
        if method not in ("GET", "HEAD", "POST"):
            return "unknown", _Reply(405, {"error": f"fake hub: {method} not supported on {rest!r}"})
        if action in ("", "revision") and method != "POST":
            repo = self._served("info", repo_type, repo_id)
            return "info", self._info(repo, self._commit_at(repo, arg or "main", "info"), "blobs" in query)
        if action == "tree" and method != "POST":
            repo = self._served("tree", repo_type, repo_id)
            rev, _, path = parts[1].partition("/") if len(parts) > 1 else ("main", "", "")
            commit = self._commit_at(repo, unquote(rev), "tree")
            recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
            return "tree", self._tree(repo, commit, unquote(path), recursive)
        if action == "paths-info" and method == "POST":
            repo = self._served("paths-info", repo_type, repo_id)
            commit = self._commit_at(repo, arg, "paths-info")
            form = parse_qs(body.decode()) if body and not body.lstrip().startswith(b"{") else {}
            paths = form.get("paths") or json.loads(body or b"{}").get("paths", [])
            return "paths-info", self._paths_info(commit, paths)
        if action == "refs" and method != "POST":
            repo = self._served("refs", repo_type, repo_id)
            return "refs", self._refs(repo, bool(query.get("include_prs")))
        if action == "commits" and method != "POST":
            repo = self._served("commits", repo_type, repo_id)
            commit = self._commit_at(repo, arg or "main", "commits")
            return "commits", _Reply(200, [_commit_json(c) for c in repo.history(commit.oid)])
        return "unknown", _Reply(404, {"error": f"fake hub: no route for {method} {rest!r} of {repo_id}"},
                                 {"X-Error-Code": "EntryNotFound"})

    # -- read side
    def _served(self, route: str, repo_type: str, repo_id: str) -> Repo:
        repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            raise _HubError(route, _Reply(404, {"error": f"Repository Not Found for {repo_type} {repo_id}"},
                                          {"X-Error-Code": "RepoNotFound"}))
        return repo

    def _commit_at(self, repo: Repo, revision: str, route: str) -> RepoCommit:
        oid = repo.resolve(revision)
        if oid is None:
            raise _HubError(route, _Reply(404, {"error": f"Invalid rev id: {revision}"},
                                          {"X-Error-Code": "RevisionNotFound"}))
        return repo.commits[oid]

    def _info(self, repo: Repo, commit: RepoCommit, blobs: bool) -> _Reply:
        siblings = []
        for path, data in sorted(commit.files.items()):
            sibling: dict[str, Any] = {"rfilename": path}
            if blobs:
                entry = _file_entry(path, data)
                sibling.update(size=entry["size"], blobId=entry["oid"])
                if "lfs" in entry:
                    sibling["lfs"] = {"sha256": entry["lfs"]["oid"], "size": entry["lfs"]["size"],
                                      "pointerSize": entry["lfs"]["pointerSize"]}
            siblings.append(sibling)
        author = repo.repo_id.split("/")[0]
        return _Reply(200, {
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24], "id": repo.repo_id, "author": author,
            "sha": commit.oid, "lastModified": commit.date, "createdAt": _DATE.format(0), "private": repo.private,
            "gated": False, "disabled": False, "downloads": 0, "likes": 0, "tags": [], "siblings": siblings,
        })

    def _tree(self, repo: Repo, commit: RepoCommit, path: str, recursive: bool) -> _Reply:
        prefix = f"{path.strip('/')}/" if path.strip("/") else ""
        if prefix and not any(name.startswith(prefix) for name in commit.files):
            raise _HubError("tree", _Reply(404, {"error": f"{path} does not exist"},
                                           {"X-Error-Code": "EntryNotFound"}))
        entries, folders = [], set()
        for name, data in sorted(commit.files.items()):
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):].split("/")
            for depth in range(1, len(rest)):
                folder = prefix + "/".join(rest[:depth])
                if folder not in folders and (recursive or depth == 1):
                    folders.add(folder)
                    entries.append({"type": "directory", "path": folder, "size": 0,
                                    "oid": hashlib.sha1(folder.encode()).hexdigest()})
            if recursive or len(rest) == 1:
                entries.append(_file_entry(name, data))
        return _Reply(200, entries)

    def _paths_info(self, commit: RepoCommit, paths: list[str]) -> _Reply:
        out = []
        for path in paths:
            if path in commit.files:
                out.append(_file_entry(path, commit.files[path]))
            elif any(name.startswith(path.rstrip("/") + "/") for name in commit.files):
                out.append({"type": "directory", "path": path, "size": 0,
                            "oid": hashlib.sha1(path.encode()).hexdigest()})
        return _Reply(200, out)

    def _refs(self, repo: Repo, include_prs: bool) -> _Reply:
        data: dict[str, Any] = {
            "branches": [{"name": name, "ref": f"refs/heads/{name}", "targetCommit": oid}
                         for name, oid in repo.branches.items()],
            "tags": [], "converts": [],
        }
        if include_prs:
            data["pullRequests"] = [{"name": f"refs/pr/{num}", "ref": f"refs/pr/{num}", "targetCommit": oid}
                                    for num, oid in repo.pulls.items()]
        return _Reply(200, data)

    def _resolve_file(self, repo: Repo, revision: str, path: str, headers: dict[str, str]) -> _Reply:
        commit = self._commit_at(repo, revision, "resolve")
        if path not in commit.files:
            raise _HubError("resolve", _Reply(404, {"error": f"Entry not found: {path}"},
                                              {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit.oid}))
        data = commit.files[path]
        entry = _file_entry(path, data)
        etag = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]
        out = {"X-Repo-Commit": commit.oid, "ETag": f'"{etag}"', "Accept-Ranges": "bytes",
               "Content-Type": "application/octet-stream"}
        if (spec := re.fullmatch(r"bytes=(\d*)-(\d*)", headers.get("range", ""))) and data:
            start = int(spec[1]) if spec[1] else max(len(data) - int(spec[2] or 0), 0)
            end = min(int(spec[2]), len(data) - 1) if spec[1] and spec[2] else len(data) - 1
            if start >= len(data):
                return _Reply(416, b"", {**out, "Content-Range": f"bytes */{len(data)}"})
            return _Reply(206, data[start:end + 1], {**out, "Content-Range": f"bytes {start}-{end}/{len(data)}"})
        return _Reply(200, data, out)

    # -- discussions
    def _discussions(self, method: str, repo_type: str, repo_id: str, num: str, query, body) -> tuple[str, _Reply]:
        if method == "POST" and not num:
            payload = json.loads(body or b"{}")
            repo = self._ensure_repo(repo_type, repo_id)
            new = self._open_discussion(repo, title=payload.get("title", "PR"), author=self.user, status="draft")
            repo.pulls[new] = repo.branches.get("main") or self._new_commit(repo, None, {}, (), "initial", self.user)
            return "discussion", _Reply(200, repo.discussions[new - 1])
        repo = self._served("discussion" if num else "discussions", repo_type, repo_id)
        if num:
            found = [d for d in repo.discussions if str(d["num"]) == num]
            if not found:
                raise _HubError("discussion", _Reply(404, {"error": f"Discussion {num} not found"},
                                                     {"X-Error-Code": "EntryNotFound"}))
            return "discussion", _Reply(200, found[0])
        wanted_type = query.get("type", ["all"])[0]
        wanted_status = query.get("status", ["all"])[0]
        author = query.get("author", [None])[0]
        items = [d for d in reversed(repo.discussions)
                 if (wanted_type == "all" or d["isPullRequest"] == (wanted_type == "pull_request"))
                 and (wanted_status == "all" or d["status"] == wanted_status)
                 and (author is None or d["author"]["name"] == author)]
        return "discussions", _Reply(200, {"discussions": items, "count": len(items), "start": 0,
                                           "numClosedDiscussions": 0})

    # -- write side
    def _ensure_repo(self, repo_type: str, repo_id: str) -> Repo:
        return self.repos.setdefault((repo_type, repo_id), Repo(repo_id, repo_type))

    def _create_repo(self, body: bytes) -> _Reply:
        payload = json.loads(body or b"{}")
        repo_id = f"{payload.get('organization') or self.user}/{payload['name']}"
        self.created.append({**payload, "repo_id": repo_id})
        repo = self._ensure_repo(payload.get("type") or "model", repo_id)
        repo.private = payload.get("private") is True or payload.get("visibility") == "private"
        return _Reply(200, {"url": f"{self.url}/{repo_id}", "name": repo_id})

    def _validate_yaml(self, body: bytes) -> _Reply:
        self.validated.append(json.loads(body or b"{}").get("content", ""))
        if self._yaml_errors is not None:
            return _Reply(400, {"errors": [{"message": m} for m in self._yaml_errors], "warnings": []})
        return _Reply(200, {"errors": [], "warnings": []})

    def _commit(self, repo_type: str, repo_id: str, revision: str, query, headers, body) -> _Reply:
        commit = _parse_commit(repo_type, repo_id, revision, query, headers, body)
        self.commit_attempts.append(commit)
        if self._commit_status is not None:
            commit.failed = True
            return _Reply(self._commit_status, {"error": "fake hub: commit refused (simulated server error)"})
        self.commits.append(commit)
        repo = self._ensure_repo(repo_type, repo_id)
        pr_num = None
        if commit.create_pr and not revision.startswith("refs/pr/"):
            pr_num = self._open_discussion(repo, title=commit.message, author=self.user, base=revision)
        elif match := re.fullmatch(r"refs/pr/(\d+)", revision):
            pr_num = int(match[1])
        parent = repo.pulls[pr_num] if pr_num in repo.pulls else repo.branches.get(revision, repo.branches.get("main"))
        oid = hashlib.sha1(repr((len(self.commits), sorted(commit.files.items()))).encode()).hexdigest()
        self._new_commit(repo, parent, dict(commit.files), tuple(commit.deleted), commit.message, self.user, oid)
        if pr_num is not None:
            repo.pulls[pr_num] = oid
        else:
            repo.branches[revision] = oid
        commit.oid = oid
        prefix = "" if repo_type == "model" else f"{repo_type}s/"
        pr_url = f"{self.url}/{prefix}{repo_id}/discussions/{pr_num or 1}" if commit.create_pr else None
        return _Reply(200, {"commitUrl": f"{self.url}/{prefix}{repo_id}/commit/{oid}", "commitOid": oid,
                            "pullRequestUrl": pr_url})


@dataclass
class _Reply:
    status: int
    data: Any
    headers: dict[str, str] = field(default_factory=dict)


class _HubError(Exception):
    def __init__(self, route: str, reply: _Reply) -> None:
        super().__init__(reply.data)
        self.route, self.reply = route, reply


def _as_bytes(files: Mapping[str, bytes | str | Path]) -> dict[str, bytes]:
    out = {}
    for path, value in files.items():
        if isinstance(value, Path):
            value = value.read_bytes()
        out[path] = value.encode() if isinstance(value, str) else bytes(value)
    return out


@functools.lru_cache(maxsize=4096)  # bytes cache their hash: a repeated lookup costs no re-hashing of the content
def _file_entry(path: str, data: bytes) -> dict[str, Any]:
    """A tree / paths-info entry as the Hub sends it (LFS files carry the sha256 of their content)."""
    if path.endswith(_LFS_SUFFIXES):
        sha256 = hashlib.sha256(data).hexdigest()
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(data)}\n".encode()
        return {"type": "file", "path": path, "size": len(data), "oid": _git_oid(pointer),
                "lfs": {"oid": sha256, "size": len(data), "pointerSize": len(pointer)}}
    return {"type": "file", "path": path, "size": len(data), "oid": _git_oid(data)}


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _commit_json(commit: RepoCommit) -> dict[str, Any]:
    return {"id": commit.oid, "title": commit.title, "message": "", "authors": [{"user": commit.author}],
            "date": commit.date}


def _preupload(body: bytes) -> _Reply:
    payload = json.loads(body or b"{}")
    files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in payload.get("files", [])]
    return _Reply(200, {"files": files})


def _parse_commit(repo_type: str, repo_id: str, revision: str, query: dict[str, list[str]], headers: dict[str, str],
                  body: bytes) -> Commit:
    header: dict[str, Any] = {}
    files: dict[str, bytes] = {}
    lfs: list[str] = []
    deleted: list[str] = []
    for line in body.splitlines():
        if not line.strip():
            continue
        item = json.loads(line)
        key, value = item.get("key"), item.get("value", {})
        if key == "header":
            header = value
        elif key == "file":
            content = value["content"]
            files[value["path"]] = (base64.b64decode(content) if value.get("encoding") == "base64"
                                    else content.encode())
        elif key == "lfsFile":
            lfs.append(value["path"])
        elif key in ("deletedFile", "deletedFolder"):
            deleted.append(value["path"])
    return Commit(
        repo_id=repo_id, repo_type=repo_type, revision=revision,
        message=header.get("summary", ""), description=header.get("description", ""), files=files,
        create_pr=(query.get("create_pr", ["0"])[0] in ("1", "true", "True") or revision.startswith("refs/pr/")),
        params=query, headers=headers, lfs_files=lfs, deleted=deleted,
    )


def point_hf_at(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    """Make huggingface_hub and datasets use ``endpoint`` online, for the rest of the test (undone by
    ``monkeypatch``)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", endpoint)       # for subprocesses / late importers
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    # HfApi's default instance was built at import with the old endpoint; module-level helpers
    # (huggingface_hub.create_repo, upload_folder, ...) are bound to it.
    from huggingface_hub import hf_api

    monkeypatch.setattr(hf_api.api, "endpoint", endpoint)
    # datasets copies both at import (datasets.config) and builds its own HfApi / HfFileSystem from them
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", endpoint)
    monkeypatch.setattr(datasets.config, "HUB_DATASETS_URL",
                        endpoint + "/datasets/{repo_id}/resolve/{revision}/{path}")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    # HfFileSystem instances are cached per (endpoint, token...); a fresh server is a fresh filesystem
    from huggingface_hub import HfFileSystem

    HfFileSystem.clear_instance_cache()


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    """A started :class:`FakeHub` that huggingface_hub talks to for the duration of the test."""
    from huggingface_hub import constants

    # the agent-harness registry fetch (a GET on the endpoint, 404 here) would cache under the real HF_HOME
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH",
                        str(tmp_path_factory.mktemp("fake_hub_home") / ".agent_harnesses.json"), raising=False)
    with FakeHub() as hub, hub.as_endpoint(monkeypatch):
        yield hub
