"""Loader behaviour: sha256 verification, unsupported GGUF architectures, prepare idempotency, GGUF conventions."""

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from inference_worker.config import ModelConfig, read_gguf_header
from inference_worker.model.gguf_weights import hf_name, unpermute_llama_qk
from inference_worker.model.loader import WeightsHashMismatch, load_model, verify_sha256
from inference_worker.model.prepare import prepare_model, read_manifest, weights_sha256
from inference_worker.registry import resolve_model, split_dtype_suffix
from inference_worker.tests.support.models import GEMMA, SMOLLM2, prepared_model_dir

torch.set_num_threads(1)


def _tiny_gguf(path, arch):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_of_unsupported_architecture_is_a_clear_error_naming_it(tmp_path):
    path = _tiny_gguf(tmp_path / "mamba.gguf", "mamba")
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'mamba'.*supported: gemma3, llama"):
        ModelConfig.from_gguf(path)
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'mamba'"):
        load_model(str(path), load_tokenizer=False)


def test_header_reader_reads_what_gguf_writer_wrote(tmp_path):
    path = _tiny_gguf(tmp_path / "tiny.gguf", "llama")
    header = read_gguf_header(path)
    assert header.metadata["general.architecture"] == "llama"
    assert header.metadata["llama.embedding_length"] == 8
    assert [(t.name, t.shape) for t in header.tensors] == [("token_embd.weight", (8, 4))]
    info = header.tensors[0]
    data = np.memmap(path, dtype=np.float32, mode="r", offset=info.offset, shape=(4, 8))
    assert data[3, 7] == 31.0


def test_not_a_gguf_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 32)
    with pytest.raises(ValueError, match="is not a GGUF file"):
        ModelConfig.from_gguf(bad)


def test_wrong_sha256_refuses_to_load_and_names_both_hashes():
    directory = prepared_model_dir(SMOLLM2)
    actual = read_manifest(directory)["sha256"]
    wrong = "0" * 64
    with pytest.raises(WeightsHashMismatch) as info:
        load_model(str(directory), sha256=wrong)
    assert wrong in str(info.value) and actual in str(info.value)
    assert verify_sha256(directory, actual.upper()) == actual


def test_right_sha256_loads_and_is_reported():
    directory = prepared_model_dir(SMOLLM2)
    sha = read_manifest(directory)["sha256"]
    assert weights_sha256(directory) == sha
    loaded = load_model(str(directory), sha256=sha)
    assert loaded.sha256 == sha
    assert loaded.config.architecture == "llama"
    assert loaded.eos_token_ids == (2,)
    assert loaded.tokenizer.encode("Hello world").ids == [19556, 905]


def test_prepare_is_idempotent_and_the_artifact_is_an_hf_directory():
    first = prepare_model(GEMMA)
    again = prepare_model(GEMMA)
    assert again.created is False
    assert (again.path, again.sha256) == (first.path, first.sha256)
    config = json.loads((again.path / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert config["layer_types"].count("full_attention") == 3
    generation = json.loads((again.path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 106]  # <eos> and <end_of_turn>


def test_bf16_artifact_is_distinct_with_its_own_hash():
    fp32 = prepare_model(GEMMA)
    bf16 = prepare_model(f"{GEMMA}@bf16")
    assert bf16.name == "gemma-3-270m@bf16" and bf16.dtype == "bfloat16"
    assert bf16.path != fp32.path and bf16.sha256 != fp32.sha256
    assert (bf16.path / "model.safetensors").stat().st_size < 0.6 * (fp32.path / "model.safetensors").stat().st_size


def test_model_values_resolve():
    assert split_dtype_suffix("gemma-3-270m@bf16") == ("gemma-3-270m", "bfloat16")
    assert resolve_model(GEMMA).kind == "builtin"
    assert resolve_model(str(prepared_model_dir(GEMMA))).kind == "hf_dir"
    with pytest.raises(ValueError, match="unknown dtype suffix"):
        split_dtype_suffix("gemma-3-270m@int4")
    with pytest.raises(ValueError, match="neither a built-in model"):
        resolve_model("no-such-model")


def test_gguf_name_mapping_and_llama_unpermute():
    assert hf_name("blk.3.ffn_norm.weight", "llama") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_name("blk.3.ffn_norm.weight", "gemma3") == "model.layers.3.pre_feedforward_layernorm.weight"
    assert hf_name("blk.0.post_attention_norm.weight", "gemma3") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("output_norm.weight", "gemma3") == "model.norm.weight"
    with pytest.raises(ValueError, match="unknown GGUF tensor"):
        hf_name("blk.0.ssm_conv.weight", "llama")
    # one head of dim 4: llama.cpp stores rows (0, 2, 1, 3) of the HF layout
    stored = np.array([[0.0], [2.0], [1.0], [3.0]])
    assert unpermute_llama_qk(stored, 1)[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_cli_models_prepare_and_info():
    out = subprocess.run([sys.executable, "-m", "inference_worker", "models", "prepare", GEMMA],
                         capture_output=True, text=True, check=True)
    assert "gemma-3-270m: already prepared" in out.stdout
    assert f"sha256={prepare_model(GEMMA).sha256}" in out.stdout
    info = subprocess.run([sys.executable, "-m", "inference_worker", "models", "info", GEMMA, "--tokens", "32768"],
                          capture_output=True, text=True, check=True)
    data = json.loads(info.stdout)
    assert data["kv_bytes"] == {"num_tokens": 32768, "hybrid": 108527616, "all_full": 603979776}
    bad = subprocess.run([sys.executable, "-m", "inference_worker", "models", "prepare", "nope"],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "neither a built-in model" in bad.stderr
