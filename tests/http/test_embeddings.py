"""`/v1/embeddings` in OpenAI's shape, through the OpenAI SDK and LangChain's `OpenAIEmbeddings`: each vector is the
last token's final hidden state, L2-normalized (vLLM's pooling of a decoder model), checked against transformers'
own forward; floats or base64; computed in the engine's batches beside generations, which it leaves unchanged."""

from __future__ import annotations

import threading

import httpx
import numpy as np
import openai
import pytest
import torch

from serve_app.engine.engine import InferenceEngine
from tests.inprocess import MODEL, InProcessServer
from tests.references import ReferenceModel

TEXTS = ["Hello world", "The capital of France is Paris.", "def add(a, b):\n    return a + b"]


def transformers_embedding(reference: ReferenceModel, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        state = reference.model.model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(state, dim=-1).numpy()


def test_embeddings_are_the_last_tokens_normalized_hidden_state(
    oai: openai.OpenAI, engine: InferenceEngine, reference: ReferenceModel
) -> None:
    answer = oai.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64 and decodes it
    ids = [engine.tokenizer.encode(text) for text in TEXTS]
    assert [d.index for d in answer.data] == [0, 1, 2] and answer.usage.prompt_tokens == sum(map(len, ids))
    for data, prompt in zip(answer.data, ids):
        assert len(data.embedding) == engine.hidden_size
        np.testing.assert_allclose(data.embedding, transformers_embedding(reference, prompt), atol=2e-5)
    as_ids = oai.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    for by_text, by_ids in zip(answer.data, as_ids.data):
        np.testing.assert_allclose(by_text.embedding, by_ids.embedding, atol=1e-6)


def test_langchain_embeds_documents_and_queries(server: InProcessServer, oai: openai.OpenAI) -> None:
    from langchain_openai import OpenAIEmbeddings

    # Token-length checks would need tiktoken's OpenAI vocabularies: off, as for any server that is not OpenAI.
    embeddings = OpenAIEmbeddings(model=MODEL, base_url=f"{server.url}/v1", api_key="unused", check_embedding_ctx_length=False)
    documents = embeddings.embed_documents(TEXTS[:2])
    query = embeddings.embed_query(TEXTS[0])
    direct = oai.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float").data[0].embedding
    np.testing.assert_allclose(documents[0], direct, atol=1e-6)
    np.testing.assert_allclose(query, direct, atol=1e-6)
    assert not np.allclose(documents[0], documents[1], atol=1e-3)


def test_an_embedding_beside_a_generation_changes_neither(oai: openai.OpenAI) -> None:
    prompt = "Once upon a time"
    alone_text = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0).choices[0].text
    alone_vector = oai.embeddings.create(model=MODEL, input=TEXTS[1]).data[0].embedding
    vectors: list[list[float]] = []
    stream = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stream=True)
    pieces = [next(iter(stream)).choices[0].text]  # the generation is running
    worker = threading.Thread(target=lambda: vectors.append(oai.embeddings.create(model=MODEL, input=TEXTS[1]).data[0].embedding))
    worker.start()
    pieces += [chunk.choices[0].text for chunk in stream if chunk.choices]
    worker.join(timeout=60)
    assert "".join(pieces) == alone_text
    np.testing.assert_allclose(vectors[0], alone_vector, atol=1e-5)


@pytest.mark.parametrize(
    "body,param,words",
    [
        ({"input": "Hi", "dimensions": 64}, "dimensions", "cannot be shortened"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": ["word"] * 1000}, "input", "over max_choices"),
        ({"input": [""]}, "input", "must not be empty"),
        ({"input": [10**9]}, "input", "outside the vocabulary"),
        ({"input": "Hi", "encoding_format": "int8"}, "encoding_format", ""),
        ({"input": "word " * 9000}, "input", "max_prompt_characters"),
        ({"input": [7] * 3000}, "input", "an embedding can read"),
    ],
)
def test_bad_embedding_requests_are_400s_naming_the_field(server: InProcessServer, body: dict, param: str, words: str) -> None:
    answer = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_dimensions_equal_to_the_models_are_accepted(oai: openai.OpenAI, engine: InferenceEngine) -> None:
    answer = oai.embeddings.create(model=MODEL, input="Hi", dimensions=engine.hidden_size)
    assert len(answer.data[0].embedding) == engine.hidden_size
