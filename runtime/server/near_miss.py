"""Near misses: two questions that read alike but ask different things, recognised without a model.

The semantic cache never answers one question with another's answer when:
- **literals** differ: numbers (digits or number words), operators (signs or words: "12 / 4" / "12 - 4", "minus"),
  `code`, code-like words (`--hard`, `x[::-1]`, `a==b`) or quoted text ("the first 10 primes" / "the first 20
  primes", `chmod 755` / `chmod 644`);
- **negation** differs: one says not / no / never / cannot / -n't as often as the other does not;
- **direction** is swapped around to / into / than / from / vs ("Celsius to Fahrenheit" / "Fahrenheit to
  Celsius", "Is Python faster than Java" / "Is Java faster than Python"), or reversed between to and from
  ("Celsius to Fahrenheit" / "Celsius from Fahrenheit");
- **substitution**: both have the same words but one or two, in the same places ("sort ascending" / "sort
  descending", "the capital of France" / "of Spain", "pâte" / "pate"): a paraphrase rewords, a near miss swaps a
  slot;
- **qualifier**: one's content words are the other's and more, among them a word that sets the answer's form,
  scope or order ("Summarize Hamlet" / "Summarize Hamlet in Spanish", "List the planets in order" / "in reverse
  order", "Explain quicksort" / "in one sentence"; not "Restart nginx" / "Restart the nginx server");
- **case**: the same words with a word's case changed, where neither text is written in one case ("What is
  Polish?" / "What is polish?"), or **layout**: the same words on other lines or indents (code whose `print`
  leaves its loop). Quoted text must match exactly (case and spaces: "count the capitals in 'Hello World'").

An embedding reads all of these as near-identical (cosine 0.95–0.99); these rules cost microseconds and run before
the verifier, which decides the rest. They trade a little recall ("Write a limerick" / "Compose a limerick" is
turned down) for never serving a swapped question.
"""

from __future__ import annotations

import re

_QUOTED = re.compile(r"`([^`]*)`|\"([^\"]*)\"|“([^”]*)”|(?<![\w])'([^']*)'(?![\w])")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_CODE_CHARS = set("[](){}<>=+*\\|;$#@%^&~_/×÷≤≥≠±·√∞")      # operators: "12/4" is not "12 4", "≤" not "≥"
_MINUS = re.compile(r"^-|\d-|-\d")     # a minus or a leading dash ("12-4", "-5", "--hard"), not "shallow-copy"
_OPERATOR_WORDS = frozenset("minus plus negative divided multiplied squared cubed percent half double twice "
                            "triple hundred thousand million billion".split())
_EDGE = ".,;:!?\"'`“”"      # punctuation around a word, not part of it
_NUMBER_WORDS = {w: str(i) for i, w in enumerate(
    "zero _ two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split()) if w != "_"}          # not "one": "which one", "one of"
_NEGATIONS = frozenset("not no never without cannot cant dont doesnt didnt isnt arent wasnt werent wont shouldnt "
                       "couldnt wouldnt havent hasnt hadnt mustnt neednt aint nothing none nobody neither "
                       "nor non".split())
_MARKERS = {"to": "to", "into": "to", "than": "than", "from": "from", "vs": "vs", "versus": "vs"}
# Words that, added to a question, change the answer's form, scope or order where other added words ("Which city
# is the capital", "Restart the nginx server") only spell the question out: "qualifier" looks for these.
_MODIFIERS = frozenset(
    "english spanish french german italian portuguese dutch russian chinese mandarin japanese korean arabic hindi "
    "latin greek hebrew turkish polish swedish language translate translated "
    "reverse reversed backward backwards descending ascending alphabetical alphabetically order sorted random "
    "short shorter shortest brief briefly long longer longest detailed detail concise simple simply summary "
    "sentence sentences paragraph paragraphs word words line lines bullet bullets point points page pages "
    "table json yaml csv xml markdown html list code example examples step steps "
    "uppercase lowercase formal informal funny poem rhyme rhyming haiku child kid kids beginner expert "
    "only except excluding exclude including include without every all each first last more less most least "
    "worst top bottom minimum maximum min max average total per recent latest current".split())
_FILLER = frozenset("a an the of in on for with and or by at as about how do does did i you we my your me can "
                    "could would should is are was were be been being what which who whom whose when where why way "
                    "ways best easiest it its this that these those there please give tell show explain describe "
                    "some any one get s".split())


def reason(a: str, b: str) -> str | None:
    """Why `a` and `b` are a near miss ("literals", "negation", "direction", "substitution", "qualifier", "case",
    "layout"), or None."""
    if not same_literals(a, b):
        return "literals"
    wa, wb = _words(a), _words(b)
    if sum(w in _NEGATIONS for w in wa) != sum(w in _NEGATIONS for w in wb):
        return "negation"
    if _swapped(wa, wb) or _reversed(wa, wb):
        return "direction"
    if len(wa) == len(wb) and 0 < sum(_stem(x) != _stem(y) for x, y in zip(wa, wb)) <= 2:      # (literals agree)
        return "substitution"
    ca, cb = _content(wa), _content(wb)
    if (ca < cb and (cb - ca) & _MODIFIER_STEMS) or (cb < ca and (ca - cb) & _MODIFIER_STEMS):
        return "qualifier"
    if _case_changed(a, b):
        return "case"
    if a.split() == b.split() and _layout(a) != _layout(b):
        return "layout"
    return None


def literal_tokens(text: str) -> tuple[str, ...]:
    """The numbers (digits or number words, thousands separators dropped), operators (signs or words) and
    code-like words of `text`, quoted parts included, sorted: a paraphrase may reorder them but not change one."""
    found = []
    for word in text.split():
        word = word.strip(_EDGE)
        if any(c in _CODE_CHARS for c in word) or _MINUS.search(word):
            found.append(word)
        elif word.casefold() in _NUMBER_WORDS:
            found.append(_NUMBER_WORDS[word.casefold()])
        elif word.casefold() in _OPERATOR_WORDS:
            found.append(word.casefold())
        else:
            found.extend(n.replace(",", "") for n in _NUMBER.findall(word))
    return tuple(sorted(found))


def same_literals(a: str, b: str) -> bool:
    """Same numbers, operators and code-like words, and each one's quoted text occurs as it is in the other
    ("translate 'good morning'" may be asked without the quotes; "'--hard'" is not "'--soft'", "'Hello World'"
    not "'hello world'", "x    y" not "x y")."""
    if literal_tokens(a) != literal_tokens(b):
        return False
    return all(q in b for q in _quoted(a)) and all(q in a for q in _quoted(b))


def _quoted(text: str) -> list[str]:
    return [next(g for g in m.groups() if g is not None) for m in _QUOTED.finditer(text)]


def _words(text: str) -> list[str]:
    """Lower-cased words (any script's letters: "pâte" is one word), number words as digits ("ten" is "10"), -n't
    joined ("doesn't" is "doesnt")."""
    words = re.findall(r"[^\W_]+|[+#]+", text.casefold().replace("’", "'").replace("n't", "nt"))
    return [_NUMBER_WORDS.get(w, w) for w in words]


def _content(words: list[str]) -> set[str]:
    return {_stem(w) for w in words if w not in _FILLER and w not in _MARKERS}


def _case_changed(a: str, b: str) -> bool:
    """The same words in order with one's case changed past the first, where each text has both cases (a text in
    one case says nothing by its case: "what is the capital of france")."""
    ra, rb = re.findall(r"[^\W_]+", a), re.findall(r"[^\W_]+", b)
    if ra == rb or [w.casefold() for w in ra] != [w.casefold() for w in rb]:
        return False
    if any(t.islower() or t.isupper() or not any(c.isalpha() for c in t) for t in (a, b)):
        return False
    return any(x != y for x, y in zip(ra[1:], rb[1:]))


def _layout(text: str) -> list[tuple[int, int]]:
    """(indent, words) of each non-blank line: the same words on other lines or indents are other code."""
    return [(len(line) - len(line.lstrip()), len(line.split())) for line in text.splitlines() if line.strip()]


def _stem(word: str) -> str:
    for suffix in ("ing", "ed", "es", "s"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            return word[:-len(suffix)]
    return word


def _sides(words: list[str]) -> list[tuple[str, set[str], str | None]]:
    """For each occurrence of a direction marker: (marker, content words before it, first content word after)."""
    out = []
    for i, w in enumerate(words):
        if w in _MARKERS:
            after = next((_stem(x) for x in words[i + 1:] if x not in _FILLER and x not in _MARKERS), None)
            before = {_stem(x) for x in words[:i] if x not in _FILLER and x not in _MARKERS}
            out.append((_MARKERS[w], before, after))
    return out


def _swapped(wa: list[str], wb: list[str]) -> bool:
    """Whether, around the same marker, what follows it in one comes before it in the other, both ways (X to Y /
    Y to X). Occurrences are paired by rank from the start and from the end ("how to convert X to Y" / "convert Y
    to X": the last "to" of each), never across ranks, so a text is no near miss of itself."""
    sa, sb = _sides(wa), _sides(wb)
    for marker in {m for m, _, _ in sa} & {m for m, _, _ in sb}:
        oa = [(before, after) for m, before, after in sa if m == marker]
        ob = [(before, after) for m, before, after in sb if m == marker]
        for (before_a, after_a), (before_b, after_b) in [*zip(oa, ob), *zip(oa[::-1], ob[::-1])]:
            if after_a and after_b and after_a != after_b and after_a in before_b and after_b in before_a:
                return True
    return False


def _reversed(wa: list[str], wb: list[str]) -> bool:
    """Whether a word one text goes to (after to / into) is one the other comes from (after from), and not also
    the reverse in either: "Celsius to Fahrenheit" / "Celsius from Fahrenheit"."""
    def ends(words):
        sides = _sides(words)
        return ({after for m, _, after in sides if m == "to"} - {None},
                {after for m, _, after in sides if m == "from"} - {None})
    (to_a, from_a), (to_b, from_b) = ends(wa), ends(wb)
    return bool((to_a - from_a) & (from_b - to_b) or (from_a - to_a) & (to_b - from_b))


_MODIFIER_STEMS = frozenset(_stem(w) for w in _MODIFIERS)
