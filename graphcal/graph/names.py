"""Module-name patterns from strangers (``--targets``, ``--ignore``, a recipe's targets, ignores and
mappings): an exact module name, or ``re:`` and a regex matched as compressed-tensors' ``match_name``
matches it (``re.match``: anchored at the start of the name, not at its end).

A regex is a program its author runs on graphcal's time, and Python's ``re`` backtracks: ``(.*.*)*x``
against a 40-character name does not finish in a lifetime. So every ``re:`` pattern goes through
this one matcher, with two bounds (docs/security.md, "Patterns"):

- refused before anything is read: what Python's ``re`` refuses, and an unbounded repeat nested in
  an unbounded repeat (``(a+)*``, ``(.*.*)*``), the shape of catastrophic backtracking;
- matched by the ``regex`` package (Python ``re``'s syntax and meaning, VERSION0) with a time
  limit for all the patterns of a run together: one :class:`PatternBudget` of :data:`RUN_BUDGET_S`
  seconds and at most :data:`MAX_PATTERNS` patterns, entered by :func:`one_budget` (each CLI
  command and each ``calibrate`` call); a run that spends it is a one-line usage error naming the
  slowest pattern. Each pattern's answer for a name is kept, so a name is matched against a
  pattern once however many selections ask.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from contextvars import ContextVar
from functools import lru_cache
from re import _constants as _c
from re import _parser as _re_parser

from graphcal.errors import UsageError, shown

__all__ = ["MAX_PATTERNS", "RUN_BUDGET_S", "NameMatcher", "PatternBudget", "check_pattern", "match_name", "one_budget"]

#: seconds of regex matching all the ``re:`` patterns of one run may take in all, over every name
#: they are matched against (an ordinary pattern takes microseconds a name)
RUN_BUDGET_S = 5.0
#: distinct module-name patterns (names and regexes) one run may match
MAX_PATTERNS = 4096
#: pattern-and-name answers one budget keeps (about 100 bytes each); past it, answers are computed again
MAX_ANSWERS = 250_000

_RUN: ContextVar[PatternBudget | None] = ContextVar("graphcal_pattern_budget", default=None)


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


class PatternBudget:
    """One run's matching of module-name patterns: the seconds all its ``re:`` patterns may take in
    all, the number of distinct patterns it may match, and each pattern's answer for each name."""

    def __init__(self, seconds: float | None = None, max_patterns: int | None = None):
        self.seconds = RUN_BUDGET_S if seconds is None else seconds
        self.max_patterns = MAX_PATTERNS if max_patterns is None else max_patterns
        self.spent = 0.0
        self.by_pattern: dict[str, float] = {}  # re: pattern -> seconds it took
        self.names: set[str] = set()  # the names the regexes were matched against
        self._seen: set[str] = set()
        self._answers: dict[str, dict[str, bool]] = {}
        self._regexes: dict[str, object] = {}  # re: pattern -> compiled (at most max_patterns)
        self._kept = 0

    def match(self, name: str, pattern: str, where: str) -> bool:
        if pattern not in self._seen:
            if len(self._seen) >= self.max_patterns:
                raise UsageError(f"{where}: more than {self.max_patterns} module-name patterns in one run (recipe, "
                                 "--targets, --ignore, --scheme-for, mappings); merge them into fewer regexes")
            self._seen.add(pattern)
        if not pattern.startswith("re:"):
            return name == pattern
        answers = self._answers.setdefault(pattern, {})
        known = answers.get(name)
        if known is not None:
            return known
        start = time.perf_counter()
        try:
            left = self.seconds - self.spent
            if left <= 0:
                raise TimeoutError
            compiled = self._regexes.get(pattern) or self._regexes.setdefault(pattern, _compiled(pattern[3:], where))
            found = compiled.match(name, timeout=left) is not None
        except TimeoutError:
            self._charge(pattern, name, start)
            raise UsageError(self._spent_message(where)) from None
        self._charge(pattern, name, start)
        if self._kept < MAX_ANSWERS:
            answers[name] = found
            self._kept += 1
        return found

    def _charge(self, pattern: str, name: str, start: float) -> None:
        took = time.perf_counter() - start
        self.spent += took
        self.by_pattern[pattern] = self.by_pattern.get(pattern, 0.0) + took
        self.names.add(name)

    def _spent_message(self, where: str) -> str:
        slowest = max(self.by_pattern, key=self.by_pattern.__getitem__)
        n = len(self.names)
        return (f"{where}: the module-name patterns took over {self.seconds:g} s in all to match {n} module "
                f"name{'s' if n != 1 else ''} ({len(self.by_pattern)} regexes; the slowest, {shown(slowest, 80)!r}, "
                f"took {self.by_pattern[slowest]:.2g} s: it backtracks); simplify them")


@contextlib.contextmanager
def one_budget(seconds: float | None = None) -> Iterator[PatternBudget]:
    """Inside, every :class:`NameMatcher` made without a budget of its own draws on one
    :class:`PatternBudget` (of ``seconds``, else :data:`RUN_BUDGET_S`): a run's. Inside another, the
    outer budget goes on (a command that calibrates is one run)."""
    current = _RUN.get()
    if current is not None:
        yield current
        return
    budget = PatternBudget(seconds)
    token = _RUN.set(budget)
    try:
        yield budget
    finally:
        _RUN.reset(token)


class NameMatcher:
    """Matches names against patterns, on the run's :class:`PatternBudget` (:func:`one_budget`), or
    on a budget of its own when ``budget_s`` is given or no run's is open (make one per selection,
    so that outside a run the budget still bounds the whole selection)."""

    def __init__(self, where: str = "pattern", budget_s: float | None = None):
        self.where = where
        run = _RUN.get()
        self.budget = run if budget_s is None and run is not None else PatternBudget(budget_s)

    def __call__(self, name: str, pattern: str) -> bool:
        return self.budget.match(name, pattern, self.where)


def match_name(name: str, pattern: str) -> bool:
    """compressed-tensors' ``match_name(name, pattern)``, bounded: on the run's budget, or one of its own."""
    return NameMatcher()(name, pattern)
