"""Calls against a KV cache, beside the entry point (fa3.kvcache): argument checks, the append
of new tokens, the split plan and the prompt chunks that K5 serves in the same call."""
