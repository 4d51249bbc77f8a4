"""Chat messages → prompt: the model's Jinja template (with Hugging Face's raise_exception), text parts, refusals."""

import json

import pytest

from runtime.request import InvalidRequest
from runtime.server.chat import load_chat_template

TEMPLATE = ("{% for m in messages %}{% if loop.index0 == 0 and m['role'] == 'assistant' %}"
            "{{ raise_exception('Conversations must start with a user or system message') }}{% endif %}"
            "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture
def templated(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "</s>"}))
    return load_chat_template(tmp_path)


def test_template_and_text_parts(templated):
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    assert templated([{"role": "system", "content": "be brief"}, {"role": "user", "content": parts}]) == \
        "<|system|>be brief</s><|user|>hello</s><|assistant|>"


def test_template_refusal_is_a_client_error(templated):
    with pytest.raises(InvalidRequest, match="start with a user"):
        templated([{"role": "assistant", "content": "hi"}])


def test_plain_transcript_without_a_template(tmp_path):
    render = load_chat_template(tmp_path)
    assert render([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"


@pytest.mark.parametrize("messages,needle", [
    ("nope", "non-empty list"), ([], "non-empty list"), ([{"role": "wizard", "content": "x"}], "role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "text"),
    ([{"role": "user", "content": 5}], "string"), ([{"role": "user"}], "string"),
])
def test_bad_messages(tmp_path, messages, needle):
    with pytest.raises(InvalidRequest, match=needle):
        load_chat_template(tmp_path)(messages)


CALLS = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
CALLING_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% for c in m.get('tool_calls') or [] %}"
                    "<call>{{ c['function']['name'] }}</call>{% endfor %}{% endfor %}"
                    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.parametrize("content", [None, ""])
def test_an_assistants_tool_calls_appear_once(tmp_path, content):
    """A template renders tool_calls itself: they were also written into the content (twice in the prompt); the
    plain transcript dropped them when the content was "" (what many clients send) rather than null."""
    turns = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": content, "tool_calls": CALLS},
             {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    plain = load_chat_template(tmp_path)(turns)
    assert plain == ('user: weather?\nassistant: <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
                     '</tool_call>\ntool: sunny\nassistant:')
    (tmp_path / "t.jinja").write_text(CALLING_TEMPLATE)
    templated = load_chat_template(tmp_path, template_file=tmp_path / "t.jinja")(turns)
    assert templated == "<|user|>weather?<|assistant|><call>get_weather</call><|tool|>sunny<|assistant|>"
