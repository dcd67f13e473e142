# SPDX-License-Identifier: Apache-2.0
"""Tiny random-weight configs for the model families that transformers and vLLM both implement.

Nothing is downloaded. Every config keeps the family's structure at toy size: hidden size 128, 2 or 3 layers,
8 experts, a vocabulary of 1024, and head_dim >= 32 for vLLM's CPU attention. A model then builds on the meta
device in milliseconds, and a CPU vLLM server can load it. models.py turns each config into a preset, such as
`--model tiny-mixtral`.
"""

from __future__ import annotations

_COMMON = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

FAMILIES: dict[str, dict] = {
    # routed experts only; transformers fuses them in memory, while checkpoints hold one tensor per expert
    "qwen3_moe": {
        **_COMMON,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    # routed experts and a gated shared expert; q/k/v biases
    "qwen2_moe": {
        **_COMMON,
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    # checkpoint names are block_sparse_moe.experts.N.w1/w2/w3
    "mixtral": {
        **_COMMON,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": 64,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    # MLA attention, one dense layer first, a shared expert, and a noaux_tc router whose
    # e_score_correction_bias is a buffer in transformers and a parameter in vLLM
    "deepseek_v3": {
        **_COMMON,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        # DeepSeek-V3's own MLA head dims, the only ones vLLM's MLA kernels on GPU take
        "q_lora_rank": 64,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "head_dim": 64,
        "num_mtp_layers": 0,
    },
    # GLM-4.5: DeepSeek-style router and shared expert, GQA with partial rotary
    "glm4_moe": {
        **_COMMON,
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "num_hidden_layers": 3,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "use_qk_norm": False,
        "num_mtp_layers": 0,
        "num_nextn_predict_layers": 0,
    },
    # experts with biases, interleaved gate/up, [E, H, 2I] in memory; attention sinks
    "gpt_oss": {
        **_COMMON,
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 64,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"],
        "attention_bias": True,
    },
    # a dense model: no conversion in transformers, only vLLM's own q/k/v and gate/up stacking
    "qwen3": {
        **_COMMON,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "intermediate_size": 256,
    },
}
