"""Option text from strangers: JSON and YAML read within bounds, and values quoted back cut short.

A ``--scheme`` / ``--kv-cache-scheme`` JSON (and a model folder's genai_config.json, through
graphcal.data.fill) is read up to 1 MB and 32 levels of nesting; a
recipe's YAML with PyYAML's safe loader, a nesting cap and a cap on its size with every alias
expanded. In both, a key given twice in one mapping is refused (each format would keep the last
silently). Every limit is a one-line :class:`~graphcal.errors.UsageError` (a genai_config.json's:
a GraphcalError, as the file is data, not an option). Imports nothing of
graphcal's but its errors and limits.
"""

from __future__ import annotations

import json
import re

from graphcal.errors import GraphcalError, UsageError, shown
from graphcal.limits import json_depth

MAX_JSON_BYTES = 1 << 20
MAX_JSON_DEPTH = 32  # a scheme nests 3 deep; the cap keeps json's recursion far from Python's limit

MAX_RECIPE_BYTES = 1 << 20
MAX_RECIPE_DEPTH = 32  # a recipe nests about 6 deep
MAX_RECIPE_NODES = 100_000  # after aliases are expanded: a real recipe has a few hundred


def load_json(text: str, what: str, *, error: type[GraphcalError] = UsageError, needs: str = "a scheme needs 3"):
    """``json.loads`` for text from strangers: at most 1 MB and 32 levels deep, no key twice in one
    object (``error``, a usage error by default, otherwise; ``needs`` ends the nesting message).
    json's own errors (JSONDecodeError, a ValueError) pass through."""
    if len(text) > MAX_JSON_BYTES:
        raise error(f"{what} JSON is {len(text):,} characters; at most {MAX_JSON_BYTES:,} are read")
    if json_depth(text, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise error(f"{what} JSON nests deeper than {MAX_JSON_DEPTH} levels; {needs}")

    def once(pairs: list) -> dict:
        out = {}
        for key, value in pairs:
            if key in out:
                raise error(f"{what} JSON gives the key {shown(key)!r} twice in one object; json would keep only "
                            "the last, so give it once")
            out[key] = value
        return out

    return json.loads(text, object_pairs_hook=once)


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

        def compose_mapping_node(self, anchor):
            node = super().compose_mapping_node(anchor)
            _refuse_duplicate_keys(self, node, where)
            return node

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


def _refuse_duplicate_keys(loader, node, where: str) -> None:
    """A key given twice in one mapping of the document as written is a usage error naming it and
    its lines (YAML keeps the last silently: a second QuantizationModifier would replace the
    first). Keys compare as the loader reads them (``1`` and ``01`` are one key); ``<<`` merges are
    not keys (what they bring may be overridden, as YAML allows)."""
    import yaml  # lazy: only a recipe needs PyYAML (loaded already by load_yaml)

    seen: dict = {}  # key -> the line it was first given on
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue  # a merge, or a complex key (the safe loader refuses unhashable keys itself)
        try:
            key = loader.construct_object(key_node)
            again = key in seen
        except (TypeError, yaml.YAMLError):  # an unhashable or unknown key: the constructor refuses it later
            continue
        line = key_node.start_mark.line + 1
        if again:
            raise UsageError(f"{where}: the key {shown(str(key))!r} is given twice in one mapping (line {seen[key]}, "
                             f"then line {line}); YAML would keep only the last, so give it once")
        seen[key] = line


def pydantic_message(e) -> str:
    """The first error of a pydantic ValidationError as one line: ``loc: message``."""
    err = e.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ()))
    msg = re.sub(r"\s+", " ", err.get("msg", str(e)))
    return f"{where}: {msg}" if where else msg
