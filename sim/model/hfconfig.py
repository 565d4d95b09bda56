"""Hugging Face model configurations (`config.json`) read offline into `[model]` sizes.

`model.config` names a `config.json` file, a folder holding one, or a bundled configuration
(`scenarios/models/<name>.json`, sources in scenarios/models/README.md). Nothing is downloaded.

Families read (the `architectures` entry): dense Llama, Mistral, Qwen2, Qwen3, Gemma 1/2/3 and
Phi-3; mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE, Llama 4 (its text model: the vision
tower is not modeled) and gpt-oss; DeepSeek-V2/V3 (mixture of experts and multi-head latent
attention). What is read: layers, hidden size, query and KV heads, head size, dense and expert
MLP widths, vocabulary, tied embeddings, experts, experts per token, shared experts, dense
leading layers (or interleaved MoE layers), the MLA ranks, sliding-window layers and the
checkpoint's quantization. The parameter count is counted from these (norms and biases
included), so `num_params` is the checkpoint's.

Which keys a file may hold: every key is either read (`_READ`), or known not to change the
sizes or the step time (`_HARMLESS` and `_HARMLESS_PATTERN`: token ids, norm epsilons, rotary
settings, initialisation, dropout, router training losses, dtype, versions). Any other key is
refused with one line naming it: an unknown key may change the model (an extra projection, a
different attention), and guessing would give a wrong model silently. So are an unknown family,
a missing size, and values servesim does not model (a quantization method it does not know,
MLA with different nope and value head sizes).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from sim.errors import ScenarioError, shown
from sim.fileio import json_loads, read_input_text, reason

MODELS_DIR = Path(__file__).resolve().parents[2] / "scenarios" / "models"
MAX_CONFIG_BYTES = 1 << 20

# Family -> (kind: dense, moe or mla (MoE with multi-head latent attention), whether its
# embeddings are tied when the file does not say).
FAMILIES: dict[str, tuple[str, bool]] = {
    "LlamaForCausalLM": ("dense", False),
    "MistralForCausalLM": ("dense", False),
    "Qwen2ForCausalLM": ("dense", False),
    "Qwen3ForCausalLM": ("dense", False),
    "GemmaForCausalLM": ("dense", True),
    "Gemma2ForCausalLM": ("dense", True),
    "Gemma3ForCausalLM": ("dense", True),
    "Gemma3ForConditionalGeneration": ("dense", True),
    "Phi3ForCausalLM": ("dense", False),
    "MixtralForCausalLM": ("moe", False),
    "Qwen2MoeForCausalLM": ("moe", False),
    "Qwen3MoeForCausalLM": ("moe", False),
    "Llama4ForCausalLM": ("moe", False),
    "Llama4ForConditionalGeneration": ("moe", False),
    "GptOssForCausalLM": ("moe", False),
    "DeepseekV2ForCausalLM": ("mla", False),
    "DeepseekV3ForCausalLM": ("mla", False),
}

# Keys read (by some family): sizes and structure.
_READ = {
    "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "intermediate_size",
    "tie_word_embeddings", "max_position_embeddings", "attention_bias", "mlp_bias",
    "num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok",
    "experts_per_token", "moe_intermediate_size", "n_shared_experts",
    "shared_expert_intermediate_size", "first_k_dense_replace", "moe_layer_freq",
    "decoder_sparse_step", "mlp_only_layers", "interleave_moe_layer_step", "moe_layers",
    "intermediate_size_mlp", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
    "qk_nope_head_dim", "v_head_dim", "sliding_window", "layer_types", "use_sliding_window",
    "max_window_layers", "sliding_window_pattern", "attention_chunk_size", "no_rope_layers",
    "quantization_config", "text_config", "vision_config",
}
# Keys that change neither the sizes nor the step time servesim models.
_HARMLESS = {
    "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache", "hidden_act",
    "hidden_activation", "initializer_range", "rms_norm_eps", "layer_norm_eps", "norm_eps",
    "attention_dropout", "hidden_dropout", "embd_pdrop", "resid_pdrop", "pretraining_tp",
    "router_aux_loss_coef", "output_router_logits", "norm_topk_prob", "scoring_func",
    "topk_method", "n_group", "topk_group", "routed_scaling_factor", "aux_loss_alpha",
    "seq_aux", "ep_size", "num_nextn_predict_layers", "router_jitter_noise",
    "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
    "swiglu_limit", "partial_rotary_factor", "original_max_position_embeddings",
    "auto_map", "use_qk_norm", "attn_temperature_tuning", "attn_scale", "floor_scale",
    "cache_implementation", "router_dtype", "model_name", "_name_or_path", "is_causal",
    "initial_context_length", "use_mla", "image_token_index", "boi_token_index",
    "eoi_token_index", "mm_tokens_per_image", "multi_modal_projector_bias",
    "projector_hidden_act", "vision_feature_layer", "vision_feature_select_strategy",
    "experts_implementation", "max_seq_len", "tokenizer_class", "for_llm_compressor",
    "_attn_implementation_autoset", "no_rope_layer_interval",
}
_HARMLESS_PATTERN = re.compile(
    r".*_token_ids?$|^rope_.*|.*_dropout$|.*_pdrop$|^output_.*|.*_eps$|^use_.*_kernel$")

# `quantization_config`: the method (and its bits or algorithm) -> model.quantization.
_QUANT = {"fp8": "fp8", "mxfp4": "mxfp4"}


class _Cfg:
    """One table of a config file, with the checks every read makes."""

    def __init__(self, table: dict, where: str) -> None:
        self.t, self.where = table, where

    def has(self, key: str) -> bool:
        return self.t.get(key) is not None

    def num(self, key: str, default: int | None = None, *, min_: int = 1) -> int:
        v = self.t.get(key)
        if v is None:  # (absent, or null as some configs write it)
            v = default
        if v is None:
            raise ScenarioError(f"{self.where}: {key}: missing (a size servesim needs)")
        if isinstance(v, bool) or not isinstance(v, int) or v < min_:
            raise ScenarioError(f"{self.where}: {key} = {shown(v)}: expected an integer of at "
                                f"least {min_}")
        return v

    def layers(self, key: str, num_layers: int) -> list[int]:
        """A list of layer indices (absent or null: none), each from 0 to num_layers - 1."""
        v = self.t.get(key)
        if v is None:
            return []
        if not isinstance(v, list) or not all(
                type(i) is int and 0 <= i < num_layers for i in v):
            raise ScenarioError(f"{self.where}: {key} = {shown(v)}: expected a list of layer "
                                f"indices from 0 to {num_layers - 1} (num_hidden_layers - 1)")
        return v

    def flag(self, key: str, default: bool) -> bool:
        v = self.t.get(key, default)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise ScenarioError(f"{self.where}: {key} = {shown(v)}: expected true or false")
        return v


def find_config(spec: str, base_dir: Path) -> Path:
    """The config file `model.config` names: a file, a folder holding config.json (relative
    to `base_dir`), or a bundled name. Raises ScenarioError."""
    p = Path(spec).expanduser()
    if not p.is_absolute():
        p = base_dir / p
    try:
        if p.is_dir() and (p / "config.json").is_file():
            return p / "config.json"
        if p.is_file():
            return p
        bundled = MODELS_DIR / f"{spec}.json"
        if re.fullmatch(r"[\w.-]+", spec) and bundled.is_file():
            return bundled
    except (OSError, ValueError) as e:  # a name too long, a NUL byte, a link loop
        raise ScenarioError(f"model.config = {shown(spec)}: cannot read: {reason(e)}") from None
    names = ", ".join(bundled_configs())
    raise ScenarioError(f"model.config = {shown(spec)}: no such file, folder with a config.json, "
                        f"or bundled model (bundled: {names})")


def bundled_configs() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def read_config(spec: str, base_dir: Path) -> dict:
    """[model] fields from the config `spec` names (see the module docstring). Raises
    ScenarioError naming the file and the key."""
    path = find_config(spec, base_dir)
    try:
        raw = json_loads(read_input_text(path, limit=MAX_CONFIG_BYTES))
    except (OSError, UnicodeDecodeError) as e:
        raise ScenarioError(f"{path}: cannot read: {reason(e)}") from None
    except json.JSONDecodeError as e:
        raise ScenarioError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ScenarioError(f"{path}: a config.json must be a JSON object")
    return parse_config(raw, str(path))


def _check_keys(table: dict, where: str) -> None:
    for key in table:
        if key not in _READ and key not in _HARMLESS and not _HARMLESS_PATTERN.match(str(key)):
            raise ScenarioError(f"{where}: {key}: unknown field (neither a size servesim reads "
                                "nor one known not to change the model)")


def parse_config(raw: dict, where: str = "config.json") -> dict:
    """[model] fields from a parsed config.json. Raises ScenarioError."""
    _check_keys(raw, where)
    arch = raw.get("architectures")
    if not (isinstance(arch, list) and len(arch) == 1 and isinstance(arch[0], str)):
        raise ScenarioError(f"{where}: architectures = {shown(arch)}: expected a list naming "
                            "one model class")
    family = arch[0]
    if family not in FAMILIES:
        raise ScenarioError(f"{where}: architectures = {shown(family)}: not a modeled family "
                            f"(modeled: {', '.join(FAMILIES)})")
    kind, tied_default = FAMILIES[family]
    top = _Cfg(raw, where)
    if "text_config" in raw:  # a multimodal wrapper: its language model is what serves tokens
        if not isinstance(raw["text_config"], dict):
            raise ScenarioError(f"{where}: text_config: expected a table")
        _check_keys(raw["text_config"], f"{where}: text_config")
        c = _Cfg(raw["text_config"], f"{where}: text_config")
        tied = top.flag("tie_word_embeddings", c.flag("tie_word_embeddings", tied_default))
    else:
        c = top
        tied = c.flag("tie_word_embeddings", tied_default)
    h = c.num("hidden_size")
    L = c.num("num_hidden_layers")
    nh = c.num("num_attention_heads")
    nkv = c.num("num_key_value_heads", nh)
    hd = c.num("head_dim", h // nh)
    V = c.num("vocab_size")
    out: dict = dict(num_layers=L, hidden_size=h, num_heads=nh, num_kv_heads=nkv,
                     head_dim=hd, vocab_size=V, tie_word_embeddings=tied,
                     max_model_len=c.num("max_position_embeddings", 0, min_=0))
    # attention projections (and their biases), per layer
    bias = c.flag("attention_bias", family in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"))
    if kind == "mla":
        r, dr = c.num("kv_lora_rank"), c.num("qk_rope_head_dim")
        nope, vd = c.num("qk_nope_head_dim"), c.num("v_head_dim")
        if nope != vd:
            raise ScenarioError(f"{where}: qk_nope_head_dim = {nope}, v_head_dim = {vd}: MLA is "
                                "modeled with equal nope and value head sizes")
        qr = c.num("q_lora_rank", 0, min_=0)
        q = (h * qr + qr + qr * nh * (nope + dr)) if qr else h * nh * (nope + dr)
        attn = q + h * (r + dr) + r + r * nh * (nope + vd) + nh * vd * h
        out.update(head_dim=vd, num_kv_heads=nh, kv_lora_rank=r, q_lora_rank=qr,
                   rope_head_dim=dr)
    else:
        attn = h * hd * (nh + 2 * nkv) + nh * hd * h
        if bias:
            attn += hd * (nh + 2 * nkv) + (h if family == "GptOssForCausalLM" else 0)
        if family == "GptOssForCausalLM":
            attn += nh  # attention sinks
        if family.startswith("Qwen3") or family.startswith("Gemma3"):
            attn += 2 * hd  # q and k norms
    norms = 2 * h * L + h
    if family.startswith("Gemma2") or family.startswith("Gemma3"):
        norms += 2 * h * L  # pre- and post-feedforward norms too
    embed = V * h * (1 if tied else 2)
    # the MLPs
    inter = c.num("intermediate_size_mlp", c.t.get("intermediate_size") or 0, min_=0)
    mlp_bias = 3 if c.flag("mlp_bias", False) else 0
    experts = 0
    if kind in ("moe", "mla"):
        experts = next((c.num(k) for k in ("num_local_experts", "num_experts",
                                           "n_routed_experts") if c.has(k)), 0)
        if not experts:
            raise ScenarioError(f"{where}: num_experts: missing (a mixture-of-experts family "
                                "needs its expert count)")
        k = c.num("num_experts_per_tok" if c.has("num_experts_per_tok") else "experts_per_token")
        if k > experts:
            raise ScenarioError(f"{where}: num_experts_per_tok = {k}: more than the {experts} "
                                "experts")
        moe_inter = c.num("moe_intermediate_size", c.t.get("intermediate_size"))
        shared = 0
        if c.has("n_shared_experts"):
            shared = c.num("n_shared_experts", min_=0) * moe_inter
        elif c.has("shared_expert_intermediate_size"):
            shared = c.num("shared_expert_intermediate_size", min_=0)
        elif family.startswith("Llama4"):
            shared = moe_inter  # one shared expert per MoE layer
        dense = _dense_layers(c, L, family)
        router = h * experts + (experts if family in ("GptOssForCausalLM", "DeepseekV3ForCausalLM")
                                else 0)
        per_expert = 3 * h * moe_inter
        if family == "GptOssForCausalLM":
            per_expert += 2 * moe_inter + h  # gate-up and down biases
        moe_layers = L - dense
        if dense and not inter:
            raise ScenarioError(f"{where}: intermediate_size: missing (the dense layers' MLP "
                                "width)")
        mlp = (dense * (3 * h * inter + mlp_bias)
               + moe_layers * (router + experts * per_expert + 3 * h * shared))
        out.update(num_experts=experts, experts_per_token=k, moe_intermediate_size=moe_inter,
                   shared_intermediate_size=shared, dense_layers=dense,
                   intermediate_size=inter)
        active = mlp - moe_layers * (experts - k) * per_expert
    else:
        if not inter:
            raise ScenarioError(f"{where}: intermediate_size: missing (a size servesim needs)")
        mlp = L * (3 * h * inter + mlp_bias)
        out.update(intermediate_size=inter)
        active = mlp
    rest = embed + L * attn + norms
    out["num_params"] = float(rest + mlp)
    out["active_params"] = float(rest + active)  # (reported, not a [model] field)
    out["sliding_window"], out["sliding_window_layers"] = _sliding(c, L, family)
    if family == "GptOssForCausalLM":  # Harmony: vLLM renders it with openai-harmony, not Jinja
        out["chat_template"] = False
    quant = _quantization(raw.get("quantization_config"), where)
    if quant:
        out["quantization"] = quant
    return out


def _dense_layers(c: _Cfg, L: int, family: str) -> int:
    """Layers whose MLP is dense, not experts (they come first, or interleave)."""
    if c.has("first_k_dense_replace"):
        if c.num("moe_layer_freq", 1) != 1:
            raise ScenarioError(f"{c.where}: moe_layer_freq = {c.t['moe_layer_freq']}: only 1 "
                                "(every layer after the dense ones) is modeled")
        return min(c.num("first_k_dense_replace", min_=0), L)
    if c.has("moe_layers"):
        return L - len(set(c.layers("moe_layers", L)))
    step = c.num("interleave_moe_layer_step" if family.startswith("Llama4")
                 else "decoder_sparse_step", 1)
    only = c.layers("mlp_only_layers", L)
    moe = [i for i in range(L) if i not in only and (i + 1) % step == 0]
    return L - len(moe)


def _sliding(c: _Cfg, L: int, family: str) -> tuple[int, int]:
    """(window, how many layers attend within it); (0, 0) for none."""
    types = c.t.get("layer_types")
    if types is not None and not (isinstance(types, list)
                                  and all(isinstance(t, str) for t in types)):
        raise ScenarioError(f"{c.where}: layer_types = {shown(types)}: expected a list of "
                            "strings (one per layer)")
    if types is not None:
        n = sum(1 for t in types if t == "sliding_attention")
        return (c.num("sliding_window") if n else 0), n
    if family.startswith("Llama4") and c.has("attention_chunk_size"):
        # chunked attention on the layers that use rotary positions (3 of every 4)
        nope = c.t.get("no_rope_layers") or []
        n = sum(1 for x in nope if x) if isinstance(nope, list) and nope else L - L // 4
        return c.num("attention_chunk_size"), n
    if not c.has("sliding_window"):
        return 0, 0
    w = c.num("sliding_window")
    if family.startswith("Gemma2"):
        return w, L // 2  # every other layer
    if family.startswith("Gemma3"):
        pattern = c.num("sliding_window_pattern", 6)
        return w, L - L // pattern
    if family.startswith("Qwen"):
        if not c.flag("use_sliding_window", False):
            return 0, 0
        return w, L - c.num("max_window_layers", L, min_=0)
    return w, L  # Mistral, Mixtral, Phi-3: every layer


def _quantization(q, where: str) -> str:
    if q is None:
        return ""
    if not isinstance(q, dict) or not isinstance(q.get("quant_method"), str):
        raise ScenarioError(f"{where}: quantization_config: expected a table with a "
                            "quant_method")
    method = q["quant_method"]
    if method in ("awq", "gptq"):
        bits = q.get("bits", q.get("w_bit", 4))
        if bits not in (4, 8):
            raise ScenarioError(f"{where}: quantization_config.bits = {shown(bits)}: 4 or 8 "
                                "modeled")
        return "w4a16" if bits == 4 else "w8a16"
    if method == "modelopt":
        algo = str(q.get("quant_algo", "")).upper()
        if algo in ("FP8", "NVFP4"):
            return algo.lower()
        raise ScenarioError(f"{where}: quantization_config.quant_algo = {shown(algo)}: FP8 or "
                            "NVFP4 modeled")
    if _QUANT.get(method) is None:
        raise ScenarioError(f"{where}: quantization_config.quant_method = {shown(method)}: not "
                            f"modeled (modeled: fp8, mxfp4, awq, gptq, modelopt)")
    return _QUANT[method]
