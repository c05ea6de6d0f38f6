"""Tokenizers: a real one from a local path, or a built-in byte-level one (no downloads here).

A run's ``tokenizer.path`` means: a tokenizer directory; ``"builtin:bytes"``, the built-in
byte tokenizer; ``null``, the model's own: ``model.path``'s tokenizer (as TRL loads it from
the model id), or the byte tokenizer for a ``model.tiny`` toy (``tokenizer_source``). Byte ids
fed to a real checkpoint are not its token ids, so that must be asked for by name.

Also the one place that turns a prompt (plain text or chat messages) into text and token ids,
so tasks that must hit a token count and the rollout that feeds the model agree exactly.

    tok = load_tokenizer(None)                  # built-in: 256 byte tokens + 4 special tokens
    tok = load_tokenizer("/models/Qwen3-8B")    # AutoTokenizer, local files only
    tok = load_tokenizer(None, model_path="/models/Qwen3-8B")  # the model's own
    ids = encode_prompt(tok, [{"role": "user", "content": "hi"}])
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

BUILTIN_NAME = "builtin:bytes"
# A directory holds a tokenizer AutoTokenizer can load when it has one of these (transformers'
# own file names: the tokenizer's settings, or a fast tokenizer's whole definition).
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")
ENDOFTEXT, PAD, IM_START, IM_END = "<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"
BUILTIN_SPECIAL_TOKENS = (ENDOFTEXT, PAD, IM_START, IM_END)  # ids 256, 257, 258, 259
BUILTIN_TOKENIZER_SIZE = 256 + len(BUILTIN_SPECIAL_TOKENS)  # bytes, then the special tokens

# ChatML, as Qwen uses: a tiny model trained with the built-in tokenizer learns the same turn
# structure a real Qwen checkpoint expects.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

Prompt = str | Sequence[dict[str, Any]]


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, the alphabet the ByteLevel pre-tokenizer emits."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def builtin_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer built in code: token id == byte value, specials from 256.

    A BPE model with the 256 byte symbols and no merges, so every UTF-8 byte is one token and
    token counts are exact byte counts (cheap to reason about for length-controlled tasks).
    ``eos`` is ``<|im_end|>`` (the end of an assistant turn, where rollout should stop, as in
    Qwen's instruct tokenizers); ``<|endoftext|>`` is there for plain-text documents.
    """
    vocab = {symbol: byte for byte, symbol in _byte_to_unicode().items()}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: with no merges it cannot change the result, and it is faster.
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(BUILTIN_SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=IM_END,
        pad_token=PAD,
        additional_special_tokens=[ENDOFTEXT, IM_START],
        name_or_path=BUILTIN_NAME,
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def is_builtin(path_or_name: str | os.PathLike | None) -> bool:
    """Whether ``tokenizer.path`` names the built-in byte tokenizer explicitly."""
    return path_or_name is not None and os.fspath(path_or_name) == BUILTIN_NAME


def tokenizer_source(
    path_or_name: str | os.PathLike | None, model_path: str | os.PathLike | None = None
) -> str | None:
    """The directory a run's tokenizer loads from, or None for the built-in one.

    ``path_or_name`` is ``tokenizer.path``: a directory, ``"builtin:bytes"``, or None for the
    model's own (``model_path``'s tokenizer; the built-in one when there is no ``model_path``,
    i.e. a random-init toy, which is built for the byte tokenizer's 260 ids).
    """
    if path_or_name is not None:
        return None if is_builtin(path_or_name) else os.fspath(path_or_name)
    return None if model_path is None else os.fspath(model_path)


def has_tokenizer_files(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a tokenizer (``TOKENIZER_FILES``), without loading it."""
    return any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES)


def model_without_tokenizer(model_path: str | os.PathLike) -> str:
    """Why a model directory without a tokenizer is refused, and the two ways on."""
    return (
        f"{os.fspath(model_path)!r} (model.path) holds no tokenizer (none of "
        f"{', '.join(TOKENIZER_FILES)}); set tokenizer.path to the model's tokenizer directory, "
        f"or tokenizer.path={BUILTIN_NAME} for the built-in byte tokenizer (whose ids are not "
        "the model's)"
    )


def load_tokenizer(
    path_or_name: str | os.PathLike | None = None,
    *,
    model_path: str | os.PathLike | None = None,
) -> PreTrainedTokenizerBase:
    """The tokenizer ``tokenizer_source(path_or_name, model_path)`` names: the built-in one
    (``None``, ``"builtin:bytes"``), or a local directory loaded with ``AutoTokenizer``.

    Only local files are read (nothing can be downloaded here); a failure names the path.
    """
    path = tokenizer_source(path_or_name, model_path)
    if path is None:
        return builtin_tokenizer()
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"tokenizer path {path!r} is not a directory; pass a local tokenizer directory "
            f"(downloads are not possible) or {BUILTIN_NAME!r} for the built-in tokenizer"
        )
    if path_or_name is None and not has_tokenizer_files(path):
        raise ValueError(model_without_tokenizer(path))
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises many types; all mean "cannot load this path"
        raise ValueError(f"could not load a tokenizer from {path!r}: {exc}") from exc


def padded_vocab_size(tokenizer: PreTrainedTokenizerBase, multiple: int = 256) -> int:
    """Embedding rows a model needs for this tokenizer, rounded up (512 for the built-in one)."""
    n = len(tokenizer)
    return -(-n // multiple) * multiple


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    prompt: Prompt,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Prompt -> the exact text the model reads, by TRL's rules (``GRPOTrainer``).

    Plain text (TRL's "standard" format) stays as it is: no chat template. Chat messages
    ("conversational") go through the tokenizer's chat template with the generation prompt
    appended and ``chat_template_kwargs`` (``data.chat_template_kwargs``, e.g. Qwen's
    ``enable_thinking``) passed to the template, as TRL's ``chat_template_kwargs`` are.
    Without a template (TRL would fail) a single message is its content, and a conversation
    becomes ``role: content`` lines ending with ``assistant:``.
    """
    if isinstance(prompt, str):
        return prompt
    messages = list(prompt)
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
        )
    if len(messages) == 1:
        return messages[0]["content"]
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join([*lines, "assistant:"])


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase,
    prompt: Prompt,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Prompt -> token ids, as TRL's ``GRPOTrainer`` tokenizes its prompts. Chat-rendered text
    already holds its special tokens (BOS, turn markers), so it is encoded without adding
    more (``apply_chat_template(tokenize=True)`` does the same); plain text gets the
    tokenizer's usual special tokens (e.g. a BOS), as ``tokenizer(text)`` gives them."""
    text = render_prompt(tokenizer, prompt, chat_template_kwargs)
    templated = not isinstance(prompt, str) and has_chat_template(tokenizer)
    return tokenizer(text, add_special_tokens=not templated, verbose=False)["input_ids"]


def count_prompt_tokens(
    tokenizer: PreTrainedTokenizerBase,
    prompt: Prompt,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> int:
    return len(encode_prompt(tokenizer, prompt, chat_template_kwargs))
