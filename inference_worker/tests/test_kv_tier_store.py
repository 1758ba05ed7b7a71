"""KV tier stores and records without a model (issue 17): budgets, idle expiry, option parsing, and every
reason a record is refused."""

import argparse
import os

import pytest

from inference_worker.cli.serve import add_arguments, tier_stores
from inference_worker.engine.kv_tier_record import (
    RecordError,
    RecordHeader,
    decode_record,
    encode_record,
    read_header_unverified,
    tier_key,
)
from inference_worker.engine.kv_tier_store import DirectoryKVStore, MemoryKVStore, parse_store_spec

KEYS = [f"{k:02x}" * 32 for k in range(6)]


@pytest.fixture(params=["memory", "directory"])
def store(request, tmp_path):
    return MemoryKVStore(300) if request.param == "memory" else DirectoryKVStore(tmp_path / "kv", 300)


def test_a_put_past_the_budget_evicts_the_longest_idle_entries(store):
    for i, key in enumerate(KEYS[:3]):
        assert store.put(key, bytes([i]) * 100) == []
        store.touch(key, 1000.0 + i)  # write times 1000, 1001, 1002
    store.touch(KEYS[0], 2000.0)  # KEYS[0] read last: KEYS[1] is now the longest idle
    assert store.put(KEYS[3], b"x" * 150) == [KEYS[1], KEYS[2]]
    assert sorted(e.key for e in store.entries()) == sorted([KEYS[0], KEYS[3]])
    assert store.usage_bytes == 250
    assert store.get(KEYS[0]) == bytes([0]) * 100 and store.get(KEYS[1]) is None
    with pytest.raises(ValueError, match="does not fit"):
        store.put(KEYS[4], b"y" * 301)
    with pytest.raises(ValueError, match="hex"):
        store.put("../etc/passwd", b"z")


def test_expiry_counts_idle_time_from_the_last_read_or_write(store):
    store.put(KEYS[0], b"a")
    store.put(KEYS[1], b"b")
    store.touch(KEYS[0], 1000.0)
    store.touch(KEYS[1], 1000.0)
    store.get(KEYS[1])  # read now: its idle time restarts
    entry = {e.key: e for e in store.entries()}[KEYS[1]]
    assert store.expire(60.0, now=entry.last_access_s + 30) == [KEYS[0]]
    assert [e.key for e in store.entries()] == [KEYS[1]]
    assert store.expire(60.0, now=entry.last_access_s + 61) == [KEYS[1]]
    assert store.entries() == []


def test_a_directory_store_ignores_temporary_and_foreign_files(tmp_path):
    store = DirectoryKVStore(tmp_path, 1000)
    store.put(KEYS[0], b"abc")
    (tmp_path / ".tmp-123").write_bytes(b"partial")
    (tmp_path / "notes.txt").write_bytes(b"x")
    assert [e.key for e in store.entries()] == [KEYS[0]]
    assert os.listdir(tmp_path).count(KEYS[0] + ".kvt") == 1


def test_a_file_larger_than_the_budget_is_refused_before_it_is_read(tmp_path):
    # A foreign or runaway file in a (shared) tier directory used to be read whole into memory before its checks.
    store = DirectoryKVStore(tmp_path, 100)
    store.path(KEYS[0]).write_bytes(b"x" * 101)
    store.path(KEYS[1]).write_bytes(b"y" * 100)
    with pytest.raises(RecordError) as info:
        store.get(KEYS[0])
    assert info.value.reason == "format"
    assert "101-byte disk tier file is larger than the tier's budget of 100 bytes" in str(info.value)
    assert store.get(KEYS[1]) == b"y" * 100

def test_store_specs_parse_path_and_size_and_refuse_the_rest():
    assert parse_store_spec("--kv-offload-disk", "/var/kv:2GiB") == ("/var/kv", 2 << 30)
    assert parse_store_spec("--kv-shared", "file:///mnt/kv:500MB") == ("/mnt/kv", 500_000_000)
    for bad, match in (("/var/kv", "PATH:SIZE"), ("/var/kv:0.5", "bytes with a unit"),
                       ("s3://bucket/kv:1GiB", "only file://"), (":1GiB", "PATH:SIZE")):
        with pytest.raises(ValueError, match=match):
            parse_store_spec("--kv-shared", bad)


def parse(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model", "m", "--port", "1", *argv])


def test_tier_options_need_a_secret_and_prefix_caching(tmp_path, monkeypatch):
    monkeypatch.delenv("FERRY_KV_TIER_SECRET", raising=False)
    assert tier_stores(parse([])) == []
    assert [s.tier for s in tier_stores(parse(["--kv-offload-host", "1GiB"]))] == ["host"]
    disk = ["--kv-offload-disk", f"{tmp_path}/d:1GiB"]
    with pytest.raises(ValueError, match="tier secret"):
        tier_stores(parse(disk))
    monkeypatch.setenv("FERRY_KV_TIER_SECRET", "s" * 16)
    stores = tier_stores(parse(["--kv-offload-host", "1GiB", *disk, "--kv-shared", f"file://{tmp_path}/s:2GiB"]))
    assert [(s.tier, s.budget_bytes) for s in stores] == [("host", 1 << 30), ("disk", 1 << 30), ("shared", 2 << 30)]
    with pytest.raises(ValueError, match="prefix caching"):
        tier_stores(parse([*disk, "--no-prefix-caching"]))
    with pytest.raises(ValueError, match="--kv-entry-ttl"):
        tier_stores(parse([*disk, "--kv-entry-ttl", "0"]))


@pytest.mark.parametrize(("option", "value"), [
    ("--kv-offload-host", "0"), ("--kv-offload-host", "lots"), ("--kv-offload-host", "0.5"),
    ("--kv-offload-disk", "{tmp}/d:0"), ("--kv-offload-disk", "{tmp}/d:-1GiB"), ("--kv-offload-disk", "{tmp}/d:lots"),
    ("--kv-offload-disk", "{tmp}/file/d:1GiB"), ("--kv-offload-disk", "{tmp}/file:1GiB"),
    ("--kv-shared", "file://{tmp}/file:1GiB"), ("--kv-shared", "file://{tmp}/s:0.5"),
])
def test_every_bad_tier_option_is_a_value_error_naming_that_option(tmp_path, monkeypatch, option, value):
    # A size the KV cache parser refuses used to be reported as "--kv-cache-memory ..."; a path that cannot be a
    # directory (a file, under a file) was a bare NotADirectoryError/FileExistsError traceback at start.
    monkeypatch.setenv("FERRY_KV_TIER_SECRET", "s" * 16)
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(ValueError) as info:
        tier_stores(parse([option, value.format(tmp=tmp_path)]))
    assert str(info.value).startswith(option), str(info.value)


HEADER = RecordHeader("m", "ab" * 32, "float32", 2, 1, 2, 3, (5, 6, 7), (None, 4), (0, 1))
LAYERS = [(b"K" * 24, b"V" * 24), (b"k" * 16, b"v" * 16)]  # 3 and 2 rows of 1 head x 2 float32


def test_a_record_round_trips_and_each_defect_has_its_reason():
    key = tier_key(b"0123456789abcdef")
    data = encode_record(HEADER, LAYERS, key)
    header, body = decode_record(data, key)
    assert header == HEADER and bytes(body) == b"".join(k + v for k, v in LAYERS)
    assert read_header_unverified(data) == HEADER
    flipped = bytearray(data)
    flipped[-40] ^= 1
    cases = {"truncated": data[:-1], "format": data + b"x", "signature": bytes(flipped)}
    cases["signature-key"] = data
    for reason, payload in cases.items():
        with pytest.raises(RecordError) as info:
            decode_record(payload, tier_key(b"another secret!!") if reason == "signature-key" else key)
        assert info.value.reason == reason.removesuffix("-key")
    with pytest.raises(RecordError) as info:
        decode_record(b"NOPE" + data[4:], key)
    assert info.value.reason == "format"
    with pytest.raises(ValueError, match="16 bytes"):
        tier_key(b"short")
