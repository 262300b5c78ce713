"""The model families: one pre-norm decoder for the GPT-2/3, Cerebras-GPT, BTLM, Llama 1-3,
Mistral, Mixtral and GPT-J/NeoX/Falcon families, built from ModelZoo's model keys (torch only;
``config`` not even torch).

    config        ModelConfig: the model keys (csx_config's schema), checked together; the
                  widths and scales derived from them; the presets
    positions     rotary embeddings (linear, Llama-3.1, YaRN scaling), ALiBi, visible keys
    attention     multi-head, grouped-query and multi-query attention
    ffn           the feed-forward network and its nonlinearities
    moe           the mixture of experts: router, experts, load-balancing loss
    blocks        norms, the decoder layer (sequential or parallel), the embedding layer
    initializers  ModelZoo's initializers and which one each role gets (muP scaling)
    mup           muP's per-layer learning-rate groups
    transformer   the decoder as a whole, and ``build_model``

GPT-2/3: learned positions, LayerNorm, GELU, biases. Llama: rotary positions, RMSNorm, SwiGLU,
no biases. Everything is picked by ModelZoo's model keys (``ModelConfig`` holds them):

- grouped-query / multi-query attention: ``attention_module: multiquery_attention`` with
  ``extra_attention_params: {num_kv_groups: G}`` (G key/value heads; ModelZoo's default 1 is
  MQA), query head h reading key/value head ``h // (num_heads / G)``; ``attention_inner_dim``
  (Mistral-Nemo: q/k/v heads narrower than the residual stream);
- rotary positions with ``rope_theta``, ``rotary_dim`` and ``pos_scaling_type`` linear (positions
  divided by ``pos_scaling_factor``), llama3 (Llama-3.1's banded rule) or yarn, their
  ``pos_scaling_extra_args`` as ModelZoo names them; ALiBi (``position_embedding_type: alibi``,
  Press et al. 2022, optionally ``alibi_trainable_slopes``);
- sliding-window attention (``attention_sliding_window_length``: each query sees itself and
  the window - 1 tokens before it; ``attention_sink_tokens``: the first tokens stay visible);
- muP (Cerebras-GPT, BTLM): ``embeddings_scale``, ``scale_qk_dot_by_d``,
  ``attention_logits_alpha``, and the output logits scaled by ``output_logits_alpha`` times
  ``mup_base_hidden_size / hidden_size`` (its square root unless ``scale_output_logits_by_d``),
  or by a given ``output_logits_scale`` (the 1.x form); with the base sizes, the initializers
  are scaled by width and depth as ModelZoo scales them, and ``lr_adjustment_scales`` gives the
  per-layer learning-rate factors (``training.build.make_optimizer`` applies them).
"""
