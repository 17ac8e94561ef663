"""A fixed, seeded prompt set mixing short chat questions and long (about 300-token) passages."""

from __future__ import annotations

import random

_TOPICS = [
    "the history of the printing press", "how bees find flowers", "why the sky is blue",
    "the rules of chess", "a trip to the mountains", "how to bake bread", "the life of a lighthouse keeper",
    "volcanoes and earthquakes", "the first computers", "a city at night", "the migration of whales",
    "learning a new language", "the planets of the solar system", "a small village market",
]
WORDS = (
    "river stone light early window garden morning quiet market story north winter paper signal "
    "harbor bridge engine careful ancient music letter forest machine simple bright travel answer "
    "question number minute record summer valley castle reason friend change water distant voice"
).split()


def make_prompts(count: int, seed: int = 0, long_every: int = 4, long_words: int = 280) -> list[str]:
    """`count` prompts; every `long_every`-th one is a long passage followed by a question."""
    rng = random.Random(seed)
    prompts = []
    for index in range(count):
        topic = rng.choice(_TOPICS)
        if long_every and index % long_every == long_every - 1:
            passage = " ".join(rng.choice(WORDS) for _ in range(long_words))
            prompts.append(f"Read these notes: {passage}.\nNow write a short essay about {topic}.")
        else:
            prompts.append(f"Tell me about {topic}.")
    return prompts


def long_passage(tokenizer, tokens: int, rng: random.Random) -> str:
    """A passage of filler words about `tokens` tokens long under `tokenizer`."""
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words))) < tokens:
        words.extend(rng.choice(WORDS) for _ in range(50))
    while len(tokenizer.encode(" ".join(words))) > tokens:
        words.pop()
    return " ".join(words)
