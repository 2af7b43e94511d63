"""Offline benchmark suites: small vision towers pretrained and fine-tuned in-process on data that packages ship."""
