"""Offline benchmark suites."""
