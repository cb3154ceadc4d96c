"""Module-name patterns from strangers (``--targets``, ``--ignore``, a recipe's targets, ignores and
mappings): an exact module name, or ``re:`` and a regex matched as compressed-tensors' ``match_name``
matches it (``re.match``: anchored at the start of the name, not at its end).

A regex is a program its author runs on graphcal's time, and Python's ``re`` backtracks: ``(.*.*)*x``
against a 40-character name does not finish in a lifetime. So every ``re:`` pattern goes through
this one matcher, with two bounds (docs/security.md, "Patterns"):

- refused before anything is read: what Python's ``re`` refuses, and an unbounded repeat nested in
  an unbounded repeat (``(a+)*``, ``(.*.*)*``), the shape of catastrophic backtracking;
- matched by the ``regex`` package (Python ``re``'s syntax and meaning, VERSION0) with a time
  limit: a pattern still over :data:`MATCH_BUDGET_S` of matching, over all the names one matcher
  reads, is a one-line usage error naming it.
"""

from __future__ import annotations

import re
import time
from functools import lru_cache
from re import _constants as _c
from re import _parser as _re_parser

from graphcal.errors import UsageError, shown

__all__ = ["MATCH_BUDGET_S", "NameMatcher", "check_pattern", "match_name"]

#: seconds of regex matching one pattern may take over the names one matcher reads (ordinary
#: patterns take microseconds a name)
MATCH_BUDGET_S = 1.0


def check_pattern(pattern: str, where: str = "pattern") -> None:
    """Refuse, as a one-line UsageError naming it, a ``re:`` pattern that Python's ``re`` refuses or
    that nests unbounded repeats. A plain name is always fine."""
    if isinstance(pattern, str) and pattern.startswith("re:"):
        _compiled(pattern[3:], where)


@lru_cache(maxsize=256)
def _compiled(regex_text: str, where: str):
    import regex  # lazy: a C extension needed only when a pattern is a regex

    try:
        parsed = _re_parser.parse(regex_text)  # Python re's own parser: its errors, its meaning
    except re.error as e:
        raise UsageError(f"{where}: invalid regex {shown('re:' + regex_text, 80)!r}: {e}") from None
    except RecursionError:
        raise UsageError(f"{where}: regex {shown('re:' + regex_text, 80)!r} nests too deeply") from None
    nested = _nested_repeat(parsed)
    if nested:
        raise UsageError(f"{where}: regex {shown('re:' + regex_text, 80)!r} repeats a repeat ({nested}), which can take "
                         "exponential time to match; write it without the nesting (e.g. '.*' once)")
    try:
        return regex.compile(regex_text, regex.VERSION0)
    except regex.error as e:  # re accepted it: an edge where the two engines differ
        raise UsageError(f"{where}: regex {shown('re:' + regex_text, 80)!r} is not supported: {e}") from None


def _nested_repeat(parsed, outer: bool = False) -> str | None:
    """The first repeat of a variable count inside an unbounded repeat, as text; None if none (re's
    parse tree; a possessive repeat or an atomic group does not backtrack, so it starts afresh)."""
    for op, av in parsed:
        if op in (_c.MAX_REPEAT, _c.MIN_REPEAT):
            low, high, body = av
            if outer and high != low and high > 1:
                return f"{_repeat(low, high)} inside an unbounded repeat"
            found = _nested_repeat(body, outer or high == _c.MAXREPEAT)
        elif op == _c.POSSESSIVE_REPEAT:
            found = _nested_repeat(av[2])
        elif op == _c.ATOMIC_GROUP:
            found = _nested_repeat(av)
        elif op == _c.SUBPATTERN:
            found = _nested_repeat(av[3], outer)
        elif op == _c.BRANCH:
            found = next((f for f in (_nested_repeat(b, outer) for b in av[1]) if f), None)
        elif op in (_c.ASSERT, _c.ASSERT_NOT):
            found = _nested_repeat(av[1], outer)
        elif op == _c.GROUPREF_EXISTS:
            found = _nested_repeat(av[1], outer) or (_nested_repeat(av[2], outer) if av[2] else None)
        else:  # literals, sets, anchors, group references
            found = None
        if found:
            return found
    return None


def _repeat(low: int, high: int) -> str:
    if high == _c.MAXREPEAT:
        return {0: "*", 1: "+"}.get(low, f"{{{low},}}")
    return f"{{{low},{high}}}"


class NameMatcher:
    """Matches names against patterns, each ``re:`` pattern with :data:`MATCH_BUDGET_S` of matching
    time in all (make one per selection, so the budget bounds the whole of it)."""

    def __init__(self, where: str = "pattern", budget_s: float = MATCH_BUDGET_S):
        self.where = where
        self.budget_s = budget_s
        self._spent: dict[str, float] = {}

    def __call__(self, name: str, pattern: str) -> bool:
        if not pattern.startswith("re:"):
            return name == pattern
        compiled = _compiled(pattern[3:], self.where)
        left = self.budget_s - self._spent.get(pattern, 0.0)
        start = time.perf_counter()
        try:
            if left <= 0:
                raise TimeoutError
            return compiled.match(name, timeout=left) is not None
        except TimeoutError:
            raise UsageError(f"{self.where}: regex {shown(pattern, 80)!r} took over {self.budget_s:g} s matching module "
                             "names (it backtracks); simplify it") from None
        finally:
            self._spent[pattern] = self._spent.get(pattern, 0.0) + time.perf_counter() - start


def match_name(name: str, pattern: str) -> bool:
    """compressed-tensors' ``match_name(name, pattern)``, bounded: one match, with its own budget."""
    return NameMatcher()(name, pattern)
