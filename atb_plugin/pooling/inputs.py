"""Pooling prompts from text, in the frontend (the offline ``LLM`` and the server's tokenizer
workers share these): single texts, and sentence pairs for cross-encoders.

Truncation keeps the START of a text (the tokenizer's right-side truncation, vLLM's rule for
pooling: an embedding is about what a document opens with; generation instead keeps the end of a
conversation). ``truncate_prompt_tokens``: None = no truncation (a prompt over ``max_model_len``
is an error naming both numbers), -1 = ``max_model_len``, k >= 1 = at most k tokens.
"""

from __future__ import annotations

__all__ = ["truncation_length", "text_ids", "token_ids", "pair_ids", "score_pairs", "check_prompt_length"]


def truncation_length(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    if truncate_prompt_tokens is None:
        return None
    if isinstance(truncate_prompt_tokens, bool) or not isinstance(truncate_prompt_tokens, int) \
            or truncate_prompt_tokens == 0 or truncate_prompt_tokens < -1:
        raise ValueError(f"truncate_prompt_tokens must be -1 (the model's max_model_len) or an int >= 1, got "
                         f"{truncate_prompt_tokens!r}")
    if truncate_prompt_tokens > max_model_len:
        raise ValueError(f"truncate_prompt_tokens = {truncate_prompt_tokens} is larger than max_model_len "
                         f"({max_model_len})")
    return max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    if num_tokens == 0:
        raise ValueError("the input is empty after tokenization")
    if num_tokens > max_model_len:
        raise ValueError(f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                         f"{num_tokens} input tokens. Please reduce the length of the input, or set "
                         "truncate_prompt_tokens to truncate it")


def text_ids(tokenizer, text: str, max_model_len: int, truncate_to: int | None = None) -> list[int]:
    """Token ids of one text with the tokenizer's special tokens (BERT: [CLS] … [SEP]); cut to
    ``truncate_to`` tokens from the right, special tokens kept, when given."""
    if not isinstance(text, str):
        raise ValueError(f"an input must be a string, got {type(text).__name__}")
    if truncate_to is None:
        ids = tokenizer(text)["input_ids"]
    else:
        ids = tokenizer(text, truncation=True, max_length=truncate_to)["input_ids"]
    check_prompt_length(len(ids), max_model_len)
    return list(ids)


def token_ids(ids: list[int], max_model_len: int, truncate_to: int | None = None) -> list[int]:
    """A client's token-id input, cut to ``truncate_to`` from the right when given."""
    ids = list(ids[:truncate_to]) if truncate_to is not None else list(ids)
    check_prompt_length(len(ids), max_model_len)
    return ids


def pair_ids(tokenizer, first: str, second: str, max_model_len: int,
             truncate_to: int | None = None) -> tuple[list[int], int | None]:
    """``(ids, token_type_start)`` of a sentence pair as the tokenizer encodes it for a
    cross-encoder (BERT: ``[CLS] a [SEP] b [SEP]``, ``b`` and its [SEP] of token type 1);
    ``token_type_start`` is None when the tokenizer makes no token types (decoders)."""
    for name, text in (("the first text", first), ("the second text", second)):
        if not isinstance(text, str):
            raise ValueError(f"{name} of a pair must be a string, got {type(text).__name__}")
    kwargs = {"truncation": True, "max_length": truncate_to} if truncate_to is not None else {}
    encoded = tokenizer(first, second, return_token_type_ids=True, **kwargs)
    ids = list(encoded["input_ids"])
    check_prompt_length(len(ids), max_model_len)
    types = encoded.get("token_type_ids") or []
    start = next((i for i, t in enumerate(types) if t == 1), None)
    return ids, start


def score_pairs(first: list, second: list, names: tuple[str, str] = ("text_1", "text_2")) -> list[tuple]:
    """The pairs a score request means: one text against each of N (1 -> N) or pairwise (N -> N);
    other shapes are a ValueError naming the two sides (``names``). The same rule pairs the two
    sides' embeddings when an embedding model scores by cosine similarity."""
    if not first or not second:
        raise ValueError(f"{names[0]} and {names[1]} each need at least one text")
    if len(first) > 1 and len(first) != len(second):
        raise ValueError(f"{names[0]} and {names[1]} pair 1 -> N or N -> N; got {len(first)} and "
                         f"{len(second)} texts")
    return list(zip(first * len(second) if len(first) == 1 else first, second))
