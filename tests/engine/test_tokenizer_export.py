"""The tokenizer the server's processes load without torch tokenizes, renders and decodes as transformers' does."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from jinja2 import TemplateError

from serve_app.model.tokenizer import Tokenizer
from serve_app.wire.refusals import InvalidRequestError
from tests.http.test_tool_formats import ASK, HISTORY, MARKERS, TEMPLATES, WEATHER
from tests.model_families import qwen3_tokenizer, template
from tests.tiny_models import tokenizer_with_tokens

TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing newline\n\n",
    "日本語のテキスト 🙂 café, naïve — ½ ∑",
    "<|im_start|>user\nspecial tokens written as text<|im_end|>",
    "don 't , isn 't . Is it ? Yes !",
    "def f(x):\n\treturn x  # tabs\r\n",
]


@pytest.fixture(scope="module", params=["embedded", "qwen3", *sorted(TEMPLATES)])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Path:
    """A tokenizer folder: the embedded model's, Qwen3's with its template, or the embedded one with a family's
    markers as added tokens and that family's real template."""
    name = request.param
    if name == "embedded":
        return model_path
    if name == "qwen3":
        return qwen3_tokenizer()
    tokens, special = MARKERS[name]
    made = tokenizer_with_tokens(model_path, tmp_path_factory.mktemp(f"{name}-tokenizer"), tokens, special)
    shutil.copy(template(TEMPLATES[name]), made / "chat_template.jinja")
    return made


def test_it_tokenizes_renders_and_decodes_as_transformers_does(folder: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    ours = Tokenizer(folder)
    assert ours.vocab_size == len(hf) and hf.eos_token_id in ours.eos_token_ids
    for text in TEXTS:
        for special in (True, False):
            ids = hf.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            assert ours.decode(ids, skip_special_tokens=special) == hf.decode(ids, skip_special_tokens=special)
            assert ours.token_strings(ids) == hf.convert_ids_to_tokens(ids)
    for messages, tools in ((ASK, None), (ASK, [WEATHER]), (HISTORY, [WEATHER])):
        for generation_prompt in (True, False):
            try:
                expected = hf.apply_chat_template(
                    messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
                )
            except Exception as error:  # the embedded template wants every message's content, Qwen3-Coder's a
                # call's arguments as a mapping: the same refusal (a template's own error as a request's)
                refusal = InvalidRequestError if isinstance(error, TemplateError) else type(error)
                with pytest.raises(refusal, match=re.escape(str(error))):
                    ours.apply_chat_template(messages, generation_prompt, tools)
                continue
            assert ours.apply_chat_template(messages, generation_prompt, tools) == expected
            assert ours.encode_chat(messages, generation_prompt, tools) == hf.encode(expected, add_special_tokens=False)


def test_template_variables_reach_the_template() -> None:
    from transformers import AutoTokenizer

    folder = qwen3_tokenizer()
    hf = AutoTokenizer.from_pretrained(folder)
    expected = hf.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert Tokenizer(folder).apply_chat_template(ASK, template_kwargs={"enable_thinking": False}) == expected
    assert expected.endswith("<think>\n\n</think>\n\n")


def test_a_process_that_tokenizes_never_imports_torch(model_path: Path, tmp_path: Path) -> None:
    """The first load exports the tokenizer in a child process; the process itself, and a later load from the
    export, map no torch."""
    script = (
        "import sys, json; from pathlib import Path; from serve_app.model.tokenizer import Tokenizer\n"
        "t = Tokenizer(Path(sys.argv[1]), cache_dir=Path(sys.argv[2]))\n"
        "print(json.dumps([t.encode_chat([{'role': 'user', 'content': 'Hi'}]), 'torch' in sys.modules]))\n"
    )
    runs = [
        subprocess.run([sys.executable, "-c", script, str(model_path), str(tmp_path)], capture_output=True, text=True)
        for _ in range(2)
    ]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr
    answers = [json.loads(r.stdout.strip().splitlines()[-1]) for r in runs]
    expected = Tokenizer(model_path).encode_chat([{"role": "user", "content": "Hi"}])
    assert answers == [[expected, False], [expected, False]]
    assert len(list((tmp_path / "tokenizers").glob("*.json"))) == 1  # made once, read the second time


def test_a_changed_tokenizer_file_makes_a_new_export(model_path: Path, tmp_path: Path) -> None:
    folder, cache = tmp_path / "model", tmp_path / "cache"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(model_path / name, folder / name)
    before = Tokenizer(folder, cache_dir=cache).apply_chat_template(ASK)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert before != "[What is the weather in Paris?]"
    assert Tokenizer(folder, cache_dir=cache).apply_chat_template(ASK) == "[What is the weather in Paris?]"
