"""Option text from strangers: JSON and YAML read within bounds, and values quoted back cut short.

A ``--scheme`` / ``--kv-cache-scheme`` JSON is read up to 1 MB and 32 levels of nesting; a
recipe's YAML with PyYAML's safe loader, a nesting cap and a cap on its size with every alias
expanded. Every limit is a one-line :class:`~graphcal.errors.UsageError`. Imports nothing of
graphcal's but its errors.
"""

from __future__ import annotations

import json
import re

from graphcal.errors import UsageError

MAX_JSON_BYTES = 1 << 20
MAX_JSON_DEPTH = 32  # a scheme nests 3 deep; the cap keeps json's recursion far from Python's limit

MAX_RECIPE_BYTES = 1 << 20
MAX_RECIPE_DEPTH = 32  # a recipe nests about 6 deep
MAX_RECIPE_NODES = 100_000  # after aliases are expanded: a real recipe has a few hundred


def load_json(text: str, what: str):
    """``json.loads`` for option values from strangers: at most 1 MB and 32 levels deep (a usage error otherwise)."""
    if len(text) > MAX_JSON_BYTES:
        raise UsageError(f"{what} JSON is {len(text):,} characters; at most {MAX_JSON_BYTES:,} are read")
    depth, deepest, in_string, escaped = 0, 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                raise UsageError(f"{what} JSON nests deeper than {MAX_JSON_DEPTH} levels; a scheme needs 3")
        elif ch in "]}":
            depth -= 1
    return json.loads(text)


def load_yaml(text: str, where: str):
    """YAML from a stranger: PyYAML's safe loader, plus a nesting cap (the composer recurses) and a
    cap on the document's size with every alias expanded (a 1 KB "billion laughs" recipe of
    nested aliases is refused before anything walks it). PyYAML's own errors pass through."""
    import yaml  # lazy: only a recipe needs PyYAML

    class Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent, index):
            self.depth += 1
            try:
                if self.depth > MAX_RECIPE_DEPTH:
                    raise UsageError(f"{where}: the YAML nests deeper than {MAX_RECIPE_DEPTH} levels")
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    loader = Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        expanded: dict[int, int] = {}

        def size(n) -> int:  # nodes with every alias expanded, each shared node counted once per use
            if id(n) not in expanded:
                expanded[id(n)] = 0  # a recursive alias counts as empty here; the cap still bounds its uses
                children = n.value if isinstance(n.value, list) else []
                total = 1
                for child in children:
                    for c in child if isinstance(child, tuple) else (child,):
                        total += size(c)
                        if total > MAX_RECIPE_NODES:
                            break
                    if total > MAX_RECIPE_NODES:
                        break
                expanded[id(n)] = total
            return expanded[id(n)]

        if size(node) > MAX_RECIPE_NODES:
            raise UsageError(f"{where}: the YAML expands to more than {MAX_RECIPE_NODES:,} values "
                             "(aliases nested on aliases); a recipe needs a few hundred")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def shown(text: str) -> str:
    """An option's value for a message, cut to 60 characters (a stranger's value may be huge)."""
    return text if len(text) <= 60 else text[:57] + "..."


def pydantic_message(e) -> str:
    """The first error of a pydantic ValidationError as one line: ``loc: message``."""
    err = e.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ()))
    msg = re.sub(r"\s+", " ", err.get("msg", str(e)))
    return f"{where}: {msg}" if where else msg
