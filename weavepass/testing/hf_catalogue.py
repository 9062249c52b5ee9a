"""Every Hugging Face family of the installed ``transformers`` that a user can load tensor-parallel,
as a tiny random checkpoint.

``tp_families()`` lists the model types with a causal-LM class whose default config ships a non-empty
``base_model_tp_plan``; ``tiny_config(model_type)`` is that config at small sizes (``SMALL``, applied
to the fields the config has, then ``OVERRIDES[model_type]``); ``save_tiny`` writes a random fp32
checkpoint of it. ``scripts/hf_sweep.py`` runs them all; ``weavepass.testing.hf_models`` loads and
compiles them.

Needs ``transformers`` (>= 5.17), imported only when these functions run.
"""

from __future__ import annotations

import torch

VOCAB = 128
"""Every tiny checkpoint's vocabulary (``hf_models`` draws its token ids below it)."""

SMALL = dict(
    vocab_size=VOCAB, unpadded_vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    # MoE: 4 experts of 32, 2 per token; a shared expert of 48
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, n_shared_experts=1,
    first_k_dense_replace=1, n_group=1, topk_group=1,
    # MLA attention
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    # GPT-2-style names (GPT-J, CodeGen)
    n_embd=64, n_layer=2, n_head=4, n_positions=64, n_ctx=64, rotary_dim=8,
    # Mamba / linear-attention mixers
    mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_expand=2,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
)
"""The sizes every family shares, where its config has the field: 2 layers, 4 query and 2 key/value
heads of 16 (each of 2 ranks holds 2 and 1), hidden 64."""

OVERRIDES: dict[str, dict] = {
    # model type -> config fields beyond ``SMALL`` (a family whose defaults do not fit the sizes)
    "gpt_oss": dict(sliding_window=4),
    "gemma2": dict(sliding_window=4, query_pre_attn_scalar=16),
    "gemma3_text": dict(sliding_window=4, query_pre_attn_scalar=16),
    "granite": dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.25,
                    logits_scaling=8.0),
    "cohere": dict(logit_scale=0.5),
    "gpt_neox": dict(rotary_pct=0.25),
    "phi": dict(partial_rotary_factor=0.5),
    # hybrids: one attention layer among the 2 (a cache of Mamba layers only has no sequence length)
    "bamba": dict(attn_layer_indices=[1]),
    "falcon_h1": dict(mamba_d_ssm=128),  # (its layers are all hybrid: Mamba and attention in each)
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    # (one layer per block: a Mamba, an MoE, an attention and an MLP layer, as its default)
    "nemotron_h": dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp"], mamba_num_heads=8,
                       mamba_head_dim=16),
    # (its default config has no layer types: a short convolution layer and an attention layer; its
    # first layer is dense, the second MoE)
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    # (its 2 layers cannot share key/value caches: its default shares the last 15 of 35)
    "gemma3n_text": dict(num_kv_shared_layers=0),
    # (its default config has no RoPE parameters, which its model reads per layer type)
    "cohere_compass_text": dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=10000.0)}),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
}


def tp_families() -> dict[str, str]:
    """``{model type: causal-LM class name}`` for every model type whose default config has a
    non-empty ``base_model_tp_plan`` (a config that cannot be built at its defaults is kept: its
    tiny checkpoint then fails with the reason)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    transformers.logging.set_verbosity_error()  # (default configs warn about their token ids)
    families = {}
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        try:
            plan = getattr(CONFIG_MAPPING[model_type](), "base_model_tp_plan", None)
        except Exception:
            plan = True  # listed, with the reason, when its checkpoint is built
        if plan:
            families[model_type] = class_name
    return families


def tiny_config(model_type: str):
    """The family's config at ``SMALL`` sizes: each field of ``SMALL`` and ``OVERRIDES`` the default
    config has, given to the config class (so that derived fields such as ``layer_types`` follow);
    token ids outside the tiny vocabulary become 0 and 1."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    fields = {k: v for k, v in {**SMALL, **OVERRIDES.get(model_type, {})}.items()
              if _has(default, k) and not _derived(config_class, k)}
    for name, value in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 1)):
        token = getattr(default, name, None)
        if isinstance(token, int) and token >= VOCAB or isinstance(token, list) and any(t >= VOCAB for t in token):
            fields[name] = value
    if "qk_rope_head_dim" in fields and "head_dim" in fields:  # MLA: the rotary part's size
        fields["head_dim"] = fields["qk_rope_head_dim"]
    if "kv_lora_rank" in fields and "num_key_value_heads" in fields:  # MLA: each head its own key/value
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    text = getattr(default, "text_config", None)  # a composite config (Llama4's): its text model tiny
    if "text_config" not in fields and getattr(text, "model_type", None) in CONFIG_MAPPING \
            and text.model_type != model_type:
        fields["text_config"] = tiny_config(text.model_type).to_dict()
    layer_types = getattr(default, "layer_types", None)
    named = {"layer_types", getattr(config_class, "attribute_map", {}).get("layer_types", "layer_types")}
    if isinstance(layer_types, list) and not named & set(fields) and not _derived(config_class, "layer_types"):
        # one layer of each kind the model has (a hybrid's attention and linear-attention layers)
        kinds = list(dict.fromkeys(layer_types))
        n = fields.get("num_hidden_layers", 2)
        fields["layer_types"] = (kinds + layer_types[len(kinds):])[:n] if len(kinds) < n else kinds[:n]
    return config_class(**fields)


def _has(config, name: str) -> bool:
    """``config`` has the field ``name`` (a per-layer field of a heterogeneous config, which refuses
    a global read, counts: the value given is every layer's)."""
    try:
        return hasattr(config, name)
    except Exception:  # (transformers' AmbiguousGlobalPerLayerAttributeError)
        return True


def _derived(config_class, name: str) -> bool:
    """``name`` is a read-only property of the config (or an alias of one): derived from other fields."""
    name = getattr(config_class, "attribute_map", {}).get(name, name)
    attr = getattr(config_class, name, None)
    return isinstance(attr, property) and attr.fset is None


def save_tiny(model_type: str, path: str, seed: int = 0) -> None:
    """Write a random fp32 ``tiny_config(model_type)`` causal LM to ``path``."""
    import transformers

    config = tiny_config(model_type)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
