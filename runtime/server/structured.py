"""OpenAI structured output and tool calling over constrained decoding: `response_format` and `tools` /
`tool_choice` → a Constraint for the engine, and the generated text → OpenAI `tool_calls` (whole or as deltas).

tool_choice "required" and a named function constrain the output (a named function's arguments follow its
parameters schema; "required" generates {"name": …, "arguments": …} for one of the tools). "auto" lets the model
choose: a reply that starts with <tool_call> (the Hermes / Qwen convention chat templates carry) is parsed into
tool calls, anything else is text. One request yields at most one constrained call ("required", named).
"""

from __future__ import annotations

import json
import re

from ..constraints import Constraint, check_schema
from ..request import InvalidRequest, new_id

TAG_OPEN, TAG_CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CALL = re.compile(re.escape(TAG_OPEN) + r"\s*(.*?)\s*" + re.escape(TAG_CLOSE), re.S)


def response_format(body: dict) -> Constraint | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequest('response_format.type must be "text", "json_object" or "json_schema"')
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return Constraint("json_object")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise InvalidRequest("response_format.json_schema must be an object with a schema")
    name = spec.get("name", "response")
    if not isinstance(name, str) or not NAME.match(name):
        raise InvalidRequest("response_format.json_schema.name must be 1-64 letters, digits, _ or -")
    check_schema(spec["schema"])
    return Constraint.json_schema(spec["schema"])


class ToolRequest:
    """A chat request's tools and tool_choice, checked: mode is None (no tools, or "none"), "auto", "required" or
    "named"."""

    def __init__(self, body: dict):
        for key in ("functions", "function_call"):
            if body.get(key) is not None:
                raise InvalidRequest(f"{key} is deprecated by OpenAI and not supported: use tools and tool_choice")
        tools = body.get("tools")
        if tools is None:
            tools = []
        if not isinstance(tools, list) or len(tools) > 128:
            raise InvalidRequest("tools must be a list of at most 128 function tools")
        self.functions: dict[str, dict] = {}
        for tool in tools:
            fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not NAME.match(fn["name"]):
                raise InvalidRequest('each tool must be {"type": "function", "function": {"name": (1-64 letters, '
                                     'digits, _ or -), "parameters": {...}}}')
            params = fn.get("parameters", {"type": "object", "properties": {}})
            check_schema(params)
            if fn["name"] in self.functions:
                raise InvalidRequest(f"tool {fn['name']!r} is declared twice")
            self.functions[fn["name"]] = params
        self.tools = tools
        choice = body.get("tool_choice", "auto" if tools else "none")
        self.name = None
        if isinstance(choice, dict):
            fn = choice.get("function") if choice.get("type") == "function" else None
            self.name = fn.get("name") if isinstance(fn, dict) else None
            if self.name not in self.functions:
                raise InvalidRequest(f"tool_choice names a function that is not among the tools: {self.name!r}")
            self.mode = "named"
        elif choice in ("none", "auto", "required"):
            if choice != "none" and not tools:
                raise InvalidRequest(f'tool_choice "{choice}" needs tools')
            self.mode = None if choice == "none" else choice
        else:
            raise InvalidRequest('tool_choice must be "none", "auto", "required" or {"type": "function", ...}')

    def constraint(self) -> Constraint | None:
        if self.mode == "named":
            return Constraint.json_schema(self.functions[self.name])
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                      "required": ["name", "arguments"], "additionalProperties": False}
                     for name, params in self.functions.items()]
            return Constraint.json_schema(calls[0] if len(calls) == 1 else {"anyOf": calls})
        return None

    def output(self) -> "ToolCallOutput | None":
        return ToolCallOutput(self.mode, self.name) if self.mode else None


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _call(name: str, arguments: str) -> dict:
    return {"id": new_id("call_"), "type": "function", "function": {"name": name, "arguments": arguments}}


class ToolCallOutput:
    """One choice's generated text → chat deltas and the final message, for the tool modes. Named: the text is
    the arguments, streamed as they come. Required: the text is {"name", "arguments"}, sent once complete. Auto:
    text that starts with <tool_call> is held and parsed at the end; other text streams as content."""

    def __init__(self, mode: str, name: str | None):
        self.mode, self.name = mode, name
        self.text, self.sent, self.passthrough, self.calls = "", False, False, []

    def delta(self, text: str) -> list[dict]:
        """Deltas to send for newly generated `text`."""
        self.text += text
        if self.mode == "named":
            if not self.sent:
                self.sent = True
                call = _call(self.name, self.text)
                self.calls.append(call)
                return [{"tool_calls": [{"index": 0, **call, "function": dict(call["function"])}]}]
            self.calls[0]["function"]["arguments"] = self.text
            return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else []
        if self.mode == "auto" and not self.passthrough:
            stripped = self.text.lstrip()
            if TAG_OPEN.startswith(stripped) or stripped.startswith(TAG_OPEN):
                return []                                  # maybe a tool call: hold it
            self.passthrough = True
            return [{"content": self.text}]
        if self.passthrough:
            return [{"content": text}] if text else []
        return []

    def finish(self, reason: str | None) -> tuple[list[dict], str | None]:
        """Deltas still held back, and the choice's finish reason ("tool_calls" when it called)."""
        if self.mode == "named":     # a call only when its arguments are whole (a stop string can cut them)
            out = self.delta("") if not self.sent else []
            return out, "tool_calls" if reason == "stop" and _parses(self.text) else reason
        if self.passthrough:
            return [], reason
        calls = self._parse()
        if calls is None:                                  # not a well-formed call: it was text after all
            return ([{"content": self.text}] if self.text else []), reason
        self.calls = calls
        return [{"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}], "tool_calls" if reason == "stop" else reason

    def _parse(self) -> list[dict] | None:
        try:
            if self.mode == "required":
                found = [json.loads(self.text)]
            else:
                found = [json.loads(m) for m in CALL.findall(self.text)]
                if not found or CALL.sub("", self.text).strip():
                    return None
            calls = []
            for c in found:
                if not isinstance(c, dict) or not isinstance(c.get("name"), str):
                    return None
                calls.append(_call(c["name"], json.dumps(c.get("arguments", {}))))
            return calls
        except ValueError:
            return None

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """The whole choice's message and finish reason (non-streaming)."""
        self.delta(text)
        reason = self.finish(reason)[1]
        if self.calls:                                     # set only when the text was (or is, named) a call
            return {"role": "assistant", "content": None, "tool_calls": self.calls}, reason
        return {"role": "assistant", "content": self.text}, reason
