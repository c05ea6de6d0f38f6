"""Real text for haystacks: the Python standard library's own reference, its docstrings.

``STDLIB_MODULES`` is a fixed, sorted list of modules whose source ships with CPython 3.10 to
3.13. A module's text (``module_text``) is read from its source with ``ast`` (nothing is
imported or run; ``-OO`` does not matter): a heading and the docstring of the module, then of
each public top-level function and class and of each public method of those classes, in
source order. For a given Python version the text is fixed. A module whose source is not
installed gives no text and is left out.

Each module belongs to one split (``module_split``: a stable hash of its name, one in five
``"heldout"``), so held-out samples read documents no training sample saw.
``DocumentFiller(seed, split)`` is the haystack's filler (``haystack.Filler``): the split's
modules one after another in a seeded order (another order after the last), cut into
words; needles go at the starts of paragraphs and of sentences on unindented lines, never
among the lines of a code example or other indented paragraph.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.machinery
import itertools
import random
import re
import sysconfig
from collections.abc import Iterator

SPLITS = ("train", "heldout")

# Sources in CPython 3.10 to 3.13, none frozen into the interpreter (no source file), none
# whose classes moved to private modules (``pathlib``, ``datetime``'s C or ``_pydatetime``).
_STDLIB_TEXT = """
    argparse ast base64 bdb bisect bz2 calendar cmd code codeop collections colorsys
    compileall configparser contextlib copy csv ctypes dataclasses difflib dis doctest
    email.message email.utils enum filecmp fileinput fnmatch fractions ftplib functools
    getopt getpass gettext glob gzip heapq hmac html html.parser http.client
    http.cookiejar http.cookies http.server imaplib inspect ipaddress json json.decoder
    json.encoder linecache locale logging logging.handlers lzma mailbox mimetypes numbers
    operator optparse pdb pickle pickletools pkgutil platform plistlib poplib pprint profile
    pstats py_compile pyclbr queue quopri random rlcompleter sched secrets selectors shelve
    shlex shutil smtplib socket socketserver statistics string subprocess tabnanny tarfile
    tempfile textwrap threading timeit tokenize trace traceback tracemalloc types
    unittest.case unittest.mock urllib.parse urllib.request uuid warnings wave weakref
    webbrowser xml.dom.minidom xml.etree.ElementTree zipapp zipfile
    """
STDLIB_MODULES = tuple(sorted(_STDLIB_TEXT.split()))


def module_split(name: str) -> str:
    """``"heldout"`` for one module in five (a stable hash of its name), else ``"train"``."""
    digest = hashlib.sha256(f"longstraw-doc-split:{name}".encode()).digest()
    return "heldout" if digest[0] % 5 == 0 else "train"


def doc_modules(split: str = "train") -> tuple[str, ...]:
    """The modules of ``split``, sorted."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    return tuple(m for m in STDLIB_MODULES if module_split(m) == split)


@functools.cache
def _stdlib() -> str:
    return sysconfig.get_paths()["stdlib"]


def _source(name: str) -> str | None:
    """The source of stdlib module ``name``, found in the stdlib directory alone (a module of
    the same name elsewhere on ``sys.path`` does not shadow it) without importing it."""
    path: list[str] | None = [_stdlib()]
    spec = None
    for depth in range(1, name.count(".") + 2):
        if path is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(".".join(name.split(".")[:depth]), path)
        if spec is None:
            return None
        path = spec.submodule_search_locations
    if spec is None or spec.loader is None:
        return None
    try:
        return spec.loader.get_source(name)  # type: ignore[attr-defined]
    except (ImportError, OSError):
        return None


_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _documented(tree: ast.Module, name: str) -> Iterator[tuple[str, str]]:
    """``(heading, docstring)`` of the module and its public functions, classes, methods."""
    yield f"# Module {name}", ast.get_docstring(tree) or ""
    kinds = {ast.FunctionDef: "Function", ast.AsyncFunctionDef: "Function", ast.ClassDef: "Class"}
    for node in tree.body:
        if type(node) not in kinds or node.name.startswith("_"):
            continue
        yield f"## {kinds[type(node)]} {name}.{node.name}", ast.get_docstring(node) or ""
        if isinstance(node, ast.ClassDef):
            for method in node.body:
                if isinstance(method, _FUNCTIONS) and not method.name.startswith("_"):
                    heading = f"### Method {name}.{node.name}.{method.name}"
                    yield heading, ast.get_docstring(method) or ""


@functools.cache
def module_text(name: str) -> str:
    """The reference text of stdlib module ``name``: its docstrings under their headings, as
    the module docstring says; ``""`` when its source is not installed."""
    source = _source(name)
    if source is None:
        return ""
    sections = []
    for heading, doc in _documented(ast.parse(source), name):
        if doc.strip():
            lines = (line.expandtabs().rstrip() for line in doc.strip().splitlines())
            body = re.sub(r"\n{3,}", "\n\n", "\n".join(lines))
            sections.append(f"{heading}\n\n{body}")
    return "\n\n".join(sections)


# Where a note may go, as the position of the whitespace it takes before it: a blank line
# before a paragraph (or before an indented block's paragraph: the note goes unindented
# between the blocks), the space or line break after a sentence's end on an unindented line.
_PARAGRAPH = re.compile(r"\n\n(?=\S)")
_INDENTED = re.compile(r"\n\n(?= +\S)")
_SENTENCE = re.compile(r"[.!?][\"')\]]*([ \n])(?=[A-Z])")
# A word after its whitespace; a long word or run of spaces in pieces of up to 8 characters,
# so that the haystack can end within a few tokens of any length.
_PIECE = re.compile(r"\s{0,8}\S{1,8}|\s{1,8}")


@functools.cache
def _pieces(name: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The module's text, after a blank line, as pieces, and the indices of the pieces that
    start where a note may go (never among an indented paragraph's lines)."""
    text = "\n\n" + module_text(name)
    spots = {m.start() for m in _PARAGRAPH.finditer(text)}
    spots |= {m.start() for m in _INDENTED.finditer(text)}
    for m in _SENTENCE.finditer(text):
        line = text.rfind("\n", 0, m.start(1)) + 1
        if m.group(1) == "\n" or text[line] != " ":
            spots.add(m.start(1))
    cuts = sorted(spots | {m.end() for m in _INDENTED.finditer(text)} | {0, len(text)})
    pieces: list[str] = []
    starts: list[int] = []
    for a, b in itertools.pairwise(cuts):
        if a in spots:
            starts.append(len(pieces))
        pieces.extend(_PIECE.findall(text, a, b))
    return tuple(pieces), tuple(starts)


class DocumentFiller:
    """The split's modules' text, module after module in a seeded order (a new order after
    the last): a ``haystack.Filler`` whose boundaries are paragraph and sentence starts."""

    separator = "\n\n"

    def __init__(self, seed: int, split: str = "train") -> None:
        self.split = split
        self._modules = doc_modules(split)
        self._rng = random.Random(f"longstraw-documents:{split}:{seed}")
        self._queue: list[str] = []
        self.pieces: list[str] = []
        self.boundaries: list[int] = []
        self.modules: list[str] = []  # in order of appearance

    def ensure(self, n_pieces: int) -> None:
        empty = 0  # modules in a row without text: all of them means none is installed
        while len(self.pieces) < n_pieces:
            if empty == len(self._modules):
                raise RuntimeError(f"no stdlib module of split {self.split!r} has its source here")
            if not self._queue:
                self._queue = self._rng.sample(self._modules, len(self._modules))[::-1]
            name = self._queue.pop()
            pieces, starts = _pieces(name)
            empty = 0 if pieces else empty + 1
            if pieces:
                self.boundaries.extend(len(self.pieces) + b for b in starts)
                self.pieces.extend(pieces)
                self.modules.append(name)
