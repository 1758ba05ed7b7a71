"""``inference_worker.tests.support.models.cached_reference``: computed once per key, read back exactly,
recomputed when the key or the installed torch/transformers version changes; ``file_sha256`` is the file's
sha256."""

import hashlib
import importlib.metadata

import pytest
import torch

from inference_worker.tests.support import models
from inference_worker.tests.support.models import cached_reference, file_sha256


def test_same_key_reads_back_the_stored_value_without_recomputing(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRY_TEST_CACHE", str(tmp_path))
    calls = []

    def compute():
        calls.append(1)
        return [(torch.arange(5, dtype=torch.float32) / 3, [7, 8, 9], [0.5, 1e-3])]

    first = cached_reference("demo", {"sha": "ab", "prompts": [[1, 2, 3]]}, compute)
    second = cached_reference("demo", {"prompts": [[1, 2, 3]], "sha": "ab"}, compute)  # key order is irrelevant
    assert len(calls) == 1
    assert torch.equal(second[0][0], first[0][0]) and second[0][1:] == ([7, 8, 9], [0.5, 1e-3])
    assert [p.name.startswith("demo-") and p.suffix == ".pt" for p in tmp_path.iterdir()] == [True]


def test_a_different_key_or_library_version_recomputes(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRY_TEST_CACHE", str(tmp_path))
    calls = []

    def compute():
        calls.append(1)
        return len(calls)

    assert cached_reference("demo", {"prompts": [[1]]}, compute) == 1
    assert cached_reference("demo", {"prompts": [[2]]}, compute) == 2
    real_version = importlib.metadata.version
    monkeypatch.setattr(models.importlib.metadata, "version",
                        lambda dist: "0.0-other" if dist == "transformers" else real_version(dist))
    assert cached_reference("demo", {"prompts": [[1]]}, compute) == 3
    monkeypatch.undo()
    monkeypatch.setenv("FERRY_TEST_CACHE", str(tmp_path))
    assert cached_reference("demo", {"prompts": [[1]]}, compute) == 1  # the first entry is still there
    assert len(calls) == 3 and len(list(tmp_path.iterdir())) == 3


def test_a_corrupt_entry_is_recomputed_and_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRY_TEST_CACHE", str(tmp_path))
    assert cached_reference("demo", {"k": 1}, lambda: 41) == 41
    (entry,) = tmp_path.iterdir()
    entry.write_bytes(b"not a torch file")
    with pytest.warns(UserWarning, match="recomputing the unreadable cached reference"):
        assert cached_reference("demo", {"k": 1}, lambda: 42) == 42
    assert cached_reference("demo", {"k": 1}, lambda: 43) == 42


def test_file_sha256_is_the_sha256_of_the_bytes(tmp_path):
    path = tmp_path / "weights.bin"
    data = bytes(range(256)) * 40_000  # crosses the 4 MiB read size
    path.write_bytes(data)
    assert file_sha256(path) == hashlib.sha256(data).hexdigest()
    path.write_bytes(data + b"x")  # new size: hashed again
    assert file_sha256(path) == hashlib.sha256(data + b"x").hexdigest()
