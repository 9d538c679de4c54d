"""The model experiment (the `model` extra): a GGUF model proposes, strict admission judges."""
