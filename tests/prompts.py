"""Prompts for the oracle tests: plain text and chat, from about 10 to about 300 tokens."""

from __future__ import annotations

from serve_app.model.tokenizer import Tokenizer

_PASSAGE = (
    "The lighthouse stood at the end of a long stone pier, and every evening the keeper climbed its "
    "spiral stairs to light the great lamp. Ships far out at sea watched for its beam, counting the "
    "seconds between flashes to know which coast they had reached. In winter the storms were fierce, "
    "and waves broke over the pier so high that the keeper had to wait for a lull before crossing. "
)

SYSTEM_PROMPT = (
    "You are a careful assistant for a museum of maritime history. Answer questions about ships, "
    "harbours, navigation and the people who worked at sea. Keep answers short and factual, and say "
    "when you are unsure. Visitors are often children, so use simple words."
)


def oracle_prompts(tokenizer: Tokenizer) -> list[list[int]]:
    """Eight prompts of mixed lengths; the longest is about 300 tokens."""
    texts = [
        "Here is a fact about geography: the capital of France is",
        "# A small Python function\ndef fibonacci(n):\n    ",
        "Once upon a time, in a small village by the sea, there lived",
        _PASSAGE + "One night,",
        (_PASSAGE * 4) + "The keeper's daughter",
    ]
    prompts = [tokenizer.encode(text) for text in texts]
    chats = [
        [{"role": "user", "content": "What is the tallest mountain in the world?"}],
        [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": "What did a lighthouse keeper do?"},
        ],
        [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Name another one, and tell me something about it. " + _PASSAGE},
        ],
    ]
    prompts += [tokenizer.encode_chat(chat) for chat in chats]
    return prompts
