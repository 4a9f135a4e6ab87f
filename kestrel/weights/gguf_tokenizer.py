"""The tokenizer a GGUF file carries, built as a transformers fast tokenizer.

Byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`: Llama 3, Qwen, SmolLM) are built
here straight from the vocabulary and merges, in well under a second, the same tokenizer that
transformers' own GGUF conversion builds in 20+ s. Other vocabularies go through that
conversion.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kestrel.weights.gguf_file import GgufFile

TOKEN_TYPE_CONTROL = 3  # llama.cpp's token types: 1 normal, 3 control, 4 user-defined
TOKEN_TYPE_USER_DEFINED = 4
# Control tokens that end a turn. A GGUF names one eos token (SmolLM2's names <|im_start|>);
# llama.cpp also stops at these by their text, and so does Kestrel.
END_OF_TURN_TEXTS = frozenset(
    {"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|end_of_text|>"}
)


def gguf_tokenizer(file: GgufFile) -> Any:
    if file.metadata.get("tokenizer.ggml.model") != "gpt2":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(file.path.parent), gguf_file=file.path.name)
    return _byte_level_bpe(file)


def _special_token(file: GgufFile, key: str) -> str | None:
    token_id = file.metadata.get(f"tokenizer.ggml.{key}_token_id")
    tokens = file.metadata["tokenizer.ggml.tokens"]
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


def _byte_level_bpe(file: GgufFile) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens: list[str] = file.metadata["tokenizer.ggml.tokens"]
    types: list[int] = file.metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(merge.split(" ", 1)) for merge in file.metadata.get("tokenizer.ggml.merges", [])]
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k == TOKEN_TYPE_CONTROL]
    )
    backend.add_tokens([AddedToken(t, normalized=False) for t, k in zip(tokens, types) if k == TOKEN_TYPE_USER_DEFINED])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        name_or_path=str(file.path),
        bos_token=_special_token(file, "bos"),
        eos_token=_special_token(file, "eos"),
        unk_token=_special_token(file, "unknown"),
        pad_token=_special_token(file, "padding"),
        chat_template=file.metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


def end_of_turn_ids(file: GgufFile) -> frozenset[int]:
    """The ids generation stops at: the named eos and eot tokens, and end-of-turn control tokens."""
    tokens: list[str] = file.metadata.get("tokenizer.ggml.tokens", [])
    types: list[int] = file.metadata.get("tokenizer.ggml.token_type", [])
    ids = {file.metadata.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")}
    ids.update(i for i, (t, k) in enumerate(zip(tokens, types)) if k == TOKEN_TYPE_CONTROL and t in END_OF_TURN_TEXTS)
    ids.discard(None)
    return frozenset(ids)


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"
