"""AWQ: llm-compressor's AWQModifier."""
