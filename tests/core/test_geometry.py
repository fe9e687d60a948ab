import pytest
from conftest import load_config

from hicache import KVGeometry
from hicache.geometry import DTYPES

# config, kwargs, layer_num, head_num, head_dim, v_head_dim, k_row_bytes, v_row_bytes, token_bytes
EXPECTED = [
    ("mimo_v2_flash", {"group": "full"}, 9, 4, 192, 128, 1536, 1024, 23040),
    ("mimo_v2_flash", {"group": "swa"}, 39, 8, 192, 128, 3072, 2048, 199680),
    ("mimo_v2_flash", {"group": "full", "dtype": "fp4_e2m1"}, 9, 4, 192, 128, 432, 288, 9 * 720),
    ("deepseek_v3", {}, 61, 1, 576, 0, 1152, 0, 70272),
    ("llama_3_1_8b", {"tp_size": 2}, 32, 4, 128, 128, 1024, 1024, 65536),
    ("qwen3_8b", {}, 36, 8, 128, 128, 2048, 2048, 147456),
]


@pytest.mark.parametrize("name,kwargs,layers,heads,hd,vhd,kb,vb,tb", EXPECTED)
def test_fixture_configs(name, kwargs, layers, heads, hd, vhd, kb, vb, tb):
    g = KVGeometry.from_hf_config(load_config(name), **kwargs)
    assert (g.layer_num, g.head_num, g.head_dim, g.v_head_dim) == (layers, heads, hd, vhd)
    assert (g.k_row_bytes, g.v_row_bytes, g.token_bytes) == (kb, vb, tb)
    assert g.page_bytes == tb * 64
    assert len(g.layer_ids) == layers


def test_mimo_layer_ids(mimo_config):
    full = KVGeometry.from_hf_config(mimo_config, group="full")
    swa = KVGeometry.from_hf_config(mimo_config, group="swa")
    assert full.layer_ids == (0, 5, 11, 17, 23, 29, 35, 41, 47)
    assert sorted(full.layer_ids + swa.layer_ids) == list(range(48))
    assert full.local_layer(11) == 2
    with pytest.raises(KeyError, match="model layer 1 "):
        full.local_layer(1)


def test_buffers_mha_fp4():
    g = KVGeometry(layer_num=2, head_num=4, head_dim=192, v_head_dim=128, dtype="fp4_e2m1")
    shapes = {b.name: (b.row_shape, b.storage_dtype, b.row_bytes) for b in g.buffers}
    assert shapes == {
        "k": ((4, 96), "uint8", 384),
        "v": ((4, 64), "uint8", 256),
        "k_scale": ((4, 12), "uint8", 48),
        "v_scale": ((4, 8), "uint8", 32),
    }


def test_buffers_mla_fp8():
    g = KVGeometry(attention="mla", layer_num=3, head_num=1, kv_lora_rank=512, qk_rope_head_dim=64, dtype="fp8_e4m3")
    assert g.dtype == "float8_e4m3fn"
    assert [(b.name, b.row_shape, b.storage_dtype) for b in g.buffers] == [("kv", (1, 576), "uint8")]
    assert (g.k_row_bytes, g.v_row_bytes, g.token_bytes) == (576, 0, 3 * 576)


def test_mla_ignores_model_v_and_nope_dims():
    a = load_config("deepseek_v3")
    b = dict(a, v_head_dim=999, qk_nope_head_dim=7)
    assert KVGeometry.from_hf_config(a) == KVGeometry.from_hf_config(b)


def test_mla_replicated_across_tp():
    g = KVGeometry.from_hf_config(load_config("deepseek_v3"), tp_size=8)
    assert g.head_num == 1 and g.k_row_bytes == 1152


@pytest.mark.parametrize(
    "dtype,kb",
    [
        ("bfloat16", 1024),
        ("float16", 1024),
        ("float32", 2048),
        ("float8_e4m3fn", 512),
        ("float8_e5m2", 512),
        ("fp4_e2m1", 256 + 32),
    ],
)
def test_dtype_sizes(dtype, kb):
    assert KVGeometry(layer_num=1, head_num=4, head_dim=128, v_head_dim=128, dtype=dtype).k_row_bytes == kb
    assert dtype in DTYPES


def test_text_config_is_used():
    inner = load_config("qwen3_8b")
    wrapped = {"model_type": "llava", "text_config": inner, "num_hidden_layers": 3}
    assert KVGeometry.from_hf_config(wrapped) == KVGeometry.from_hf_config(inner)


def test_head_dim_fallback_and_v_default():
    cfg = {"num_hidden_layers": 2, "hidden_size": 1024, "num_attention_heads": 8}
    g = KVGeometry.from_hf_config(cfg)
    assert (g.head_num, g.head_dim, g.v_head_dim) == (8, 128, 128)


def test_gemma3_sliding_window_pattern():
    cfg = {
        "text_config": {
            "num_hidden_layers": 12,
            "hidden_size": 2560,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "sliding_window_pattern": 6,
        }
    }
    assert KVGeometry.from_hf_config(cfg, group="full").layer_ids == (5, 11)
    assert KVGeometry.from_hf_config(cfg, group="swa").layer_num == 10


def test_layer_types():
    types = ["sliding_attention", "full_attention"] * 3
    cfg = {
        "num_hidden_layers": 6,
        "head_dim": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "layer_types": types,
    }
    assert KVGeometry.from_hf_config(cfg, group="full").layer_ids == (1, 3, 5)
    assert KVGeometry.from_hf_config(cfg, group="swa").layer_ids == (0, 2, 4)


def test_linear_attention_layers_hold_no_kv():
    cfg = {
        "num_hidden_layers": 4,
        "head_dim": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    }
    assert KVGeometry.from_hf_config(cfg).layer_ids == (3,)


def test_use_sliding_window_false_means_no_swa():
    with pytest.raises(ValueError, match="group 'swa' has no layers"):
        KVGeometry.from_hf_config(load_config("qwen3_8b"), group="swa")
    cfg = dict(load_config("mimo_v2_flash"), use_sliding_window=False)
    assert KVGeometry.from_hf_config(cfg).layer_num == 48


def test_swa_inherits_dims_when_not_overridden():
    cfg = {
        "num_hidden_layers": 4,
        "head_dim": 192,
        "v_head_dim": 128,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hybrid_layer_pattern": [0, 1, 1, 0],
    }
    g = KVGeometry.from_hf_config(cfg, group="swa")
    assert (g.head_dim, g.v_head_dim, g.head_num) == (192, 128, 2)


@pytest.mark.parametrize("kv,tp,expected", [(8, 1, 8), (8, 2, 4), (8, 8, 1), (8, 16, 1), (4, 32, 1)])
def test_tp_split(kv, tp, expected):
    cfg = {"num_hidden_layers": 1, "head_dim": 64, "num_attention_heads": 32, "num_key_value_heads": kv}
    assert KVGeometry.from_hf_config(cfg, tp_size=tp).head_num == expected


def test_fingerprint_and_roundtrip():
    g = KVGeometry.from_hf_config(load_config("mimo_v2_flash"))
    assert KVGeometry(**g.to_dict()) == g
    assert KVGeometry(**g.to_dict()).fingerprint == g.fingerprint
    other = KVGeometry(**dict(g.to_dict(), v_head_dim=192))
    assert other.fingerprint != g.fingerprint
    assert g.diff(other) == ["v_head_dim"]


# ---- errors: each names the field and the value ---------------------------------------------
BASE = dict(layer_num=2, head_num=4, head_dim=64, v_head_dim=64)


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"page_size": 0}, "page_size must be >= 1, got 0"),
        ({"dtype": "int4"}, "unknown KV dtype 'int4'"),
        ({"head_dim": -1}, "head_dim must be >= 1, got -1"),
        ({"v_head_dim": 0}, "v_head_dim must be >= 1, got 0"),
        ({"v_head_dim": None}, "needs both head_dim and v_head_dim"),
        ({"layer_num": 0}, "layer_num must be >= 1, got 0"),
        ({"head_num": 2.5}, "head_num must be an int, got 2.5"),
        ({"attention": "gqa"}, "attention must be 'mha' or 'mla', got 'gqa'"),
        ({"dtype": "fp4_e2m1", "head_dim": 72}, "head_dim must be divisible by 16 for fp4_e2m1, got 72"),
        ({"dtype": "fp4_e2m1", "v_head_dim": 24}, "v_head_dim must be divisible by 16 for fp4_e2m1, got 24"),
        ({"layer_ids": (0, 0)}, "layer_ids has duplicates"),
        ({"layer_ids": (0, 1, 2)}, "layer_ids has 3 entries but layer_num is 2"),
        ({"layer_ids": (0, -4)}, "layer_ids entry must be >= 0, got -4"),
        ({"kv_lora_rank": 512}, "kv_lora_rank/qk_rope_head_dim must be 0 for MHA"),
        ({"head_num": 1 << 40}, "page_bytes .* exceeds the limit"),
        ({"layer_num": 2**32 - 1}, "layer_num must be <= 65536, got 4294967295"),  # refused before any per-layer work
    ],
)
def test_geometry_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        KVGeometry(**dict(BASE, **changes))


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"head_num": 2}, "head_num must be 1 for MLA, got 2"),
        ({"kv_lora_rank": 0}, "kv_lora_rank must be >= 1 for MLA, got 0"),
        ({"head_dim": 512}, "latent width .* = 576, got 512"),
        ({"v_head_dim": 128}, "v_head_dim must be 0 for MLA"),
        ({"dtype": "fp4_e2m1", "qk_rope_head_dim": 8}, "divisible by 16 for fp4_e2m1, got 520"),
    ],
)
def test_mla_errors(changes, message):
    base = dict(attention="mla", layer_num=2, head_num=1, kv_lora_rank=512, qk_rope_head_dim=64)
    with pytest.raises(ValueError, match=message):
        KVGeometry(**dict(base, **changes))


@pytest.mark.parametrize(
    "changes,kwargs,message",
    [
        ({"num_key_value_heads": 6}, {"tp_size": 4}, "tp_size 4 and 6 KV heads: one must divide the other"),
        ({}, {"tp_size": 0}, "tp_size must be an int >= 1, got 0"),
        ({}, {"group": "local"}, "group must be one of .*, got 'local'"),
        ({}, {"page_size": 0}, "page_size must be >= 1, got 0"),
        ({}, {"dtype": "int8"}, "unknown KV dtype 'int8'"),
        (
            {"hybrid_layer_pattern": [0, 1]},
            {},
            "hybrid_layer_pattern must be a list of num_hidden_layers=48 entries, got 2",
        ),
        ({"num_hidden_layers": None}, {}, "config is missing num_hidden_layers"),
        ({"head_dim": "192"}, {}, "config head_dim must be an int, got '192'"),
        ({"head_dim": -192}, {}, "head_dim must be >= 1, got -192"),
    ],
)
def test_from_hf_config_errors(mimo_config, changes, kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVGeometry.from_hf_config(dict(mimo_config, **changes), **kwargs)


def test_mla_has_no_swa_group():
    with pytest.raises(ValueError, match="group 'swa' does not exist in an MLA model"):
        KVGeometry.from_hf_config(load_config("deepseek_v3"), group="swa")


def test_geometry_is_frozen():
    g = KVGeometry(**BASE)
    with pytest.raises(AttributeError):
        g.v_head_dim = 192  # type: ignore[misc]


LLAMA_LIKE = {"num_hidden_layers": 2, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8}


@pytest.mark.parametrize(
    "cfg,kwargs,message",
    [
        (dict(LLAMA_LIKE, num_key_value_heads=0), {}, "config num_key_value_heads must be >= 1, got 0"),
        (dict(LLAMA_LIKE, v_head_dim=0), {}, "config v_head_dim must be >= 1, got 0"),
        (dict(LLAMA_LIKE, head_dim=0), {}, "config head_dim must be >= 1, got 0"),
        (dict(LLAMA_LIKE, num_hidden_layers=0), {}, "config num_hidden_layers must be >= 1, got 0"),
        (
            dict(LLAMA_LIKE, hidden_size=4100),
            {},
            "config hidden_size 4100 is not a multiple of num_attention_heads 32",
        ),
        ({"num_hidden_layers": 2, "kv_lora_rank": 512}, {}, "config is missing qk_rope_head_dim"),
        ({"num_hidden_layers": 2, "kv_lora_rank": 0, "qk_rope_head_dim": 64}, {}, "config kv_lora_rank must be >= 1"),
        (dict(LLAMA_LIKE, text_config="x"), {}, "config text_config must be a dict, got 'x'"),
        (dict(LLAMA_LIKE, text_config=[1]), {}, r"config text_config must be a dict, got \[1\]"),
        (LLAMA_LIKE, {"dtype": ["x"]}, r"dtype must be a string, got \['x'\]"),
        (dict(LLAMA_LIKE, torch_dtype=["float16"]), {"dtype": "auto"}, r"config torch_dtype must be a string"),
    ],
)
def test_from_hf_config_refuses_what_it_cannot_read(cfg, kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVGeometry.from_hf_config(cfg, **kwargs)


def test_an_unhashable_dtype_is_a_value_error():
    with pytest.raises(ValueError, match=r"KV dtype must be a string, got \['bf16'\]"):
        KVGeometry(**dict(BASE, dtype=["bf16"]))


def test_auto_dtype_reads_the_wrapper_then_its_text_config():
    inner = dict(LLAMA_LIKE, torch_dtype="float32")
    assert KVGeometry.from_hf_config({"torch_dtype": "float16", "text_config": inner}, dtype="auto").dtype == "float16"
    assert KVGeometry.from_hf_config({"text_config": inner}, dtype="auto").dtype == "float32"
    assert KVGeometry.from_hf_config({"text_config": LLAMA_LIKE}, dtype="auto").dtype == "bfloat16"
    assert KVGeometry.from_hf_config(dict(LLAMA_LIKE, dtype="float16"), dtype="auto").dtype == "float16"


def test_a_wrapped_fixture_config_parses_as_the_bare_one_in_the_wrappers_dtype():
    for name in ("deepseek_v3", "llama_3_1_8b", "mimo_v2_flash", "qwen3_8b"):
        bare = load_config(name)  # torch_dtype bfloat16
        wrapped = {"torch_dtype": "float16", "text_config": bare}
        assert KVGeometry.from_hf_config(wrapped, dtype="auto") == KVGeometry.from_hf_config(bare, dtype="float16")
