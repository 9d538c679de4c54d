"""Write a tiny random-weight llama GGUF that llama.cpp loads, for offline tests.

The vocabulary is character-level (the SentencePiece "llama" tokenizer with one
token per printable ASCII character, ``▁`` for space and the 256 byte-fallback
tokens), so every prompt tokenizes, every grammar can be followed character by
character, and a test can name the token of any character. Weights come from a
seeded generator: the same seed writes the same bytes.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

UNK, BOS, EOS = 0, 1, 2
SPACE = "\u2581"  # SentencePiece's word-boundary marker stands for " "
BYTE_BASE = 3  # <0x00> is token 3


def vocabulary() -> tuple[list[str], list[int]]:
    """Token texts and llama.cpp token types, in id order."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    chars = [chr(c) for c in range(0x21, 0x7F)] + [SPACE]
    tokens += chars
    types += [gguf.TokenType.NORMAL] * len(chars)
    return tokens, [int(t) for t in types]


def token_of(char: str) -> int:
    """The id of the single token that stands for ``char`` in this vocabulary."""
    tokens, _ = vocabulary()
    if char == " ":
        return tokens.index(SPACE)
    if char in tokens[BYTE_BASE + 256 :]:
        return tokens.index(char)
    (byte,) = char.encode("utf-8")
    return BYTE_BASE + byte


def build(
    path: Path,
    *,
    seed: int = 0,
    n_embd: int = 32,
    n_head: int = 2,
    n_layer: int = 1,
    n_ff: int = 64,
    context: int = 2048,
) -> Path:
    """Write the model to ``path`` and return it."""
    tokens, types = vocabulary()
    rng = np.random.default_rng(seed)

    def weight(rows: int, cols: int) -> np.ndarray:
        # numpy (rows, cols) is ggml's ne = [cols, rows]: rows are outputs.
        return rng.normal(0.0, 0.5, size=(rows, cols)).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("lab-tiny-random-llama")
    writer.add_context_length(context)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_unk_token_id(UNK)
    writer.add_add_bos_token(True)

    n_vocab = len(tokens)
    writer.add_tensor("token_embd.weight", weight(n_vocab, n_embd))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", weight(n_vocab, n_embd))
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(n_embd, n_ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
