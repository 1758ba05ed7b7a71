"""Tests for inference_worker.config: parsing HF/GGUF configs, the KV accounting formula, and that the package
stays torch-free and below ``inference_worker.model``."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import inference_worker.config
from inference_worker.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    derive_layer_types,
    kv_bytes,
    kv_bytes_per_token,
)
from inference_worker.registry import gguf_path

GEMMA_HF = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "num_hidden_layers": 18,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "vocab_size": 262144,
    "max_position_embeddings": 32768,
    "sliding_window": 512,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "torch_dtype": "bfloat16",
    "eos_token_id": [1, 106],
    "bos_token_id": 2,
}


@pytest.fixture(scope="module")
def gemma():
    return ModelConfig.from_gguf(gguf_path("gemma-3-270m"))


def test_gemma3_gguf_config_matches_the_published_architecture(gemma):
    assert gemma.architecture == "gemma3"
    assert gemma.num_hidden_layers == 18
    assert (gemma.num_sliding_layers, gemma.num_full_layers) == (15, 3)
    assert [i for i, t in enumerate(gemma.layer_types) if t == FULL_ATTENTION] == [5, 11, 17]
    assert gemma.sliding_window == 512
    assert (gemma.num_attention_heads, gemma.num_key_value_heads, gemma.head_dim) == (4, 1, 256)
    assert gemma.rope_base(FULL_ATTENTION) == 1_000_000.0
    assert gemma.rope_base(SLIDING_ATTENTION) == 10_000.0
    assert gemma.vocab_size == 262144
    assert gemma.tie_word_embeddings is True
    assert gemma.query_pre_attn_scalar == 256.0
    assert gemma.hidden_activation == "gelu_pytorch_tanh"
    assert (gemma.bos_token_id, gemma.eos_token_ids) == (2, (1,))


def test_gemma3_kv_accounting_matches_design_figures(gemma):
    assert gemma.kv_bytes_per_token(FULL_ATTENTION) == 1024
    assert gemma.kv_bytes_per_token(SLIDING_ATTENTION, dtype_bytes=4) == 2048
    assert gemma.kv_bytes(8192) == 33030144
    assert gemma.kv_bytes(8192, hybrid=False) == 150994944
    assert gemma.kv_bytes(32768) == 108527616
    assert gemma.kv_bytes(32768, hybrid=False) == 603979776
    # below the window, hybrid and dense are the same
    assert gemma.kv_bytes(512) == gemma.kv_bytes(512, hybrid=False) == 18 * 512 * 1024
    assert gemma.kv_bytes(513) == 1024 * (3 * 513 + 15 * 512)


def test_module_level_kv_bytes_is_the_same_formula(gemma):
    plain = kv_bytes(
        8192, num_full_layers=3, num_sliding_layers=15, sliding_window=512, num_kv_heads=1, head_dim=256
    )
    assert plain == gemma.kv_bytes(8192) == 33030144
    assert kv_bytes_per_token(num_kv_heads=3, head_dim=64, dtype_bytes=4) == 1536
    with pytest.raises(ValueError, match="sliding_window"):
        kv_bytes(10, num_full_layers=0, num_sliding_layers=2, sliding_window=None, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="num_tokens"):
        kv_bytes(-1, num_full_layers=1, num_sliding_layers=0, sliding_window=None, num_kv_heads=1, head_dim=8)


def test_smollm2_gguf_is_dense_llama_with_gqa():
    cfg = ModelConfig.from_gguf(gguf_path("smollm2-135m-instruct"))
    assert cfg.architecture == "llama"
    assert cfg.layer_types == (FULL_ATTENTION,) * 30
    assert cfg.sliding_window is None
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.rope_theta == 100000.0
    assert cfg.rope_base(SLIDING_ATTENTION) == 100000.0
    assert cfg.kv_bytes(1000) == cfg.kv_bytes(1000, hybrid=False) == 30 * 1000 * 2 * 3 * 64 * 2


def test_hf_config_parses_and_round_trips(gemma):
    cfg = ModelConfig.from_hf_config(GEMMA_HF)
    assert cfg.layer_types == gemma.layer_types
    assert cfg.dtype == "bfloat16"
    assert cfg.eos_token_ids == (1, 106)
    assert ModelConfig.from_hf_config(json.loads(json.dumps(cfg.to_hf_config()))) == cfg
    assert json.loads(json.dumps(cfg.to_dict()))["num_sliding_layers"] == 15


def test_hf_config_with_explicit_layer_types_and_rope_parameters():
    data = dict(GEMMA_HF, num_hidden_layers=3, layer_types=["full_attention", "sliding_attention", "full_attention"],
                rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    cfg = ModelConfig.from_hf_config(data)
    assert cfg.layer_types == (FULL_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION)
    assert cfg.rope_scaling(FULL_ATTENTION) == 8.0
    assert cfg.rope_scaling(SLIDING_ATTENTION) == 1.0
    assert cfg.kv_bytes(1000) == 1024 * (2 * 1000 + 512)


def test_multimodal_gemma3_config_uses_text_config():
    cfg = ModelConfig.from_hf_config({"model_type": "gemma3", "text_config": GEMMA_HF, "eos_token_id": [1, 106]})
    assert cfg.num_sliding_layers == 15


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "mamba"}, "unsupported model_type 'mamba'"),
        ({"num_attention_heads": 3}, "multiple of num_key_value_heads|must be a multiple"),
        ({"sliding_window": None, "layer_types": ['sliding_attention'] * 18}, "sliding_window"),
        ({"layer_types": ["full_attention"] * 17}, "17 entries"),
        ({"num_key_value_heads": 0}, "num_key_value_heads"),
        ({"torch_dtype": "int8"}, "dtype must be one of"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4}, "rope_theta": 1e6}, "unsupported rope_type 'yarn'"),
        # before: a 10**12-entry layer_types tuple (a registration hung and ran the machine out of memory)
        ({"num_hidden_layers": 10**12}, r"num_hidden_layers must be an integer in 1\.\.4096, got 1000000000000"),
        ({"num_hidden_layers": 0}, r"num_hidden_layers must be an integer in 1\.\.4096, got 0"),
    ],
)
def test_invalid_configs_raise_value_error(change, message):
    data = dict(GEMMA_HF, **change)
    if change.get("num_attention_heads") == 3:
        data["num_key_value_heads"] = 2
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(data)


def test_derive_layer_types_rules():
    assert derive_layer_types("gemma3", 7, 4) == (SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION, SLIDING_ATTENTION)
    assert derive_layer_types("llama", 2, None) == (FULL_ATTENTION,) * 2
    with pytest.raises(ValueError, match="unsupported architecture 'qwen3'"):
        derive_layer_types("qwen3", 2, None)


def test_config_package_imports_with_torch_blocked():
    # sys.modules["torch"] = None makes any ``import torch`` raise ImportError: the package must not need it
    code = ("import sys; sys.modules['torch'] = None; import inference_worker.config as c; "
            f"print(c.ModelConfig.from_hf_config({GEMMA_HF!r}).num_sliding_layers, sorted(m for m in sys.modules "
            "if m.startswith('inference_worker.model')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "15 []"


def _imported_modules(path: Path) -> set[str]:
    """Every module an ``import``/``from ... import`` anywhere in ``path`` names (function-local ones too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_config_package_never_imports_the_model_package():
    package = Path(inference_worker.config.__file__).parent
    sources = sorted(package.glob("*.py"))
    assert [p.name for p in sources] == ["__init__.py", "architecture.py", "gguf.py", "gguf_header.py", "hf.py",
                                         "model_config.py"]
    offending = {p.name: sorted(m for m in _imported_modules(p) if m.split(".")[0] == "torch"
                                or m == "inference_worker.model" or m.startswith("inference_worker.model."))
                 for p in sources}
    assert offending == {p.name: [] for p in sources}


def test_ast_scan_sees_function_local_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from inference_worker.model.loader import load_model\n    import torch\n")
    assert _imported_modules(probe) == {"inference_worker.model.loader", "inference_worker.model.loader.load_model",
                                        "torch"}
