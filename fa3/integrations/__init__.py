"""fa3 inside other libraries: `fa3.integrations.transformers` (Hugging Face transformers)."""
