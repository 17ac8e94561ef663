"""Seeded prompt sets: short chat questions mixed with long (about 300-token) passages, and input-grounded
chats whose answers repeat their input, edited (a passage to proofread, a JSON record to change), the
traffic n-gram speculation pays off on."""

from __future__ import annotations

import json
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


SENTENCES = (
    "The harbor lights came on one by one as the fishing boats returned.",
    "Every morning the baker opened the shop before the sun was up.",
    "A narrow bridge of old stone crossed the river below the castle.",
    "The library kept its oldest maps in a cool room without windows.",
    "Children ran through the market square chasing a small brown dog.",
    "The train to the north left at seven and arrived after dark.",
    "Snow covered the valley and the roads were closed for two days.",
    "She wrote a long letter to her brother who lived across the sea.",
    "The engine made a quiet humming sound as the machine started.",
    "In summer the garden was full of bees, roses and tall sunflowers.",
)
_NAMES = ("Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald", "Frances", "Ken")
_CITIES = ("Lisbon", "Oslo", "Kyoto", "Quito", "Cairo", "Perth", "Lima", "Turin")


def grounded_chats(count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """`count` single-turn chats whose answers are mostly their own input, edited: a passage with misspelt
    words to write out corrected, a passage with wrong articles to write out in good grammar, a JSON
    record to show again with one field changed."""
    rng = random.Random(seed)
    chats = []
    for index in range(count):
        sentences = rng.sample(SENTENCES, 4)
        match index % 3:
            case 0:
                passage = " ".join(_misspell(sentence, rng) for sentence in sentences)
                text = f"Fix the spelling mistakes in this paragraph and write it out again in full:\n\n{passage}"
            case 1:
                passage = " ".join(sentences).replace(" the ", " a ", 2)
                text = f"Correct the grammar of this text and write it out again in full:\n\n{passage}"
            case _:
                record = {"name": rng.choice(_NAMES), "city": rng.choice(_CITIES), "age": rng.randint(20, 70),
                          "languages": rng.sample(["python", "c", "rust", "go", "java"], 2)}
                text = (f"Here is a JSON record:\n```json\n{json.dumps(record, indent=2)}\n```\nChange the city to "
                        f"{rng.choice(_CITIES)} and show the full updated JSON.")
        chats.append([{"role": "user", "content": text}])
    return chats


def _misspell(sentence: str, rng: random.Random) -> str:
    """`sentence` with one letter dropped from one of its longer words."""
    words = sentence.split()
    index = rng.choice([i for i, word in enumerate(words) if len(word) > 4])
    cut = rng.randrange(1, len(words[index]) - 1)
    words[index] = words[index][:cut] + words[index][cut + 1 :]
    return " ".join(words)
