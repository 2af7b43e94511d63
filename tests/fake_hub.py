"""A loopback fake of the four Hugging Face Hub routes that ``HfApi.create_repo`` / ``create_commit`` /
``upload_folder`` / ``ModelCard.validate`` use (see ``HF_NOTES.md`` §6), for offline push tests.

```python
from fake_hub import FakeHub

with FakeHub() as hub, hub.as_endpoint(monkeypatch):      # HfApi() / push_to_hub now talk to the fake
    HfApi(token="hf_x").upload_folder(repo_id="me/m", folder_path="merged")
assert hub.commits[0].files.keys() == {...}
```

or, in a test module, the ``fake_hub`` fixture (``from fake_hub import fake_hub``), which starts a fake, points
``huggingface_hub`` at it for the test, and stops it afterwards.

Routes (POST; everything else answers 404 and is still recorded):

| route | reply |
|---|---|
| ``/api/repos/create`` | ``{"url": ..., "name": repo_id}`` |
| ``/api/validate-yaml`` | ``{"errors": [], "warnings": []}``, or 400 + ``errors`` after ``hub.reject_yaml([...])`` |
| ``/api/{type}s/{repo}/preupload/{rev}`` | every file ``uploadMode: "regular"`` (inline; no LFS/Xet routes needed) |
| ``/api/{type}s/{repo}/commit/{rev}`` | ``{"commitUrl", "commitOid", "pullRequestUrl"}``, or 500 after ``hub.fail_commits()`` |

plus ``POST/GET /api/{type}s/{repo}/discussions[/{num}]`` (PR #1 on ``refs/pr/1``), which ``upload_folder(create_pr=True)``
uses: it opens the PR first, then commits to its ref (``Commit.create_pr`` is true for either way).

The wire format is huggingface_hub's private one (checked against 2.4): pin a version range in the test extra.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

_REPO_ROUTE = re.compile(r"^/api/(?P<type>models|datasets|spaces)/(?P<repo>[^/]+/[^/]+|[^/]+)/"
                         r"(?P<action>preupload|commit)/(?P<rev>.+)$")
_DISCUSSION_ROUTE = re.compile(r"^/api/(?P<type>models|datasets|spaces)/(?P<repo>[^/]+/[^/]+|[^/]+)/discussions"
                               r"(?:/(?P<num>\d+))?$")


@dataclass
class Request:
    """One HTTP request the fake received (headers as sent, lower-cased names)."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes
    route: str
    """``create``, ``validate-yaml``, ``preupload``, ``commit`` or ``unknown``."""


@dataclass
class Commit:
    """One commit the fake accepted (or refused, when ``failed``)."""

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


class FakeHub:
    """``ThreadingHTTPServer`` on ``127.0.0.1:<free port>`` in a daemon thread; records every request and commit."""

    def __init__(self, user: str = "tester") -> None:
        self.user = user
        self.requests: list[Request] = []
        self.commits: list[Commit] = []
        """Accepted commits only (see ``commit_attempts`` for refused ones too)."""
        self.commit_attempts: list[Commit] = []
        self.created: list[dict[str, Any]] = []
        self.validated: list[str] = []
        """README contents sent to ``/api/validate-yaml``, in order."""
        self._commit_status: int | None = None
        self._yaml_errors: list[str] | None = None
        self._lock = threading.Lock()
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

    # ---------------------------------------------------------------- knobs
    def fail_commits(self, status: int = 500) -> None:
        """Make every later commit POST answer ``status`` (the commit is recorded in ``commit_attempts`` only)."""
        self._commit_status = status

    def reject_yaml(self, errors: list[str] | None = None) -> None:
        """Make ``/api/validate-yaml`` answer 400 with these error messages."""
        self._yaml_errors = list(errors or ["\"base_model\" must be a valid model id"])

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.commits.clear()
            self.commit_attempts.clear()
            self.created.clear()
            self.validated.clear()
        self._commit_status = None
        self._yaml_errors = None

    # ---------------------------------------------------------------- queries
    @property
    def routes(self) -> list[str]:
        """Route names of the requests, in arrival order (``unknown`` ones included)."""
        return [r.route for r in self.requests]

    def hub_routes(self) -> list[str]:
        return [r for r in self.routes if r != "unknown"]

    def all_headers(self) -> list[dict[str, str]]:
        return [r.headers for r in self.requests]

    @contextlib.contextmanager
    def as_endpoint(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
        """Point huggingface_hub (``HfApi()``, ``ModelCard.validate``, ``push_to_hub``...) at this fake.

        ``HF_ENDPOINT`` / ``HF_HUB_OFFLINE`` are read once, at the first import of ``huggingface_hub.constants``,
        so the module constants are patched; every place that builds a URL reads them at call time
        (``HfApi.__init__``, ``_commit_api``, ``repocard``). ``HF_HUB_OFFLINE`` is forced off for the duration,
        since the suite runs offline otherwise.
        """
        point_hf_at(monkeypatch, self.url)
        yield self

    # ---------------------------------------------------------------- server side
    def _handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        split = urlsplit(handler.path)
        path, query = unquote(split.path), parse_qs(split.query)
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        headers = {k.lower(): v for k, v in handler.headers.items()}
        route, status, reply = "unknown", 404, {"error": f"fake hub: no route for {method} {path}"}
        match = _REPO_ROUTE.match(path)
        if method == "POST" and path == "/api/repos/create":
            route = "create"
            payload = json.loads(body or b"{}")
            repo_id = f"{payload.get('organization') or self.user}/{payload['name']}"
            with self._lock:
                self.created.append({**payload, "repo_id": repo_id})
            status, reply = 200, {"url": f"{self.url}/{repo_id}", "name": repo_id}
        elif method == "POST" and path == "/api/validate-yaml":
            route = "validate-yaml"
            payload = json.loads(body or b"{}")
            with self._lock:
                self.validated.append(payload.get("content", ""))
            if self._yaml_errors is not None:
                status, reply = 400, {"errors": [{"message": m} for m in self._yaml_errors], "warnings": []}
            else:
                status, reply = 200, {"errors": [], "warnings": []}
        elif method == "POST" and match and match["action"] == "preupload":
            route = "preupload"
            payload = json.loads(body or b"{}")
            files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                     for f in payload.get("files", [])]
            status, reply = 200, {"files": files}
        elif (disc := _DISCUSSION_ROUTE.match(path)) and (method == "POST" or disc["num"]):
            route = "discussion"
            payload = json.loads(body or b"{}") if method == "POST" else {}
            repo_id, repo_type = disc["repo"], disc["type"][:-1]
            status, reply = 200, {
                "num": 1, "title": payload.get("title", "PR"), "status": "draft", "isPullRequest": True,
                "createdAt": "2024-01-01T00:00:00.000Z", "author": {"name": self.user},
                "repo": {"name": repo_id, "type": repo_type}, "events": [], "filesWithConflicts": [],
                "changes": {"base": "refs/heads/main"}, "gitReference": "refs/pr/1", "url": f"{self.url}/{repo_id}/discussions/1",
            }
        elif method == "POST" and match and match["action"] == "commit":
            route = "commit"
            commit = self._parse_commit(match, query, headers, body)
            with self._lock:
                self.commit_attempts.append(commit)
            if self._commit_status is not None:
                commit.failed = True
                status, reply = self._commit_status, {"error": "fake hub: commit refused (simulated server error)"}
            else:
                with self._lock:
                    self.commits.append(commit)
                oid = hashlib.sha1(repr((len(self.commits), sorted(commit.files.items()))).encode()).hexdigest()
                commit.oid = oid
                prefix = "" if match["type"] == "models" else f"{match['type']}/"
                pr = f"{self.url}/{prefix}{commit.repo_id}/discussions/1" if commit.create_pr else None
                status, reply = 200, {"commitUrl": f"{self.url}/{prefix}{commit.repo_id}/commit/{oid}",
                                      "commitOid": oid, "pullRequestUrl": pr}
        with self._lock:
            self.requests.append(Request(method, path, query, headers, body, route))
        data = json.dumps(reply).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        if route == "unknown":
            handler.send_header("X-Error-Code", "EntryNotFound")
        handler.end_headers()
        if method != "HEAD":
            handler.wfile.write(data)

    @staticmethod
    def _parse_commit(match: re.Match, query: dict[str, list[str]], headers: dict[str, str], body: bytes) -> Commit:
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
            repo_id=match["repo"], repo_type=match["type"][:-1], revision=match["rev"],
            message=header.get("summary", ""), description=header.get("description", ""), files=files,
            create_pr=(query.get("create_pr", ["0"])[0] in ("1", "true", "True")
                       or match["rev"].startswith("refs/pr/")),
            params=query, headers=headers,
            lfs_files=lfs, deleted=deleted,
        )


def point_hf_at(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    """Make huggingface_hub use ``endpoint`` online, for the rest of the test (undone by ``monkeypatch``)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", endpoint)       # for subprocesses / late importers
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    # HfApi's default instance was built at import with the old endpoint; module-level helpers
    # (huggingface_hub.create_repo, upload_folder, ...) are bound to it.
    from huggingface_hub import hf_api

    monkeypatch.setattr(hf_api.api, "endpoint", endpoint)


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    """A started :class:`FakeHub` that huggingface_hub talks to for the duration of the test."""
    from huggingface_hub import constants

    # the agent-harness registry fetch (a GET on the endpoint, 404 here) would cache under the real HF_HOME
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH",
                        str(tmp_path_factory.mktemp("fake_hub_home") / ".agent_harnesses.json"), raising=False)
    with FakeHub() as hub, hub.as_endpoint(monkeypatch):
        yield hub
