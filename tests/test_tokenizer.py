"""pdserve.engine.text.tokenizer against transformers loading the same (demo) directory."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import jinja2
import jinja2.sandbox
import pytest
from transformers import AutoTokenizer

from pdserve.engine.model.demo import make_model
from pdserve.engine.model.demo_corpus import ENDOFTEXT, IM_END, IM_START
from pdserve.engine.text.tokenizer import Tokenizer

TEXTS = [
    "Hello world 😀 你好，世界！",
    "<|im_start|>user\nhi there<|im_end|>\n<|endoftext|>",
    "  leading spaces\n\n\ttabs and trailing ",
    "def f(x):\n    return x ** 2  # Größe ≈ 4.0 🚀🇫🇷",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi ☃"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! 你好"}, {"role": "user", "content": "More, please."}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": None,
      "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "18 °C"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("demo") / "tiny-llama", "tiny", "llama")


@pytest.fixture(scope="module")
def tok(demo_dir) -> Tokenizer:
    return Tokenizer.from_dir(demo_dir)


@pytest.fixture(scope="module")
def hf(demo_dir):
    return AutoTokenizer.from_pretrained(str(demo_dir))


def _copy(demo_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(demo_dir, tmp_path / "copy"))


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def _random_text(rng: random.Random, n: int) -> str:
    pool = "abcxyz ABC\n\t.,!?'\"(){}0123456789éüßçñЖжλπ中文你好世界こんにちは한국😀🚀🔥👍🏽—€"
    return "".join(rng.choice(pool) for _ in range(n))


def test_special_token_ids(tok, hf):
    assert tok.vocab_size == len(hf) == 1024
    assert tok.bos_token_id == hf.bos_token_id == hf.convert_tokens_to_ids(ENDOFTEXT)
    assert tok.eos_token_ids == {hf.convert_tokens_to_ids(IM_END), hf.convert_tokens_to_ids(ENDOFTEXT)}
    assert tok.add_bos is False
    assert all(tok.is_special(hf.convert_tokens_to_ids(t)) for t in (ENDOFTEXT, IM_START, IM_END))
    assert not tok.is_special(tok.encode("Hello")[0])


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok, hf, text):
    ids = tok.encode(text)
    assert ids == hf.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False) == text


def test_random_text_and_ids_match_transformers(tok, hf):
    rng = random.Random(0)
    for _ in range(50):
        text = _random_text(rng, rng.randrange(1, 80))
        assert tok.encode(text) == hf.encode(text)
        assert tok.decode(tok.encode(text)) == text
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_template_matches_transformers(tok, hf, messages, add_generation_prompt, tools):
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    assert text == hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                          tokenize=False)
    assert text.startswith(IM_START)
    ids = tok.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    assert ids == hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         tokenize=True, return_dict=False)


def test_template_errors_surface(tok):
    with pytest.raises(jinja2.TemplateError, match="unknown role"):
        tok.apply_chat_template([{"role": "wizard", "content": "hi"}])


def test_template_is_sandboxed(demo_dir, tmp_path):
    model_dir = _copy(demo_dir, tmp_path)
    (model_dir / "chat_template.jinja").write_text("{{ messages.append(1) }}")
    with pytest.raises(jinja2.sandbox.SecurityError):
        Tokenizer.from_dir(model_dir).apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_globals_and_filters(demo_dir, tmp_path):
    model_dir = _copy(demo_dir, tmp_path)
    template = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{{ bos_token }}{{ m | tojson }}{% generation %}|{{ eos_token }}{% endgeneration %}{% endfor %}"
                "{{ strftime_now('%Y') | length }}")
    (model_dir / "chat_template.jinja").write_text(template)
    messages = [{"role": "user", "content": "héllo <b>"}, {"role": "user", "content": "dropped"}]
    expected = ENDOFTEXT + '{"role": "user", "content": "héllo <b>"}|' + IM_END + "4"
    assert Tokenizer.from_dir(model_dir).apply_chat_template(messages) == expected


def test_jinja_file_overrides_config_and_named_list(demo_dir, tmp_path):
    model_dir = _copy(demo_dir, tmp_path)
    _edit_json(model_dir / "tokenizer_config.json",
               chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages | length }}"}])
    assert Tokenizer.from_dir(model_dir).apply_chat_template([{"role": "user", "content": "x"}]) == "D1"
    (model_dir / "chat_template.jinja").write_text("J")
    assert Tokenizer.from_dir(model_dir).apply_chat_template([]) == "J"


def test_missing_template_names_directory(demo_dir, tmp_path):
    model_dir = _copy(demo_dir, tmp_path)
    _edit_json(model_dir / "tokenizer_config.json", chat_template=None)
    tok = Tokenizer.from_dir(model_dir)
    assert tok.decode(tok.encode("still works")) == "still works"
    with pytest.raises(ValueError, match=str(model_dir)):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_or_malformed_tokenizer_json(demo_dir, tmp_path):
    model_dir = _copy(demo_dir, tmp_path)
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(model_dir)
    (model_dir / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(model_dir)
    (model_dir / "tokenizer.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(model_dir)


def test_malformed_config_names_file(demo_dir, tmp_path):
    model_dir = _copy(demo_dir, tmp_path)
    (model_dir / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json"):
        Tokenizer.from_dir(model_dir)


def test_eos_fallback_and_int_eos(demo_dir, tmp_path, hf):
    model_dir = _copy(demo_dir, tmp_path)
    (model_dir / "generation_config.json").unlink()
    _edit_json(model_dir / "config.json", eos_token_id=hf.convert_tokens_to_ids(ENDOFTEXT))
    assert Tokenizer.from_dir(model_dir).eos_token_ids == {hf.convert_tokens_to_ids(ENDOFTEXT)}
    _edit_json(model_dir / "config.json", eos_token_id=None)
    assert Tokenizer.from_dir(model_dir).eos_token_ids == {hf.convert_tokens_to_ids(IM_END)}


def test_bos_from_post_processor_is_not_doubled(demo_dir, tmp_path):
    """A Llama-3-style tokenizer: the post-processor adds BOS and the template writes it too."""
    model_dir = _copy(demo_dir, tmp_path)
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text())
    bos_id = tokenizer_json["added_tokens"][0]["id"]
    tokenizer_json["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": ENDOFTEXT, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": ENDOFTEXT, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {ENDOFTEXT: {"id": ENDOFTEXT, "ids": [bos_id], "tokens": [ENDOFTEXT]}},
    }
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.pop("add_bos_token")
    config["chat_template"] = "{{ bos_token }}" + config["chat_template"]
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tok, hf = Tokenizer.from_dir(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    assert tok.add_bos
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text)
        assert tok.encode(text)[0] == bos_id
    for messages in CONVERSATIONS:
        ids = tok.encode_chat(messages)
        assert ids == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ids[0] == bos_id != ids[1]


def test_post_processor_decides_over_add_bos_token(demo_dir, tmp_path):
    model_dir = _copy(demo_dir, tmp_path)
    _edit_json(model_dir / "tokenizer_config.json", add_bos_token=True)
    tok, hf = Tokenizer.from_dir(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    assert not tok.add_bos
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text)


def test_add_bos_token_without_post_processor(demo_dir, tmp_path):
    model_dir = _copy(demo_dir, tmp_path)
    _edit_json(model_dir / "tokenizer_config.json", add_bos_token=True)
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer_json["post_processor"] = None
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    tok = Tokenizer.from_dir(model_dir)
    assert tok.add_bos
    plain = tok.encode(TEXTS[0], add_special_tokens=False)
    assert tok.encode(TEXTS[0]) == [tok.bos_token_id, *plain]
    text = tok.apply_chat_template(CONVERSATIONS[1])
    assert tok.encode_chat(CONVERSATIONS[1]) == [tok.bos_token_id, *tok.encode(text, add_special_tokens=False)]
