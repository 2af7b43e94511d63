"""Hub integration, fully offline: Hub ids from a pre-seeded cache, and pushes against a loopback fake Hub.

* Hub ids: ``<cache>/models--org--name/refs/main`` + ``snapshots/<sha>/`` (plain folders suffice), with
  ``huggingface_hub.constants.HF_HUB_CACHE`` / ``HF_HUB_OFFLINE`` monkeypatched (the env vars are read once, at import).
* Pushes: ``tests/fake_hub.py`` (``ThreadingHTTPServer`` on 127.0.0.1), with ``huggingface_hub.constants.ENDPOINT``
  and ``HF_HUB_OFFLINE`` monkeypatched (see ``fake_hub.point_hf_at``).
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
import sys
import traceback
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))

from fake_hub import FakeHub, fake_hub  # noqa: E402,F401  (fixture re-export)

import hf_mloss  # noqa: E402
from hf_mloss import CheckpointNotFoundError, PushError  # noqa: E402
from hf_mloss.loading.hub import resolve_model  # noqa: E402
from hf_mloss.output.push import push_folder  # noqa: E402
from hf_mloss.spec.config import MERGE_CONFIG_NAME  # noqa: E402
from hf_mloss.saving import MANIFEST_NAME  # noqa: E402

TOKEN = "hf_sentinel_TOKEN_123"
SHAS = {
    "org/base": hashlib.sha1(b"org/base").hexdigest(),
    "org/ft0": hashlib.sha1(b"org/ft0").hexdigest(),
    "org/ft1": hashlib.sha1(b"org/ft1").hexdigest(),
}


# --------------------------------------------------------------------------------------------------------------------
# Helpers and fixtures
# --------------------------------------------------------------------------------------------------------------------


def folder_files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative POSIX path -> bytes)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def read_card_yaml(readme: Path) -> dict:
    text = readme.read_text(encoding="utf-8")
    assert text.startswith("---\n"), text[:200]
    return yaml.safe_load(text.split("---\n", 2)[1])


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory, tiny_models) -> Path:
    """A Hub cache holding org/base, org/ft0, org/ft1 (the tiny base + 2 fine-tunes), each at its own sha."""
    base, models = tiny_models
    cache = tmp_path_factory.mktemp("hub_cache")
    for repo_id, src in zip(SHAS, [base, *models[:2]]):
        storage = cache / f"models--{repo_id.replace('/', '--')}"
        (storage / "refs").mkdir(parents=True)
        (storage / "refs" / "main").write_text(SHAS[repo_id])
        shutil.copytree(src, storage / "snapshots" / SHAS[repo_id])
    return cache


@pytest.fixture
def offline_cache(hub_cache, monkeypatch) -> Path:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_cache


@pytest.fixture(scope="module")
def hub_result(hub_cache):
    """A TIES merge of Hub ids resolved from the pre-seeded cache (offline), with a token passed through."""
    from huggingface_hub import constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
        mp.setattr(constants, "HF_HUB_OFFLINE", True)
        return hf_mloss.merge("org/base", ["org/ft0", "org/ft1"], "ties", progress=False, token=TOKEN)


@pytest.fixture(scope="module")
def local_result(tiny_paths):
    base, models = tiny_paths
    return hf_mloss.merge(base, models[:2], "ties", progress=False)


@pytest.fixture(scope="module")
def reference_folder(local_result, tmp_path_factory) -> dict[str, bytes]:
    """What ``save_pretrained`` writes for ``local_result`` (the expected content of every push)."""
    folder = local_result.save_pretrained(tmp_path_factory.mktemp("ref") / "merged")
    return folder_files(folder)


@pytest.fixture(scope="module")
def saved_local(local_result, tmp_path_factory) -> Path:
    return local_result.save_pretrained(tmp_path_factory.mktemp("saved") / "merged")


@pytest.fixture
def all_logs(caplog):
    """caplog at DEBUG for every logger, including transformers' (which does not propagate)."""
    caplog.set_level(logging.DEBUG)
    touched = []
    for name in ("huggingface_hub", "transformers", "hf_mloss", "httpx", "httpx2", "urllib3"):
        logger = logging.getLogger(name)
        touched.append((logger, logger.level))
        logger.setLevel(logging.DEBUG)
        if not logger.propagate:
            logger.addHandler(caplog.handler)
    yield caplog
    for logger, level in touched:
        logger.setLevel(level)
        if caplog.handler in logger.handlers:
            logger.removeHandler(caplog.handler)


def assert_token_only_in_auth_headers(hub: FakeHub) -> None:
    """The token reached the fake, and only as ``Authorization: Bearer <token>``."""
    assert hub.requests, "no request reached the fake Hub"
    hub_requests = [r for r in hub.requests if r.route != "unknown"]
    assert hub_requests and all(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in hub_requests)
    for request in hub.requests:
        assert TOKEN.encode() not in request.body, request.route
        assert TOKEN not in request.path and TOKEN not in str(request.query)
        assert all(TOKEN not in v for k, v in request.headers.items() if k != "authorization"), request.headers
    for commit in hub.commit_attempts:
        for path, data in commit.files.items():
            assert TOKEN.encode() not in data, path
        assert TOKEN not in commit.message + commit.description


def assert_no_token_output(caplog, capsys) -> None:
    out, err = capsys.readouterr()
    assert TOKEN not in out and TOKEN not in err
    assert TOKEN not in caplog.text
    assert all(TOKEN not in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------------------------------------------------
# 1. Hub ids from a pre-seeded cache, offline
# --------------------------------------------------------------------------------------------------------------------


def test_cached_hub_id_resolves_offline(offline_cache) -> None:
    ref = resolve_model("org/base")
    assert ref.repo_id == "org/base" and ref.revision == SHAS["org/base"] and ref.name == "org/base"
    assert Path(ref.path) == offline_cache / "models--org--base" / "snapshots" / SHAS["org/base"]
    assert {"config.json", "model.safetensors"} <= {p.name for p in Path(ref.path).iterdir()}
    # revision pinned to the sha (what a reproduced merge uses) resolves to the same snapshot
    assert resolve_model("org/base", revision=SHAS["org/base"]).path == ref.path


def test_merge_hub_ids_from_cache(hub_result, offline_cache) -> None:
    result = hub_result
    assert result.base.repo_id == "org/base"
    assert result.base.revision == SHAS["org/base"]
    assert [(m.repo_id, m.revision) for m in result.models] == [("org/ft0", SHAS["org/ft0"]),
                                                                ("org/ft1", SHAS["org/ft1"])]
    assert "org/base" in repr(result) and str(offline_cache) not in repr(result)


def test_saved_hub_merge_card_and_config_record_hub_ids_and_revisions(hub_result, offline_cache, tmp_path) -> None:
    folder = hub_result.save_pretrained(tmp_path / "merged")
    meta = read_card_yaml(folder / "README.md")
    assert meta["base_model"] == ["org/base", "org/ft0", "org/ft1"]
    assert meta.get("base_model_relation") == "merge"
    config = yaml.safe_load((folder / MERGE_CONFIG_NAME).read_text())
    assert config["base"] == {"model": "org/base", "revision": SHAS["org/base"], "weights_file": "model.safetensors"}
    assert [(m["model"], m["revision"]) for m in config["models"]] == [("org/ft0", SHAS["org/ft0"]),
                                                                      ("org/ft1", SHAS["org/ft1"])]
    # no local path (cache, snapshot folder) and no token anywhere in the folder
    for path, data in folder_files(folder).items():
        assert str(offline_cache).encode() not in data, path
        assert b"snapshots/" not in data and b"models--org--" not in data, path
        assert TOKEN.encode() not in data, path
    # the card is loadable by huggingface_hub with strict metadata
    from huggingface_hub import ModelCard

    assert ModelCard.load(folder / "README.md", ignore_metadata_errors=False).data.base_model == [
        "org/base", "org/ft0", "org/ft1"]


def test_local_merge_card_has_no_local_paths(saved_local, tiny_paths) -> None:
    meta = read_card_yaml(saved_local / "README.md")
    assert not meta.get("base_model")  # local sources have no Hub id: nothing (and no path) is claimed
    base, models = tiny_paths
    for path, data in folder_files(saved_local).items():
        for local in [base, *models]:
            assert local.encode() not in data, (path, local)


def test_loaded_model_from_hub_cache_keeps_its_hub_id(offline_cache, tiny_paths, tmp_path) -> None:
    from transformers import CLIPVisionModel

    loaded = CLIPVisionModel.from_pretrained("org/base")  # offline, from the pre-seeded cache
    result = hf_mloss.merge(loaded, tiny_paths[1][:2], "ties", progress=False)
    assert result.base.repo_id == "org/base"
    with pytest.warns(UserWarning, match="no image processor"):  # the cached base holds none
        folder = result.save_pretrained(tmp_path / "merged")
    assert read_card_yaml(folder / "README.md")["base_model"] == ["org/base"]


def test_loaded_model_from_relative_local_path_is_not_claimed_as_hub_id(tiny_paths, tmp_path, monkeypatch) -> None:
    """A model loaded with ``from_pretrained("models/base")`` (a relative local folder) has
    ``_name_or_path == "models/base"``, which looks like ``org/name``: it must not become a Hub id in the card."""
    from transformers import CLIPVisionModel

    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_paths[0], tmp_path / "models" / "base")
    loaded = CLIPVisionModel.from_pretrained("models/base")
    assert loaded.config._name_or_path == "models/base"
    result = hf_mloss.merge(loaded, tiny_paths[1][:2], "ties", progress=False)
    folder = result.save_pretrained(tmp_path / "out" / "merged")
    meta = read_card_yaml(folder / "README.md")
    assert result.base.repo_id is None, f"local folder {result.base.repo_id!r} was taken for a Hub id"
    assert "models/base" not in (meta.get("base_model") or [])


def test_uncached_hub_id_offline_says_cache_and_offline(offline_cache) -> None:
    with pytest.raises(CheckpointNotFoundError) as info:
        resolve_model("org/not-cached")
    message = str(info.value)
    assert "org/not-cached" in message
    assert "cache" in message.lower() and "offline" in message.lower()
    assert isinstance(info.value, FileNotFoundError)
    with pytest.raises(CheckpointNotFoundError, match="not in the local Hub cache"):
        hf_mloss.merge("org/base", ["org/ft0", "org/not-cached"], "ties", progress=False)


def test_unknown_revision_of_cached_repo_offline(offline_cache) -> None:
    with pytest.raises(CheckpointNotFoundError, match="org/base"):
        resolve_model("org/base", revision="0" * 40)


def test_missing_local_path_message_differs_from_hub_message(offline_cache, mocker) -> None:
    import huggingface_hub

    spy = mocker.spy(huggingface_hub, "snapshot_download")
    with pytest.raises(CheckpointNotFoundError) as local_info:
        resolve_model("./nope/model")
    with pytest.raises(CheckpointNotFoundError) as hub_info:
        resolve_model("org/not-cached")
    local_msg, hub_msg = str(local_info.value), str(hub_info.value)
    assert "./nope/model" in local_msg and "does not exist" in local_msg and "local path" in local_msg.lower()
    assert "cache" not in local_msg.lower() and "offline" not in local_msg.lower()
    assert local_msg != hub_msg and "does not exist" not in hub_msg
    assert [c.args[0] for c in spy.call_args_list] == ["org/not-cached"]  # the local path never went to the Hub
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        hf_mloss.merge("./nope/model", ["org/ft0"], "ties", progress=False)


def test_token_and_revision_passed_to_snapshot_download_unchanged(offline_cache, mocker) -> None:
    import huggingface_hub

    spy = mocker.spy(huggingface_hub, "snapshot_download")
    resolve_model("org/ft0", token=TOKEN, revision="main")
    kwargs = spy.call_args.kwargs
    assert kwargs["token"] == TOKEN and kwargs["revision"] == "main"
    assert set(kwargs["allow_patterns"]) >= {"*.json", "*.safetensors"}
    assert not any("bin" in p for p in kwargs["allow_patterns"])  # no pickle unless allow_pickle=True


# --------------------------------------------------------------------------------------------------------------------
# 2. Push against the loopback fake Hub
# --------------------------------------------------------------------------------------------------------------------


def test_push_to_hub_one_commit_with_the_saved_files(local_result, reference_folder, fake_hub, all_logs,
                                                     capsys) -> None:
    info = local_result.push_to_hub("tester/merged", token=TOKEN, commit_message="merge it")
    assert len(fake_hub.commits) == 1 and len(fake_hub.commit_attempts) == 1
    commit = fake_hub.commits[0]
    assert commit.repo_id == "tester/merged" and commit.repo_type == "model"
    assert commit.revision == "main" and commit.create_pr is False and commit.message == "merge it"
    assert commit.lfs_files == [] and commit.deleted == []
    # exactly the saved folder's files; the config's local paths are absolute here (no folder to be relative to)
    assert set(commit.files) == set(reference_folder)
    for name in set(reference_folder) - {MERGE_CONFIG_NAME, MANIFEST_NAME}:
        assert commit.files[name] == reference_folder[name], name
    assert {"config.json", "model.safetensors", "README.md", MERGE_CONFIG_NAME} <= set(commit.files)
    assert info.oid == commit.oid and info.commit_url.startswith(fake_hub.url)
    # README validated first, with the committed content; then preupload, then the single commit
    routes = fake_hub.hub_routes()
    assert routes.count("commit") == 1 and routes.count("validate-yaml") == 1
    assert routes.index("validate-yaml") < routes.index("preupload") < routes.index("commit")
    assert fake_hub.validated == [commit.files["README.md"].decode()]
    assert [c["repo_id"] for c in fake_hub.created] == ["tester/merged"]
    assert_token_only_in_auth_headers(fake_hub)
    assert_no_token_output(all_logs, capsys)


def test_save_pretrained_push_to_hub_uploads_the_folder(local_result, fake_hub, all_logs, capsys, tmp_path) -> None:
    folder = local_result.save_pretrained(tmp_path / "merged", push_to_hub=True, repo_id="tester/merged2",
                                          token=TOKEN, create_pr=True, commit_message="as a PR", private=True)
    assert folder == tmp_path / "merged"
    files = folder_files(folder)
    assert len(fake_hub.commits) == 1
    commit = fake_hub.commits[0]
    assert commit.files == files and commit.repo_id == "tester/merged2"
    assert commit.create_pr is True and commit.message == "as a PR"
    assert fake_hub.created[0].get("visibility") == "private"  # private=True, as huggingface_hub 2.x sends it
    routes = fake_hub.hub_routes()
    assert routes.index("validate-yaml") < routes.index("commit")
    assert folder_files(folder) == files  # pushing does not touch the local folder
    assert_token_only_in_auth_headers(fake_hub)
    assert_no_token_output(all_logs, capsys)


def test_revision_forwarded_and_default_repo_id_is_folder_name(local_result, fake_hub, tmp_path) -> None:
    folder = local_result.save_pretrained(tmp_path / "my-merge", push_to_hub=True, token=TOKEN, revision="dev")
    commit = fake_hub.commits[-1]
    assert commit.repo_id == "tester/my-merge"  # user namespace given by the Hub for a bare name
    assert commit.revision == "dev" and commit.create_pr is False
    assert commit.files == folder_files(folder)


def test_push_folder_returns_commit_info(saved_local, fake_hub) -> None:
    info = push_folder(saved_local, "tester/direct", token=TOKEN)
    assert info.oid == fake_hub.commits[0].oid  # the CommitInfo of the one commit
    assert info.commit_url.startswith(fake_hub.url) and "tester/direct" in info.commit_url
    assert [c.repo_id for c in fake_hub.commits] == ["tester/direct"]
    assert fake_hub.commits[0].files == folder_files(saved_local)


def test_failing_commit_raises_push_error_folder_intact(local_result, fake_hub, all_logs, capsys,
                                                       tmp_path) -> None:
    fake_hub.fail_commits(500)
    target = tmp_path / "merged"
    with pytest.raises(PushError) as info:
        local_result.save_pretrained(target, push_to_hub=True, repo_id="tester/merged", token=TOKEN)
    message = str(info.value)
    assert "tester/merged" in message and "retry" in message.lower() and "intact" in message
    assert str(target) in message  # the retry hint names the folder to push again
    assert TOKEN not in message
    assert TOKEN not in "".join(traceback.format_exception(info.value))
    assert isinstance(info.value, RuntimeError)
    # the commit was attempted once (no silent partial retry) and nothing was accepted
    assert len(fake_hub.commit_attempts) == 1 and fake_hub.commits == []
    # the local folder is complete and unchanged, and can be pushed again once the Hub is back
    files = folder_files(target)
    assert {"config.json", "model.safetensors", "README.md", MERGE_CONFIG_NAME} <= set(files)
    assert files == fake_hub.commit_attempts[0].files
    fake_hub.reset()
    push_folder(target, "tester/merged", token=TOKEN)
    assert fake_hub.commits[0].files == files
    assert_token_only_in_auth_headers(fake_hub)
    assert_no_token_output(all_logs, capsys)


def test_push_error_redacts_token_echoed_by_server(saved_local, fake_hub, monkeypatch) -> None:
    """Even if the server echoes the Authorization header back in its error, the token does not reach the user."""
    fake_hub.echo_auth_errors("/commit/", 500)
    with pytest.raises(PushError) as info:
        push_folder(saved_local, "tester/echo", token=TOKEN)
    assert "upstream failure" in str(info.value)
    assert TOKEN not in str(info.value)


def test_push_to_hub_failure_hint_names_an_existing_folder(local_result, fake_hub) -> None:
    """``MergeResult.push_to_hub`` writes to a temporary folder: after a failed push, the retry hint must not point
    the user at a folder that no longer exists."""
    fake_hub.fail_commits(500)
    with pytest.raises(PushError) as info:
        local_result.push_to_hub("tester/merged", token=TOKEN)
    message = str(info.value)
    assert TOKEN not in message
    assert "retry" in message.lower()
    claimed = re.findall(r"local folder '([^']+)' is intact", message)
    for folder in claimed:
        assert Path(folder).is_dir(), (
            f"PushError says the local folder {folder!r} is intact, but push_to_hub already deleted it: {message}")


def test_rejected_yaml_fails_before_any_commit(local_result, fake_hub, all_logs, capsys, tmp_path) -> None:
    fake_hub.reject_yaml(['"base_model" is not a valid model id'])
    target = tmp_path / "merged"
    with pytest.raises(PushError) as info:
        local_result.save_pretrained(target, push_to_hub=True, repo_id="tester/merged", token=TOKEN)
    message = str(info.value)
    assert "metadata" in message.lower() and "base_model" in message and TOKEN not in message
    assert "validate-yaml" in fake_hub.routes
    assert "preupload" not in fake_hub.routes and "commit" not in fake_hub.routes
    assert fake_hub.commit_attempts == []
    assert (target / "README.md").exists() and (target / "model.safetensors").exists()
    assert_no_token_output(all_logs, capsys)


# --------------------------------------------------------------------------------------------------------------------
# 3. push_folder refuses what is not a saved merge, before any request
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["weights", "config"])
def test_push_folder_refuses_incomplete_folder(saved_local, fake_hub, tmp_path, missing) -> None:
    folder = tmp_path / "partial"
    shutil.copytree(saved_local, folder)
    if missing == "weights":
        for p in folder.glob("*.safetensors"):
            p.unlink()
    else:
        (folder / "config.json").unlink()
    before = folder_files(folder)
    with pytest.raises(PushError, match="not a regular file inside the folder"):
        push_folder(folder, "tester/partial", token=TOKEN)
    assert fake_hub.requests == []
    assert folder_files(folder) == before


def test_push_folder_refuses_a_file_or_missing_folder(saved_local, fake_hub, tmp_path) -> None:
    with pytest.raises(PushError, match="not a folder"):
        push_folder(saved_local / "config.json", "tester/x", token=TOKEN)
    with pytest.raises(PushError, match="not a folder"):
        push_folder(tmp_path / "absent", "tester/x", token=TOKEN)
    assert fake_hub.requests == []


@pytest.mark.parametrize("readme", ["---\nbase_model: [unclosed\nlicense: mit\n---\n# card\n",
                                    "---\n- a\n- b\n---\n# card\n"], ids=["yaml-syntax", "not-a-mapping"])
def test_push_folder_refuses_broken_card_yaml(saved_local, fake_hub, tmp_path, readme) -> None:
    folder = tmp_path / "broken"
    shutil.copytree(saved_local, folder)
    (folder / "README.md").write_text(readme)
    with pytest.raises(PushError, match="invalid YAML metadata") as info:
        push_folder(folder, "tester/broken", token=TOKEN)
    assert TOKEN not in str(info.value)
    assert fake_hub.requests == []
    assert (folder / "README.md").read_text() == readme


# --------------------------------------------------------------------------------------------------------------------
# 4. Resolution records the weights file; the fake Hub's read routes answer as huggingface_hub expects
# --------------------------------------------------------------------------------------------------------------------


def test_resolved_refs_name_their_weights_file(offline_cache, tiny_paths) -> None:
    ref = resolve_model("org/ft1")
    assert (ref.weights_file, ref.weights_ref) == ("model.safetensors", None)
    assert ref.to_dict() == {"repo_id": "org/ft1", "revision": SHAS["org/ft1"], "name": "org/ft1",
                             "weights_file": "model.safetensors", "weights_ref": None}
    assert resolve_model(tiny_paths[0]).weights_file == "model.safetensors"


def test_fake_hub_read_routes(fake_hub, tmp_path, monkeypatch) -> None:
    from huggingface_hub import HfApi, HfFileSystem, constants, hf_hub_download, snapshot_download

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    first = fake_hub.add_repo("org/m", {"config.json": b"{}", "weights/a.bin": b"x" * 10, "README.md": "# m"})
    num = fake_hub.open_pr("org/m", {"model.safetensors": b"sf"}, title="convert", author="bot")
    second = fake_hub.add_commit("org/m", {"README.md": "# m2"}, message="readme")
    api = HfApi(token=TOKEN)
    info = api.model_info("org/m", files_metadata=True)
    assert info.sha == second and {s.rfilename for s in info.siblings} == {"config.json", "weights/a.bin", "README.md"}
    lfs = next(s for s in info.siblings if s.rfilename == "weights/a.bin").lfs
    assert lfs.sha256 == hashlib.sha256(b"x" * 10).hexdigest() and lfs.size == 10
    assert [c.commit_id for c in api.list_repo_commits("org/m")] == [second, first]
    assert api.list_repo_commits("org/m", revision=f"refs/pr/{num}")[1].commit_id == first
    refs = api.list_repo_refs("org/m", include_pull_requests=True)
    assert [(b.name, b.target_commit) for b in refs.branches] == [("main", second)]
    assert [r.ref for r in refs.pull_requests] == ["refs/pr/1"]
    assert [(d.num, d.author, d.git_reference) for d in api.get_repo_discussions("org/m", author="bot")] == [
        (1, "bot", "refs/pr/1")]
    assert api.get_discussion_details("org/m", 1).target_branch == "refs/heads/main"
    assert [f.path for f in api.list_repo_tree("org/m")] == ["README.md", "config.json", "weights"]
    assert [p.path for p in api.get_paths_info("org/m", ["config.json", "weights", "nope"])] == ["config.json",
                                                                                                 "weights"]
    assert api.file_exists("org/m", "model.safetensors", revision="refs/pr/1")
    assert not api.file_exists("org/m", "model.safetensors")
    assert Path(hf_hub_download("org/m", "model.safetensors", revision="refs/pr/1")).read_bytes() == b"sf"
    folder = Path(snapshot_download("org/m", allow_patterns=["*.md"]))
    assert folder.name == second and (folder / "README.md").read_text() == "# m2"
    fs = HfFileSystem(token=TOKEN)
    with fs.open("org/m/weights/a.bin", "rb") as handle:  # ranged reads, as datasets streams parquet
        handle.seek(4)
        assert handle.read(3) == b"xxx"
    from huggingface_hub.errors import RevisionNotFoundError

    with pytest.raises(RevisionNotFoundError):
        api.model_info("org/m", revision="nope")
    assert not [r for r in fake_hub.requests if r.route == "unknown" and "agent" not in r.path]


def test_pushed_commits_are_served_back(local_result, fake_hub, tmp_path, monkeypatch) -> None:
    from huggingface_hub import HfApi, constants, snapshot_download

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    info = local_result.push_to_hub("tester/served", token=TOKEN)
    folder = Path(snapshot_download("tester/served", token=TOKEN))
    assert folder.name == info.oid
    assert folder_files(folder) == fake_hub.commits[0].files
    pr = HfApi(token=TOKEN).upload_file(path_or_fileobj=b"note", path_in_repo="NOTE.md", repo_id="tester/served",
                                        create_pr=True)
    assert pr.pr_revision == "refs/pr/1"
    pr_files = {s.rfilename for s in HfApi().model_info("tester/served", revision="refs/pr/1").siblings}
    assert pr_files == set(fake_hub.commits[0].files) | {"NOTE.md"}
