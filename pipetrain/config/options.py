"""The model= options: one per conf/model/*.yaml (tests/test_models_config.py keeps them equal), by the
schema they compose on (config/__init__.py MODEL_SCHEMAS). Pure Python."""

LLAMA_OPTIONS = ("llama-tiny", "llama3.2-1b", "llama3.2-3b", "llama3.1-8b", "llama3.1-70b", "qwen2.5-0.5b",
                 "qwen2.5-7b", "qwen3-0.6b", "mistral-7b-v0.3", "llama3.1-405b")
MOE_OPTIONS = ("moe-tiny", "mixtral-8x7b", "qwen3-30b-a3b", "qwen2-moe-a2.7b", "olmoe-1b-7b")  # llama_schema + moe
DEEPSEEK_OPTIONS = ("deepseek-tiny", "deepseek-v3", "deepseek-v2-lite", "moonlight-16b-a3b", "kimi-k2")  # deepseek
MODEL_OPTIONS = ("sleep", "mlp", "gpt2-tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl",
                 *LLAMA_OPTIONS, *MOE_OPTIONS, *DEEPSEEK_OPTIONS)  # conf/model/*.yaml
