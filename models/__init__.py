"""The model families: one pre-norm decoder for GPT-2/3, Cerebras-GPT, BTLM, Llama, Mistral,
Mixtral, Falcon and their kin, built from ModelZoo's model keys (torch only)."""
