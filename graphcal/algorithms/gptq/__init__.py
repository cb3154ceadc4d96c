"""GPTQ: llm-compressor's GPTQModifier."""
