"""Constrained decoding with the bundled pair: every output of a constrained request parses and validates against
its schema (random schemas, greedy and sampled), greedy constrained speculation equals greedy constrained decoding,
and the OpenAI API's response_format and tools work end to end through the official client and over gRPC."""

import json

import grpc
import httpx
import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from runtime.client import Client
from runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from runtime.constraints import Constraint, GrammarFailed, Grammars
from runtime.engine import Engine
from runtime.request import InvalidRequest, SamplingParams
from runtime.server.structured import ToolCallOutput
from runtime.spec_decode.speculator import SpecConfig

from server_harness import ServerThread
from test_engine import assert_same_greedy_across_attention_kernels, run_all

CACHE = CacheConfig(kv_budget_bytes=256 << 20)
PROMPTS = ["def fibonacci(n):\n", "config = ", "# settings\nDEFAULTS = ", "class Point:\n", "data = json.loads("]

# Bounded leaves (strings with maxLength, integers in a range, enums): every schema has a finite longest output,
# so a request that ends with "stop" must have completed it.
names = st.from_regex(r"[a-z][a-z_]{0,7}", fullmatch=True)
leaves = st.one_of(
    st.integers(1, 12).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-1000, 1000), st.integers(0, 5000)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.text("abcxyz _", min_size=1, max_size=6), min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
)


def objects(children):
    return st.dictionaries(names, children, min_size=1, max_size=4).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {"type": "object", "properties": props, "required": req, "additionalProperties": False}))


schemas = objects(st.recursive(leaves, lambda c: st.one_of(
    objects(c), c.map(lambda item: {"type": "array", "items": item, "maxItems": 3})), max_leaves=6))


@pytest.fixture(scope="module")
def target(bundled):
    return Engine(bundled["target"], EngineConfig(SchedulerConfig(max_num_seqs=8), CACHE))


def longest_tokens(schema: dict) -> int:
    """At least the tokens of the longest output `schema` admits, in the engine's one-line JSON (", " and ": "
    separators): a token is at least one byte, and a string's character at most six (an escape such as \\u00e9)."""
    if schema.get("type") == "string":
        return 6 * schema["maxLength"] + 2
    if schema.get("type") == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if schema.get("type") in ("boolean", "null"):
        return 5
    if "enum" in schema:
        return max(len(json.dumps(v)) for v in schema["enum"])
    if schema.get("type") == "array":
        return 2 + schema["maxItems"] * (longest_tokens(schema["items"]) + 2)
    return 2 + sum(len(json.dumps(k)) + 4 + longest_tokens(v) for k, v in schema["properties"].items())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(schema=schemas, prompt=st.sampled_from(PROMPTS), temperature=st.sampled_from([0.0, 0.7, 1.0]),
       seed=st.integers(0, 2**31))
def test_every_constrained_output_validates_against_its_schema(target, schema, prompt, temperature, seed):
    # Room for the longest output the schema admits, so an output that stops short of "stop" is a failure (400
    # tokens were given before: a 3 × 3 array of 4-key objects legitimately ran out of them).
    room = longest_tokens(schema)
    assume(room <= 1536)
    params = SamplingParams(max_tokens=room, temperature=temperature, seed=seed,
                            constraint=Constraint.json_schema(schema))
    out = target.generate([prompt], params)[0]
    assert out["finish_reason"] == "stop", out
    jsonschema.validate(json.loads(out["text"]), schema)


def test_regex_and_lark_constraints(target):
    params = dict(max_tokens=64, temperature=1.0, seed=3)
    outs = target.generate(["x = "] * 2, [SamplingParams(constraint=Constraint("regex", r"[0-9]{3}-[a-z]{2,4}"), **params),
                                          SamplingParams(constraint=Constraint("lark", 'start: "(" NUM ("," NUM)* ")"\n'
                                                                               'NUM: /[0-9]{1,3}/'), **params)])
    import re
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outs[0]["text"]) and outs[0]["finish_reason"] == "stop"
    assert re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", outs[1]["text"]), outs[1]


def test_invalid_constraints_are_refused_before_anything_runs(target):
    for constraint, needle in [(Constraint("regex", "(?<=a)b"), "does not compile"),
                               (Constraint("json_schema", '{"type": 5}'), "not a valid JSON Schema"),
                               (Constraint("json_schema", "{not json"), "not valid JSON"),
                               (Constraint.json_schema({"type": "string", "format": "idn-email"}), "Unknown format")]:
        with pytest.raises(InvalidRequest, match=needle):
            target.add_request("x", SamplingParams(constraint=constraint))
    with pytest.raises(InvalidRequest, match="kind"):
        Constraint("yaml", "a: b")
    assert not target.has_work() and not target._matchers


def test_greedy_constrained_speculation_equals_plain(bundled, target):
    """The masks follow the guesses exactly: verification accepts what masked plain decoding would have chosen —
    token for token, or (int8: verification's multi-row attention re-quantizes differently, see
    test_bundled_pair_speculation_is_exact_and_accepts) parting only at a proven near-tie of the masked logits."""
    spec = Engine(bundled["target"], EngineConfig(SchedulerConfig(max_num_seqs=8), CACHE, SpecConfig(adaptive=False, max_gamma=4),
                                                  draft=bundled["draft"], speculation="draft"))
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                               "args": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                        "maxItems": 4},
                                               "line": {"type": "integer", "minimum": 0, "maximum": 99999}},
              "required": ["name", "args", "line"], "additionalProperties": False}
    params = [SamplingParams(max_tokens=200, logprobs=2, constraint=Constraint.json_schema(schema)),
              SamplingParams(max_tokens=60, logprobs=2,
                             constraint=Constraint("regex", r"(def [a-z_]{1,12}\(\):\n    return [0-9]{1,4}\n){2}"))]
    items = [(p, sp) for p in PROMPTS for sp in params]
    plain, fast = run_all(target, items), run_all(spec, items)
    same = 0
    for a, b in zip(plain, fast):
        assert_same_greedy_across_attention_kernels(a, b, bound=0.5)
        same += a["token_ids"] == b["token_ids"]
        assert a["finish_reason"] == "stop"
    assert same >= len(items) - 2                  # near-ties are rare: most outputs are identical
    assert spec.speculator.stats.accepted > 0


def test_sampled_constrained_speculation_ends_at_the_grammars_end(bundled, target):
    """Prompt lookup guesses the closing tokens and past them: the rows after a guess that completes the grammar
    allow EOS only (all −inf gave NaN probabilities, and the whole step — every request in it — failed)."""
    spec = Engine(bundled["target"], EngineConfig(SchedulerConfig(max_num_seqs=8), CACHE,
                                                  SpecConfig(adaptive=False, max_gamma=6), speculation="ngram"))
    schema = {"type": "object", "properties": {"a": {"enum": ["yes", "no"]}}, "required": ["a"],
              "additionalProperties": False}
    prompt = 'Answer: {"a": "yes"}\nAnswer: {"a": "yes"}\nAnswer: {"a": "yes"}\nAnswer: '
    constrained = SamplingParams(max_tokens=24, temperature=1.0, constraint=Constraint.json_schema(schema))
    for _ in range(4):
        out = run_all(spec, [(prompt, constrained)] * 4 + [("def fibonacci(n):\n", SamplingParams(max_tokens=8))])
        for r in out[:4]:
            assert r["finish_reason"] == "stop" and json.loads(r["text"])["a"] in ("yes", "no"), r
        assert out[4]["finish_reason"] == "length"
    assert spec.stats.failed_steps == 0 and spec.speculator.stats.accepted > 0
    m = spec.grammars.matcher(Constraint.json_schema(schema))
    answer = spec.tokenizer.encode('{"a": "no"}', add_special_tokens=False).ids
    rows = m.allowed(answer + [7, 7])                          # the answer, then two guesses past its end
    eos_only = [set(np.flatnonzero(r)) <= set(spec.eos_ids) and r.any() for r in rows]
    assert eos_only == [False] * len(answer) + [True] * 3
    assert not m.done and (m.allowed()[0] == rows[0]).all()    # the matcher ends where it started


@pytest.fixture(scope="module")
def server(bundled):
    s = ServerThread(bundled["target"], EngineConfig(cache=CACHE))
    yield s
    s.stop()


def test_openai_parse_with_a_pydantic_model(server):
    openai = pytest.importorskip("openai")
    from pydantic import BaseModel, Field

    class Call(BaseModel):
        function: str = Field(max_length=20)
        line: int = Field(ge=1, le=9999)
        tags: list[bool] = Field(max_length=3)

    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused")
    done = client.beta.chat.completions.parse(model=client.models.list().data[0].id, response_format=Call,
                                              messages=[{"role": "user", "content": "Describe a call"}],
                                              temperature=0, max_tokens=200)
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Call) and done.choices[0].finish_reason == "stop"
    assert Call.model_validate_json(done.choices[0].message.content) == parsed
    assert not server.server.router.primary.aengine.grammars._pinned       # released with the request


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string", "maxLength": 16},
                                                                          "days": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 7}},
                                                           "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calls_stream_through_the_openai_client(server, choice):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    kwargs = dict(model=client.models.list().data[0].id, messages=messages, tools=[WEATHER, CLOCK], tool_choice=choice,
                  temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**kwargs)
    calls = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content is None
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].id.startswith("call_")
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    if isinstance(choice, dict):
        assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), schema[calls[0].function.name])
    # Streamed: the deltas reassemble into the same call, and the last chunk says why it ended.
    name, arguments, reasons = None, "", []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                assert d.index == 0
                name = d.function.name or name
                arguments += d.function.arguments or ""
            reasons.append(c.finish_reason)
    assert (name, arguments) == (calls[0].function.name, calls[0].function.arguments)
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}
    # The call goes back into the conversation with its result; the model answers (with or without tools).
    follow = client.chat.completions.create(
        model=kwargs["model"], max_tokens=8, temperature=0, tools=[WEATHER], tool_choice="none",
        messages=messages + [whole.choices[0].message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}])
    assert follow.choices[0].message.content is not None and not follow.choices[0].message.tool_calls


def test_http_json_modes_and_refusals(server):
    url = f"{server.http_url}/v1/chat/completions"
    base = {"messages": [{"role": "user", "content": "give me JSON"}], "temperature": 0, "max_tokens": 60}
    obj = httpx.post(url, json={**base, "response_format": {"type": "json_object"}}, timeout=60).json()
    text = obj["choices"][0]["message"]["content"]
    if obj["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    else:                                                   # a free-form object may run out of tokens
        assert obj["choices"][0]["finish_reason"] == "length" and text.startswith("{")
    for body, needle in [({"tools": [WEATHER], "tool_choice": "required",
                           "response_format": {"type": "json_object"}}, "cannot be combined"),
                          ({"tool_choice": "required"}, "needs tools"),
                          ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                           "not among the tools"),
                          ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "each tool"),
                          ({"functions": [{"name": "f"}]}, "deprecated")]:
        r = httpx.post(url, json={**base, **body}, timeout=60)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (body, r.text)


def test_grpc_constraint(server):
    with Client(server.grpc_target) as c:
        text = "".join(m.text for m in c.generate("version = ", max_tokens=20, temperature=1.0, seed=5,
                                                  constraint={"regex": r"[0-9]\.[0-9]{1,2}\.[0-9]"}))
    import re
    assert re.fullmatch(r"[0-9]\.[0-9]{1,2}\.[0-9]", text)
    # a schema that is not JSON (or holds an integer past Python's 4,300 digits) is the client's error, not UNKNOWN
    for schema in ("{", '{"maxLength": ' + "9" * 4301 + "}"):
        with Client(server.grpc_target) as c, pytest.raises(grpc.RpcError) as err:
            list(c.generate("x", max_tokens=2, constraint={"json_schema": schema}))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not valid JSON" in err.value.details()


@pytest.mark.parametrize("mode,text,content,calls", [
    ("auto", "plain words", "plain words", []),
    ("auto", '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', None, [("f", '{"a": 1}')]),
    ("auto", '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g"}</tool_call>', None,
     [("f", "{}"), ("g", "{}")]),
    ("auto", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("auto", "<tool", "<tool", []),
    ("required", '{"name": "f", "arguments": {"x": "y"}}', None, [("f", '{"x": "y"}')]),
    ("named", '{"x": 2}', None, [("g", '{"x": 2}')]),
])
def test_tool_call_output_whole_and_streamed(mode, text, content, calls):
    whole, reason = ToolCallOutput(mode, "g").message(text, "stop")
    assert whole.get("content") == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])] == calls
    assert reason == ("tool_calls" if calls else "stop")
    out = ToolCallOutput(mode, "g")                         # the same text in 3-character pieces
    deltas = [d for i in range(0, len(text), 3) for d in out.delta(text[i:i + 3])]
    more, streamed_reason = out.finish("stop")
    deltas += more
    assert "".join(d.get("content", "") for d in deltas) == (content or "")
    got = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            entry = got.setdefault(c["index"], ["", ""])
            entry[0] += c.get("function", {}).get("name") or ""
            entry[1] += c.get("function", {}).get("arguments") or ""
    assert [tuple(got[i]) for i in sorted(got)] == calls and streamed_reason == reason


def test_a_named_call_cut_short_is_not_claimed_whole():
    """A stop string (or stop token) can end a named call's arguments before the grammar does: the choice keeps
    finish_reason "stop", where "tool_calls" told the client its unparseable arguments were a complete call."""
    whole, reason = ToolCallOutput("named", "g").message('{"city": "Par', "stop")
    assert reason == "stop" and whole["tool_calls"][0]["function"]["arguments"] == '{"city": "Par'
    out = ToolCallOutput("named", "g")
    out.delta('{"city": ')
    assert out.finish("stop")[1] == "stop"
    assert ToolCallOutput("named", "g").message('{"city": "Paris"}', "stop")[1] == "tool_calls"
    assert ToolCallOutput("named", "g").message('{"city": "Paris"}', "length")[1] == "length"


def test_a_constraint_too_costly_to_follow_is_refused_or_ended(target):
    """Following a grammar runs on the engine thread every stream shares: a 50-character schema whose masks take
    30 ms a token ran to the end of the context, stalling every stream. Refused when its first mask is that slow;
    a grammar that turns slow later ends its request once it has spent 0.25 s at over 5 ms a token."""
    hostile = Constraint.json_schema({"type": "string", "pattern": "^a{100000}$"})
    with pytest.raises(InvalidRequest, match="too costly to follow: a token's mask takes"):
        target.add_request("x", SamplingParams(max_tokens=8, constraint=hostile))
    assert not target.has_work()
    m = target.grammars.matcher(Constraint("json_object"))
    m.spent_s, m.tokens = 0.3, 100                       # 3 ms a token: within the budget
    assert m.allowed().any()
    m.spent_s, m.tokens = 0.3, 10                        # 30 ms a token past 0.25 s
    with pytest.raises(GrammarFailed, match="too costly to follow"):
        m.allowed()


def test_a_pinned_constraint_is_not_compiled_on_the_engine_thread(target):
    """A server compiles a request's constraint off the engine thread and pins it until the request ends: with
    more distinct constraints in flight than the cache holds, an evicted one was compiled again by the engine
    thread (a stall of every stream)."""
    g = Grammars(target.tokenizer.to_str(), target.runner.vocab_size, target.eos_ids)
    g.CACHE = 1
    a, b, c = (Constraint("regex", f"pin{x}[ab]{{1,3}}") for x in "abc")
    g.pin(a)
    before = g.compiles
    g.compile(b)                                          # evicts a from the cache
    g.matcher(a)                                          # the pinned template
    assert g.compiles == before + 1
    g.unpin(a)
    g.compile(c)
    g.matcher(a)                                          # unpinned and evicted: compiled anew
    assert g.compiles == before + 3 and not g._pinned
