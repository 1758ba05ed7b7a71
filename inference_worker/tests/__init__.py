"""Tests of the inference worker (a package so that :mod:`.support` is importable by the apps' tests too)."""
