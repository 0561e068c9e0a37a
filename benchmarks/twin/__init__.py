"""The digital twin: vLLM's real scheduler on a virtual clock (see README.md)."""
