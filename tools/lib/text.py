"""English text found on this machine, for the real model (all-MiniLM-L6-v2) the tables calibrate and evaluate.

Calibration text: Python's standard library docstrings; held-out text: the licence texts in
/usr/share/common-licenses. Both are cut into paragraphs of running prose and joined into samples long
enough to pass 128 tokens (:func:`samples`), or taken for a token budget (:func:`for_tokens`, the real
LLM's packed windows); :func:`tokenize` turns a text file into the model's inputs as
``graphcal export --text`` (``--pack``) does.
"""

from __future__ import annotations

import importlib
import inspect
import re
import warnings
from pathlib import Path

from tools.lib.synthetic import save_npz

STDLIB_MODULES = [
    "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "concurrent.futures", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum",
    "fractions", "ftplib", "functools", "getopt", "gettext", "glob", "heapq", "hmac", "http.client",
    "http.cookiejar", "http.server", "imaplib", "importlib", "inspect", "io", "ipaddress", "itertools", "json",
    "locale", "logging", "logging.handlers", "mailbox", "multiprocessing", "numbers", "operator", "optparse", "os",
    "pathlib", "pdb", "pickle", "pkgutil", "pprint", "pydoc", "queue", "random", "re", "sched", "secrets",
    "selectors", "shelve", "shlex", "shutil", "signal", "smtplib", "socket", "socketserver", "sqlite3",
    "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "trace", "traceback", "types", "typing", "unittest", "urllib.parse", "urllib.request", "uuid",
    "warnings", "weakref", "xml.dom.minidom", "zipfile",
]
#: other standard library modules, none in STDLIB_MODULES: the real LLM's in-domain held-out text
#: (docstrings, as the calibration text, from modules the calibration never reads)
HELDOUT_MODULES = [
    "ast", "base64", "binascii", "bz2", "cmd", "code", "codecs", "colorsys", "compileall", "contextvars", "copyreg",
    "ctypes", "dbm", "dis", "doctest", "email.utils", "email.parser", "filecmp", "fileinput", "fnmatch", "graphlib",
    "gzip", "hashlib", "html", "html.parser", "linecache", "lzma", "mimetypes", "modulefinder", "netrc",
    "plistlib", "platform", "poplib", "py_compile", "quopri", "reprlib", "rlcompleter", "runpy", "sqlite3.dbapi2",
    "ssl", "stat", "symtable", "sysconfig", "tabnanny", "tomllib", "turtle", "unittest.mock", "urllib.error",
    "urllib.robotparser", "wave", "webbrowser", "wsgiref.simple_server", "wsgiref.util", "xml.etree.ElementTree",
    "xml.sax", "xmlrpc.client", "xmlrpc.server", "zipapp", "zipimport", "zoneinfo",
]
HELDOUT_MODULES = [m for m in HELDOUT_MODULES if m not in STDLIB_MODULES]
LICENSES = Path("/usr/share/common-licenses")


def _prose(paragraph: str) -> bool:
    """A paragraph of running English text (not code, a table, a signature or a list of options)."""
    words = paragraph.split()
    if len(words) < 15 or ">>>" in paragraph or "::" in paragraph:
        return False
    letters = sum(c.isalpha() for c in paragraph)
    chars = sum(not c.isspace() for c in paragraph)
    return letters / max(chars, 1) > 0.8 and paragraph[0].isupper() and sum(w.islower() for w in words) > len(words) / 2


def _paragraphs(text: str) -> list[str]:
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]


def samples(paragraphs: list[str], count: int, min_words: int = 110) -> list[str]:
    """Consecutive paragraphs joined until each sample has ``min_words`` words (past 128 tokens), then
    ``count`` samples spread evenly over what was found."""
    found, current = [], []
    for p in paragraphs:
        current.append(p)
        if sum(len(c.split()) for c in current) >= min_words:
            found.append(" ".join(current))
            current = []
    if len(found) < count:
        raise SystemExit(f"found only {len(found)} text samples of {min_words}+ words, need {count}")
    step = len(found) / count
    return [found[int(i * step)] for i in range(count)]


def for_tokens(paragraphs: list[str], tokenizer, tokens: int) -> list[str]:
    """Paragraphs spread over ``paragraphs`` (every k-th, k the largest stride that still holds enough),
    cut to the fewest that fill ``tokens`` tokens when packed as ``graphcal export --pack`` packs lines:
    each tokenized alone, the end-of-sequence token after each (so little of the text goes unused)."""
    eos = tokenizer.eos_token_id
    lengths = [len(ids) + (not ids or ids[-1] != eos) for ids in tokenizer(paragraphs)["input_ids"]]
    for stride in range(max(1, sum(lengths) // tokens), 0, -1):
        total = 0
        for count, length in enumerate(lengths[::stride], 1):
            total += length
            if total >= tokens:
                return paragraphs[::stride][:count]
    raise SystemExit(f"found only {sum(lengths):,} tokens of text, need {tokens:,}")


def stdlib_text(modules: list[str] | None = None) -> list[str]:
    """Paragraphs of Python's standard library docstrings (modules, public classes and functions) of
    ``modules`` (default STDLIB_MODULES, the calibration text)."""
    paragraphs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in STDLIB_MODULES if modules is None else modules:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            objects = [module] + [getattr(module, a) for a in sorted(vars(module)) if not a.startswith("_")]
            for obj in objects:
                if obj is not module and not ((inspect.isclass(obj) or inspect.isfunction(obj))
                                              and getattr(obj, "__module__", None) == module.__name__):
                    continue
                doc = inspect.getdoc(obj)
                if doc:
                    paragraphs += [p for p in _paragraphs(doc) if _prose(p)]
    return list(dict.fromkeys(paragraphs))


def license_text() -> list[str]:
    """Paragraphs of the licence texts in /usr/share/common-licenses (one copy of each file)."""
    if not LICENSES.is_dir():
        raise SystemExit(f"{LICENSES} is missing: the held-out text for minilm comes from there")
    paragraphs, seen = [], set()
    for path in sorted(LICENSES.iterdir()):
        real = path.resolve()
        if real in seen or not real.is_file():
            continue
        seen.add(real)
        paragraphs += [p for p in _paragraphs(real.read_text(errors="replace")) if _prose(p)]
    return list(dict.fromkeys(paragraphs))


def tokenize(model_dir: Path, model: Path, text: Path, out: Path, seq: int, *, pack: bool = False,
             num_samples: int | None = None) -> dict:
    """The text file's lines, tokenized as graphcal export tokenizes --text (padded/truncated to ``seq``;
    with ``pack``, as --pack: full windows of the joined lines, at most ``num_samples``), for the
    inputs ``model`` names; written to ``out`` and returned."""
    import onnx  # lazy: only where MiniLM's data is made
    import transformers  # lazy: only where MiniLM's data is made

    from graphcal.export import tokenize_lines  # lazy: torch, only where MiniLM's data is made

    names = [i.name for i in onnx.load(str(model), load_external_data=False).graph.input]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    lines = [line.strip() for line in text.read_text().splitlines() if line.strip()]
    arrays = tokenize_lines(tokenizer, lines, names, seq, pack=pack, num_samples=num_samples, source=str(text))
    save_npz(out, arrays)
    return arrays
