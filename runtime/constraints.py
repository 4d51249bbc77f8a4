"""Constrained decoding: JSON schema, JSON object, regex and Lark grammars, through llguidance.

A Constraint is what a request asks for; `Grammars` (one per engine) turns it into a matcher over the model's
tokenizer, compiling each distinct constraint once (kept in a small LRU; a request gets a copy). A request's
`Matcher` masks the logits of every position the engine samples from, advances with every token the engine
appends, and computes the masks along speculative guesses without moving — so verification sees exactly the
masks plain decoding would, and greedy constrained speculation gives plain greedy constrained output.

Why llguidance (tools/bench_grammar.py on our tokenizer): compiles JSON schemas, regexes and Lark grammars
lazily (milliseconds where outlines-core builds a whole index up front), masks a token in tens of microseconds,
rolls back, and has no dependency (xgrammar needs torch, which the runtime never imports).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .request import InvalidRequest

KINDS = ("json_schema", "json_object", "regex", "lark")
MAX_SPEC = 256_000      # characters of a constraint's text (a schema as JSON)
# One line, with a space after separators (OpenAI's style); no free whitespace, which a small model can fill forever.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """kind: json_schema (spec: the schema as JSON text), json_object (any JSON object; spec ""), regex (spec: the
    pattern the whole output matches) or lark (spec: a Lark grammar, llguidance's dialect)."""

    kind: str
    spec: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidRequest(f"constraint kind must be one of {', '.join(KINDS)}, not {self.kind!r}")
        if not isinstance(self.spec, str) or (self.kind != "json_object" and not self.spec):
            raise InvalidRequest(f"a {self.kind} constraint needs its {self.kind.replace('_', ' ')} as text")
        if len(self.spec) > MAX_SPEC:
            raise InvalidRequest(f"a constraint's text is limited to {MAX_SPEC:,} characters")

    @classmethod
    def json_schema(cls, schema: dict | bool) -> "Constraint":
        return cls("json_schema", json.dumps(schema))

    def grammar(self) -> str:
        """The llguidance grammar text of this constraint."""
        from llguidance import LLMatcher
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_STYLE)
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except ValueError as e:
                raise InvalidRequest(f"json_schema is not valid JSON: {e}") from None
            check_schema(schema)
            try:
                return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)
            except ValueError as e:
                raise InvalidRequest(f"json_schema: {e}") from None
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        return LLMatcher.grammar_from_lark(self.spec)


def check_schema(schema) -> None:
    """Refuse what is not a JSON Schema (draft 2020-12 meta-schema) with the validator's reason."""
    import jsonschema
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest("json_schema must be a JSON object (or true/false)")
    if len(json.dumps(schema)) > MAX_SPEC:          # before the validator, whose time grows with the schema
        raise InvalidRequest(f"a json_schema is limited to {MAX_SPEC:,} characters")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise InvalidRequest(f"json_schema is not a valid JSON Schema at {where}: {e.message}") from None
    except RecursionError:          # a pattern's regex nested thousands deep (the validator parses it)
        raise InvalidRequest("json_schema nests too deeply (a pattern's groups, or its objects)") from None


class GrammarFailed(RuntimeError):
    """The grammar engine gave up on a request's constraint mid-generation (its lexer's budget ran out): the
    request ends with an error, never with output the constraint did not check."""


def short_reason(error: str) -> str:
    """llguidance's error without the parser state it appends (from "<state>" on), on one line, at most 300
    characters."""
    line = " ".join(error.split("<state>")[0].split()) or "unknown error"
    return line if len(line) <= 300 else line[:297] + "..."


# What following a grammar may cost the engine thread, which every stream shares. A token's mask takes 0.02-0.25 ms
# for ordinary schemas (a 128-tool anyOf included) and 30 ms for a 50-character {"pattern": "^a{100000}$"}: its
# requests ran at that pace to the end of the context (170 s of stalls beside three of them). A constraint whose
# first mask takes longer than MAX_MASK_S is refused when it is compiled; one that turns costly later ends its
# request once it has spent SLOW_GRAMMAR_S at more than MAX_MASK_S a token.
MAX_MASK_S = 0.005
SLOW_GRAMMAR_S = 0.25


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, ll, vocab_size: int):
        self._ll, self.vocab_size = ll, vocab_size
        self._words = (vocab_size + 31) // 32
        self.spent_s, self.tokens = 0.0, 0      # time in masks and advances, tokens advanced (the budget above)

    def _allowed(self, out: np.ndarray) -> None:
        words = np.empty(self._words, np.int32)
        self._ll.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if self._ll.is_error():     # its mask would allow only EOS: an empty "stop" the constraint never checked
            raise GrammarFailed(f"the constraint could not be followed: {short_reason(self._ll.get_error())}")
        out[:] = np.unpackbits(words.view(np.uint8), count=self.vocab_size, bitorder="little").view(bool)

    def allowed(self, guesses=()) -> np.ndarray:
        """[len(guesses) + 1, vocab] bool: the tokens allowed now and after each guess in turn (rows past a guess
        the grammar refuses are all False: verification never gets there). Rows from where a guess completes the
        grammar on allow EOS only, as its mask there does: verification may go past a guess that ends the request
        (the engine stops appending at it), and a sampled row with nothing allowed has no distribution (NaN
        probabilities failed the whole step). The matcher ends where it started."""
        if self.spent_s > SLOW_GRAMMAR_S and self.spent_s > MAX_MASK_S * (self.tokens + 1):
            raise GrammarFailed(f"the constraint is too costly to follow: {self.spent_s:.2f} s of masks for "
                                f"{self.tokens} tokens (at most {MAX_MASK_S * 1e3:g} ms a token)")
        t0 = time.perf_counter()
        try:
            return self._rows(guesses)
        finally:
            self.spent_s += time.perf_counter() - t0

    def _rows(self, guesses) -> np.ndarray:
        rows = np.zeros((len(guesses) + 1, self.vocab_size), bool)
        moved = 0
        for i in range(len(guesses) + 1):
            self._allowed(rows[i])
            if self._ll.is_stopped():
                rows[i + 1:] = rows[i]
                break
            if i == len(guesses) or not rows[i][guesses[i]] or not self._ll.consume_token(guesses[i]):
                break
            moved += 1
        if moved:
            self._ll.rollback(moved)
        return rows

    def mask(self, logits: np.ndarray, guesses=()) -> np.ndarray:
        """A copy of `logits` [len(guesses) + 1, vocab] with what the grammar forbids at each position at −inf."""
        return np.where(self.allowed(guesses), logits, np.float32(-np.inf))

    def accept(self, token: int) -> bool:
        """Advance past a token the engine appended; False if the grammar refuses it."""
        t0 = time.perf_counter()
        try:
            self.tokens += 1
            return self._ll.consume_token(token)
        finally:
            self.spent_s += time.perf_counter() - t0

    @property
    def done(self) -> bool:
        """The grammar allows nothing more and the output is complete (not: the grammar engine failed)."""
        return self._ll.is_stopped() and not self._ll.is_error()

    @property
    def error(self) -> str:
        return self._ll.get_error() if self._ll.is_error() else ""


class Grammars:
    """Per engine: llguidance's view of the tokenizer and compiled constraints, cached by their text."""

    CACHE = 64

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids):
        self._tokenizer_json, self.vocab_size, self.eos_ids = tokenizer_json, vocab_size, sorted(eos_ids)
        self._tokenizer = None
        self._compiled: OrderedDict[Constraint, object] = OrderedDict()
        self._pinned: dict[Constraint, list] = {}   # constraint → [template, requests holding it]
        self._lock = threading.Lock()        # servers compile on a worker thread, the engine thread reads the cache
        self.compiles = 0

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:      # ~0.1-1 s: built on the first constrained request, not at start-up
                from llguidance import LLTokenizer
                self._tokenizer = LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_ids)
            return self._tokenizer

    def compile(self, constraint: Constraint):
        """`constraint`'s compiled grammar, cached; InvalidRequest with the reason if it does not compile.
        Thread-safe: a server compiles on a worker thread first, so the engine thread finds it cached."""
        from llguidance import LLMatcher
        with self._lock:
            template = self._compiled.get(constraint)
            if template is not None:
                self._compiled.move_to_end(constraint)
                return template
            if constraint in self._pinned:
                return self._pinned[constraint][0]
        template = LLMatcher(self.tokenizer, constraint.grammar(), log_level=0)
        self._probe(constraint, template)
        with self._lock:
            self.compiles += 1
            self._compiled[constraint] = template
            if len(self._compiled) > self.CACHE:
                self._compiled.popitem(last=False)
        return template

    PROBES = 2

    def _probe(self, constraint: Constraint, template) -> None:
        """Refuse (InvalidRequest, never cached) a grammar that does not compile, or whose first mask the grammar
        engine cannot build. Its lexer is shared by the template's copies and built lazily under a budget: a
        first copy can compute its mask and exhaust the budget, so the next copy errors (a{1000000}) — two
        probes see what the first two requests would."""
        if template.is_error():
            raise InvalidRequest(f"the {constraint.kind} constraint does not compile: {short_reason(template.get_error())}")
        fastest = float("inf")
        for _ in range(self.PROBES):
            probe = Matcher(template.deep_copy(), self.vocab_size)
            try:
                probe.allowed()
            except GrammarFailed:
                error = probe._ll.get_error()
                raise InvalidRequest(f"the {constraint.kind} constraint cannot be built: {short_reason(error)}") from None
            fastest = min(fastest, probe.spent_s)
        if fastest > MAX_MASK_S:
            raise InvalidRequest(f"the {constraint.kind} constraint is too costly to follow: a token's mask takes "
                                 f"{fastest * 1e3:.0f} ms (at most {MAX_MASK_S * 1e3:g}; large counted repetitions "
                                 "such as a{100000} do this)")

    def pin(self, constraint: Constraint) -> None:
        """Compile `constraint` and keep it until `unpin`, whatever the cache evicts meanwhile: a server compiles
        a request's constraint off the engine thread and pins it until the engine has the request (with more
        distinct constraints in flight than the cache holds, the engine thread compiled evicted ones itself, a
        stall of every stream for up to half a second each)."""
        template = self.compile(constraint)
        with self._lock:
            self._pinned.setdefault(constraint, [template, 0])[1] += 1

    def unpin(self, constraint: Constraint) -> None:
        with self._lock:
            entry = self._pinned.get(constraint)
            if entry is not None:
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._pinned[constraint]

    def forget(self, constraint: Constraint) -> None:
        """Drop a compiled constraint (its grammar failed a request: the next one compiles and probes it anew)."""
        with self._lock:
            self._compiled.pop(constraint, None)
            self._pinned.pop(constraint, None)

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh matcher at the start of `constraint`'s grammar (a copy of the compiled one)."""
        return Matcher(self.compile(constraint).deep_copy(), self.vocab_size)
