"""Chat messages → prompt text, with the tokenizer config's Jinja chat template when the model has one.

Without a template (base models, such as the bundled code pair) a plain transcript is used:
"<role>: <content>" lines followed by "assistant:".
"""

from __future__ import annotations

import json
from pathlib import Path

from ..request import InvalidRequest

ROLES = ("system", "user", "assistant", "tool", "developer")


def load_chat_template(engine_dir: Path, max_messages: int = 256, template_file: Path | None = None):
    """The model's chat template as render(messages, tools) → prompt; `template_file` (runtime serve
    --chat-template) replaces the tokenizer config's."""
    template, bos, eos = None, "", ""
    config = engine_dir / "tokenizer_config.json"
    if config.is_file():
        cfg = json.loads(config.read_text())
        template = cfg.get("chat_template")
        bos, eos = cfg.get("bos_token") or "", cfg.get("eos_token") or ""
    if template_file is not None:
        template = Path(template_file).read_text()
    if isinstance(template, list):   # named templates: take "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    compiled = None
    if template:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise   # what Hugging Face templates call to reject a conversation
        compiled = env.from_string(template)

    def render(messages, tools: list | None = None) -> str:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("messages must be a non-empty list")
        if len(messages) > max_messages:
            raise InvalidRequest(f"at most {max_messages} messages")
        messages = [_message(m, templated=compiled is not None) for m in messages]
        if compiled is not None:
            from jinja2 import TemplateError

            try:
                return compiled.render(messages=messages, tools=tools, add_generation_prompt=True, bos_token=bos,
                                       eos_token=eos)
            except TemplateError as e:
                raise InvalidRequest(f"the model's chat template rejects these messages: {e}") from None
        return _tool_preamble(tools) + "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"

    return render


def _raise(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)


def _tool_preamble(tools: list | None) -> str:
    """The plain transcript's tool declaration (templates render `tools` themselves), in the Hermes convention
    the auto tool parser reads back."""
    if not tools:
        return ""
    listed = "\n".join(json.dumps(t.get("function", t)) for t in tools)
    return (f"system: You may call these tools:\n{listed}\nTo call one, answer only "
            f'<tool_call>{{"name": <name>, "arguments": <arguments object>}}</tool_call>\n')


def _message(m, templated: bool) -> dict:
    """One message with string content; OpenAI's list-of-parts content is accepted when every part is text. An
    assistant message's tool calls go to a template as they are (it renders `tool_calls`); in the plain
    transcript they follow its content in the Hermes convention (content null or "": clients send either)."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise InvalidRequest(f"each message needs a role ({', '.join(ROLES)}) and content")
    content = m.get("content")
    calls = m.get("tool_calls")
    if m["role"] == "assistant" and calls:
        if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls):
            raise InvalidRequest("tool_calls must be a list of {\"function\": {\"name\", \"arguments\"}} objects")
        if content is None:
            content = ""
        if not templated and isinstance(content, str):
            content += "".join(f'<tool_call>{{"name": {json.dumps(c["function"].get("name"))}, "arguments": '
                               f'{c["function"].get("arguments") or "{}"}}}</tool_call>' for c in calls)
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise InvalidRequest("message content parts must all be text (this model reads text only)")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise InvalidRequest("message content must be a string or a list of text parts")
    return {**m, "content": content}
