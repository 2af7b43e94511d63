"""The README's test command stays offline: with the package index and the Hub unreachable and no peer environment
built, the peer tests skip with the command that builds their environments, open no connection beyond loopback and
create nothing in the peer-environment folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # runs the peer tests in a child pytest: the slow tier

# Loaded into the child pytest with -p: every connection to an address other than loopback is recorded and refused.
_NO_NETWORK_PLUGIN = '''
import os
import socket

_connect, _connect_ex = socket.socket.connect, socket.socket.connect_ex
_LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _check(address):
    if isinstance(address, tuple) and address[0] not in _LOOPBACK:
        with open(os.environ["OFFLINE_TEST_NETWORK_LOG"], "a") as log:
            log.write(f"{address!r}\\n")
        raise OSError(f"network access to {address!r} during the offline test command")


def connect(self, address):
    _check(address)
    return _connect(self, address)


def connect_ex(self, address):
    _check(address)
    return _connect_ex(self, address)


socket.socket.connect, socket.socket.connect_ex = connect, connect_ex
'''


def test_the_test_command_builds_no_peer_environment_and_stays_offline(tmp_path):
    envs = tmp_path / "peer-envs"
    envs.mkdir()
    (tmp_path / "no_network_plugin.py").write_text(_NO_NETWORK_PLUGIN)
    network_log = tmp_path / "network.log"
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "HF_MLOSS_BUILD_PEER_ENVS")}
    env.update(HF_MLOSS_PEER_ENVS=str(envs), PIP_INDEX_URL="http://127.0.0.1:9/", PIP_NO_INDEX="1",
               HF_HUB_OFFLINE="1", OFFLINE_TEST_NETWORK_LOG=str(network_log),
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "-p", "no_network_plugin", "--basetemp", str(tmp_path / "pytest"), "--tier", "all",
                           "tests/test_peers.py"],
                          check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert " skipped" in out and "passed" not in out and "failed" not in out, out[-3000:]
    assert list(envs.iterdir()) == [], "the test command created peer environments"
    assert not network_log.exists(), network_log.read_text()
    # every skip names the command that builds what is missing, the tests that no name-based rule catches included
    assert "python benchmarks/peers/setup_envs.py fusion_bench" in out
    assert "python benchmarks/peers/setup_envs.py mergekit" in out
    for line in (line for line in out.splitlines() if line.startswith("SKIPPED")):
        assert "benchmarks/peers/setup_envs.py" in line, line


def test_ensure_env_under_the_test_command_skips_a_missing_environment(tmp_path, monkeypatch):
    """Called from any test, whatever its name, a missing environment is a skip with the build command, not a build;
    with CI set the call goes through to the real builder (a missing environment there is a failure)."""
    setup_envs = pytest.importorskip("benchmarks.peers.setup_envs", reason="run from the repository root")
    monkeypatch.setenv("HF_MLOSS_PEER_ENVS", str(tmp_path))
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("HF_MLOSS_BUILD_PEER_ENVS", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"python benchmarks/peers/setup_envs.py fusion_bench"):
        setup_envs.ensure_env("fusion-bench")
    assert list(tmp_path.iterdir()) == []
