"""Hugging Face config.json files read into [model] sizes (sim/model/hfconfig.py): the bundled
models' parameter counts against their published totals, and bad files refused in one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sim.errors import ScenarioError
from sim.model.hfconfig import MODELS_DIR, bundled_configs, parse_config, read_config

ROOT = Path(__file__).resolve().parents[3]

# Published totals and active parameters per token (billions), from each model's card (sources:
# scenarios/models/README.md). gpt-oss's cards count the active parameters without the
# embedding table (its 0.58B are added here); Llama 4's totals include the vision tower, which
# is not modeled (its ~1B left out here).
PUBLISHED = {
    "deepseek-v3": (671, 37),
    "qwen3-30b-a3b": (30.5, 3.3),
    "qwen3-235b-a22b": (235, 22),
    "mixtral-8x7b": (46.7, 12.9),
    "llama-4-scout": (108, 17),
    "llama-4-maverick": (399, 17),
    "gpt-oss-120b": (116.8, 5.13 + 0.58),
    "gpt-oss-20b": (20.9, 3.61 + 0.58),
    "llama-3.1-8b": (8.03, 8.03),
    "llama-3.3-70b": (70.6, 70.6),
    "llama-3.1-405b": (406, 406),
    "qwen3-8b": (8.2, 8.2),
    "qwen3-14b": (14.8, 14.8),
    "qwen3-32b": (32.8, 32.8),
    "qwen3-0.6b": (0.6, 0.6),
    "gemma-2-9b": (9.24, 9.24),
}


def test_every_bundled_config_is_checked_here():
    assert sorted(PUBLISHED) == bundled_configs()


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_bundled_parameter_counts_match_the_published_totals(name):
    got = read_config(name, ROOT)
    total, active = PUBLISHED[name]
    assert got["num_params"] / 1e9 == pytest.approx(total, rel=0.02)
    assert got["active_params"] / 1e9 == pytest.approx(active, rel=0.03)


def test_deepseek_v3_reads_experts_and_mla():
    got = read_config("deepseek-v3", ROOT)
    assert (got["num_experts"], got["experts_per_token"], got["dense_layers"]) == (256, 8, 3)
    assert (got["moe_intermediate_size"], got["shared_intermediate_size"]) == (2048, 2048)
    assert (got["kv_lora_rank"], got["q_lora_rank"], got["rope_head_dim"]) == (512, 1536, 64)
    assert got["quantization"] == "fp8" and got["num_kv_heads"] == got["num_heads"] == 128


def test_interleaved_and_sliding_layers():
    maverick = read_config("llama-4-maverick", ROOT)
    assert maverick["dense_layers"] == 24 and maverick["intermediate_size"] == 16384
    oss = read_config("gpt-oss-120b", ROOT)
    assert (oss["sliding_window"], oss["sliding_window_layers"]) == (128, 18)
    assert oss["quantization"] == "mxfp4"
    assert oss["chat_template"] is False  # Harmony, which vLLM renders without Jinja
    assert "chat_template" not in read_config("qwen3-8b", ROOT)  # (a Jinja template: the default)
    gemma = read_config("gemma-2-9b", ROOT)
    assert gemma["tie_word_embeddings"] and gemma["sliding_window_layers"] == 21


def _raw(name="mixtral-8x7b"):
    return json.loads((MODELS_DIR / f"{name}.json").read_text())


@pytest.mark.parametrize("edit, needle", [
    (lambda c: c.update(frobnicate=1), "frobnicate: unknown field"),
    (lambda c: c.update(architectures=["MambaForCausalLM"]), "not a modeled family"),
    (lambda c: c.pop("hidden_size"), "hidden_size: missing"),
    (lambda c: c.update(num_hidden_layers=0), "num_hidden_layers = 0: expected an integer"),
    (lambda c: c.update(num_hidden_layers="32"), "num_hidden_layers = '32'"),
    (lambda c: c.update(num_experts_per_tok=9), "more than the 8 experts"),
    (lambda c: c.pop("num_local_experts"), "num_experts: missing"),
    (lambda c: c.update(quantization_config={"quant_method": "hqq"}), "quant_method = 'hqq'"),
    (lambda c: c.update(quantization_config={"quant_method": "awq", "bits": 3}), "bits = 3"),
    # layer lists: indices of real layers, or refused (not counted as whatever they hold)
    (lambda c: c.update(moe_layers=["a", None]), "moe_layers = ['a', None]: expected a list"),
    (lambda c: c.update(moe_layers=list(range(40))), "indices from 0 to 31"),
    (lambda c: c.update(mlp_only_layers=["x"]), "mlp_only_layers = ['x']"),
    (lambda c: c.update(mlp_only_layers=[32]), "indices from 0 to 31"),
    (lambda c: c.update(layer_types="sliding_attention"), "layer_types = 'sliding_attention'"),
])
def test_bad_configs_are_refused_naming_the_field(edit, needle):
    raw = _raw()
    edit(raw)
    with pytest.raises(ScenarioError) as e:
        parse_config(raw, "x.json")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_null_size_takes_its_default():
    raw = _raw()
    raw["head_dim"] = None  # (transformers writes null for "hidden_size / heads")
    assert parse_config(raw)["head_dim"] == 128


def test_harmless_keys_are_accepted():
    raw = _raw()
    raw.update(transformers_version="9.9", pad_token_id=0, rope_scaling=None, attention_dropout=0.1)
    assert parse_config(raw)["num_params"] == parse_config(_raw())["num_params"]


def test_mla_with_unequal_head_sizes_is_refused():
    raw = _raw("deepseek-v3")
    raw["v_head_dim"] = 96
    with pytest.raises(ScenarioError, match="qk_nope_head_dim = 128, v_head_dim = 96"):
        parse_config(raw)


def test_a_bad_config_is_one_line_and_exit_2(tmp_path):
    bad = _raw()
    bad["moe_frobs"] = 3
    (tmp_path / "config.json").write_text(json.dumps(bad))
    (tmp_path / "s.toml").write_text('[model]\nconfig = "."\n[workload]\nnum_requests = 2\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "tui.cli", "sim", str(tmp_path / "s.toml"), "-q"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "model.config" in p.stderr and "moe_frobs: unknown field" in p.stderr


def test_no_such_config_names_the_bundled_ones(tmp_path):
    with pytest.raises(ScenarioError, match="bundled: deepseek-v3"):
        read_config("nope", tmp_path)


def test_a_config_path_the_system_cannot_look_up_is_one_line(tmp_path):
    with pytest.raises(ScenarioError, match="model.config = 'aaaa.*: cannot read: File name "
                                            "too long"):
        read_config("a" * 5000, tmp_path)
