"""Build a tiny random Llama and a word-level tokenizer locally (no downloads), for vLLM tests and benchmarks.

Runs inside the vLLM venv (it needs torch + transformers + tokenizers)::

    .venv-vllm/bin/python tests/vllm/tiny_model.py /path/to/cache/dir

prints the model directory. The build is deterministic (fixed seed) and cached: a directory that already holds a
complete model with the same recipe is reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

# Recipe: changing any value here changes the directory name, so stale caches are never reused.
RECIPE: dict[str, int | float | str] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
    "max_position_embeddings": 2048,
    # A wide init makes the logits peaky, so greedy argmax has no near-ties that batching noise could flip.
    "initializer_range": 0.2,
    "torch_dtype": "float32",
    "seed": 1234,
}
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} : {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def word(index: int) -> str:
    """The surface form of vocabulary entry ``index`` (after the special tokens)."""
    return f"w{index}"


def prompt_of_length(num_tokens: int, offset: int = 0) -> str:
    """A prompt that tokenizes to exactly ``num_tokens`` tokens (one word per token, no BOS)."""
    words = RECIPE["vocab_size"] - len(SPECIAL_TOKENS) - 2  # leave room for "role" words below
    return " ".join(word((offset + 7 * i) % int(words)) for i in range(num_tokens))


def model_dir_name() -> str:
    recipe = json.dumps(RECIPE, sort_keys=True) + CHAT_TEMPLATE
    return "tiny-llama-" + hashlib.sha256(recipe.encode()).hexdigest()[:12]


def build(cache_dir: str | os.PathLike[str]) -> Path:
    out = Path(cache_dir) / model_dir_name()
    done = out / ".complete"
    if done.exists() and json.loads(done.read_text()) == RECIPE:
        return out

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for extra in ("user", "assistant", "system", ":"):
        vocab[extra] = len(vocab)
    index = 0
    while len(vocab) < int(RECIPE["vocab_size"]):
        vocab[word(index)] = len(vocab)
        index += 1
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)

    torch.manual_seed(int(RECIPE["seed"]))
    config = LlamaConfig(
        hidden_size=int(RECIPE["hidden_size"]),
        intermediate_size=int(RECIPE["intermediate_size"]),
        num_hidden_layers=int(RECIPE["num_hidden_layers"]),
        num_attention_heads=int(RECIPE["num_attention_heads"]),
        num_key_value_heads=int(RECIPE["num_key_value_heads"]),
        vocab_size=int(RECIPE["vocab_size"]),
        max_position_embeddings=int(RECIPE["max_position_embeddings"]),
        initializer_range=float(RECIPE["initializer_range"]),
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
        tie_word_embeddings=False,
        torch_dtype=str(RECIPE["torch_dtype"]),
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        # End-of-sequence gets logit 0, below the peak of 4096 wide random logits: requests run to max_tokens.
        model.lm_head.weight[vocab["</s>"]].zero_()
    model.save_pretrained(out, safe_serialization=True)
    done.write_text(json.dumps(RECIPE, sort_keys=True))
    return out


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~/.cache/kvlifecycle/models")
    if len(sys.argv) > 2:  # a JSON object of recipe values to change (the directory name follows them)
        RECIPE.update(json.loads(sys.argv[2]))
    print(build(target))
