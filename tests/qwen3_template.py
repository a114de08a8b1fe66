"""A Qwen3 checkpoint written by transformers with a Qwen3-style chat template (enable_thinking) and sampling
defaults in its generation_config.json, and an engine serving it (fixtures for the server tests)."""
from __future__ import annotations

import json
import shutil

import pytest

from pdserve.engine.engine import Engine
from tests.models import SLOS_SET, engine_config, hf_checkpoint

# Qwen3's chat template, cut to what these tests exercise: history without its reasoning, and enable_thinking
QWEN3_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' + content }}
        {%- if not loop.last %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
GENERATION_DEFAULTS = {"temperature": 0.0, "top_k": 20, "max_new_tokens": 5}
CHAT = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Is the sea blue?"},
        {"role": "assistant", "content": "<think>\nthe user asks\n</think>\n\nMostly."},
        {"role": "user", "content": "Why?"}]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """The checkpoint, with the template above and generation_config.json defaults: temperature 0, top_k 20 and
    max_new_tokens 5."""
    out = tmp_path_factory.mktemp("qwen3-template") / "qwen3-tiny"
    shutil.copytree(hf_checkpoint("qwen3"), out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").write_text(QWEN3_TEMPLATE)
    generation = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**generation, **GENERATION_DEFAULTS}))
    return out


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    built = Engine(engine_config(qwen3_dir, mode="colocated", max_model_len=512, **SLOS_SET))
    yield built
    built.close()


@pytest.fixture(scope="module")
def hf_tokenizer(qwen3_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_dir)
