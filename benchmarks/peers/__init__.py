"""Peer merging libraries (mergekit, fusion-bench) run in their own venvs for parity benchmarks.

See ``setup_envs.py`` (venv creation) and ``run_peer.py`` (running a merge).
"""
