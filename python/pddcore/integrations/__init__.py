"""Adapters that plug pddcore into inference engines (vLLM, SGLang)."""
