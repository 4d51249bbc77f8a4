"""Chat messages → prompt text, with the tokenizer config's Jinja chat template when the model has one.

Without a template (base models, such as the bundled code pair) a plain transcript is used:
"<role>: <content>" lines followed by "assistant:".
"""

from __future__ import annotations

import json
from pathlib import Path

from ..request import InvalidRequest

ROLES = ("system", "user", "assistant", "tool", "developer")


def load_chat_template(engine_dir: Path, max_messages: int = 256):
    template = None
    config = engine_dir / "tokenizer_config.json"
    if config.is_file():
        cfg = json.loads(config.read_text())
        template = cfg.get("chat_template")
        bos, eos = cfg.get("bos_token") or "", cfg.get("eos_token") or ""
    if isinstance(template, list):   # named templates: take "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    compiled = None
    if template:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        compiled = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)

    def render(messages) -> str:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("messages must be a non-empty list")
        if len(messages) > max_messages:
            raise InvalidRequest(f"at most {max_messages} messages")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise InvalidRequest("each message needs a role (system, user, assistant, tool) and string content")
        if compiled is not None:
            return compiled.render(messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"

    return render
