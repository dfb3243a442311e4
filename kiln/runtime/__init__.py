"""Everything that runs a built engine. ``LLMEngine`` is the entry point."""
