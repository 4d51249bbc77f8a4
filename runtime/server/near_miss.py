"""Near misses: two questions that read alike but ask different things, recognised without a model.

The semantic cache never answers one question with another's answer when:
- **literals** differ: numbers (digits or number words), `code`, code-like words (`--hard`, `x[::-1]`, `a==b`) or
  quoted text ("the first 10 primes" / "the first 20 primes", `chmod 755` / `chmod 644`);
- **negation** differs: one says not / no / never / cannot / -n't as often as the other does not;
- **direction** is swapped around to / into / than / from / vs ("Celsius to Fahrenheit" / "Fahrenheit to
  Celsius", "Is Python faster than Java" / "Is Java faster than Python");
- **substitution**: both have the same words but one or two, in the same places ("sort ascending" / "sort
  descending", "the capital of France" / "of Spain"): a paraphrase rewords, a near miss swaps a slot.

An embedding reads all four as near-identical (cosine 0.95–0.99); these rules cost microseconds and run before
the verifier, which decides the rest. They trade a little recall ("Write a limerick" / "Compose a limerick" is
turned down) for never serving a swapped question.
"""

from __future__ import annotations

import re

_QUOTED = re.compile(r"`([^`]*)`|\"([^\"]*)\"|“([^”]*)”|(?<![\w])'([^']*)'(?![\w])")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_CODE_CHARS = set("[](){}<>=+*\\|;$#@%^&~_")
_EDGE = ".,;:!?\"'`“”"      # punctuation around a word, not part of it
_NUMBER_WORDS = {w: str(i) for i, w in enumerate(
    "zero _ two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split()) if w != "_"}          # not "one": "which one", "one of"
_NEGATIONS = frozenset("not no never without cannot cant dont doesnt didnt isnt arent wasnt werent wont shouldnt "
                       "couldnt wouldnt havent hasnt hadnt mustnt neednt aint nothing none nobody neither "
                       "nor".split())
_MARKERS = {"to": "to", "into": "to", "than": "than", "from": "from", "vs": "vs", "versus": "vs"}
_FILLER = frozenset("a an the of in on for with and or by at as about how do does did i you we my your me can "
                    "could would should is are was were be been being what which who whom whose when where why way "
                    "ways best easiest it its this that these those there please give tell show explain describe "
                    "some any one get s".split())


def reason(a: str, b: str) -> str | None:
    """Why `a` and `b` are a near miss ("literals", "negation", "direction", "substitution"), or None."""
    if not same_literals(a, b):
        return "literals"
    wa, wb = _words(a), _words(b)
    if sum(w in _NEGATIONS for w in wa) != sum(w in _NEGATIONS for w in wb):
        return "negation"
    if _swapped(wa, wb):
        return "direction"
    if len(wa) == len(wb) and 0 < sum(_stem(x) != _stem(y) for x, y in zip(wa, wb)) <= 2:      # (literals agree)
        return "substitution"
    return None


def literal_tokens(text: str) -> tuple[str, ...]:
    """The numbers (digits or number words, thousands separators dropped) and code-like words of `text`, quoted
    parts included, sorted: a paraphrase may reorder them but not change one."""
    found = []
    for word in text.split():
        word = word.strip(_EDGE)
        if any(c in _CODE_CHARS for c in word) or (word.startswith("-") and len(word) > 1):
            found.append(word)
        elif word.casefold() in _NUMBER_WORDS:
            found.append(_NUMBER_WORDS[word.casefold()])
        else:
            found.extend(n.replace(",", "") for n in _NUMBER.findall(word))
    return tuple(sorted(found))


def same_literals(a: str, b: str) -> bool:
    """Same numbers and code-like words, and each one's quoted text occurs in the other ("translate 'good
    morning'" may be asked without the quotes; "'--hard'" is not "'--soft'")."""
    if literal_tokens(a) != literal_tokens(b):
        return False
    flat_a, flat_b = " ".join(a.split()).casefold(), " ".join(b.split()).casefold()
    return all(q in flat_b for q in _quoted(a)) and all(q in flat_a for q in _quoted(b))


def _quoted(text: str) -> list[str]:
    return [" ".join(next(g for g in m.groups() if g is not None).split()).casefold()
            for m in _QUOTED.finditer(text)]


def _words(text: str) -> list[str]:
    """Lower-cased words, number words as digits ("ten" is "10"), -n't joined ("doesn't" is "doesnt")."""
    words = re.findall(r"[a-z0-9+#]+", text.casefold().replace("’", "'").replace("n't", "nt"))
    return [_NUMBER_WORDS.get(w, w) for w in words]


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
