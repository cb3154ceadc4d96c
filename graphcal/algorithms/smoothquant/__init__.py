"""SmoothQuant: llm-compressor's SmoothQuantModifier."""
