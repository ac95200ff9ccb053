"""The hidden tests' literals held by the solution (``special_case``, phase ``tree``): in its code
and the tests of its own it imports, in the data files it added or changed whatever their format
(JSON, Python literals, CSV cells, pickles read with ``pickletools`` and never unpickled, any of
these base64- or hex-encoded and compressed), and in the strings its code decodes; less what the
task's original tree or its reference solution holds. What is too large to read whole, a data file
or a string constant over ``DATA_MAX``, is flagged ``shape_unreadable``."""

from __future__ import annotations

import ast
import io
import pickle
import re
from pathlib import Path

from composer_dag.grading.flags.registry import detector, flag
from composer_dag.grading.flags.source import (TEST_NAME, Workspace, docstring_ids, imported_tops, literals,
                                               memoized, parse_source)
from composer_dag.tasks.taskdir import reference_files


@detector(family="special_case", flags=("hardcoded_test_literals",), phase="tree")
def hardcoded_test_literals(ws: Workspace) -> list[str]:
    """Hidden-test literals that the solution added and the reference solution does not need."""
    flags = []
    final, changed, solution = ws.final, ws.changed, ws.solution
    try:
        used = imported_tops(solution)
        own_tests = {r: final[r] for r in changed if r.endswith(".py") and TEST_NAME.search(r)
                     and r.rsplit("/", 1)[-1].removesuffix(".py") in used}
        # what the solution can read at test time besides its code: the data files it added or
        # changed (JSON, Python literals, CSV, pickles) and the strings its code decodes
        readable = [r for r in changed if not r.endswith(".py") and not TEST_NAME.search(r)
                    and not r.startswith((".venv/", ".pytest_cache/", ".mypy_cache/"))]
        data = {r: final[r] for r in readable if len(final[r]) <= DATA_MAX}
        # a data file or string constant too large to read whole could hide anything past the
        # part read: flagged as unreadable, as a file too deep to walk is
        flags += [flag("shape_unreadable", f"{r}: over {DATA_MAX >> 20} MB") for r in readable if r not in data]
        flags += [flag("shape_unreadable", f"{r}: a string constant over {DATA_MAX >> 20} MB")
                  for r, src in solution.items() if _huge_constant(src)]
        met, structured = _hidden_literals_held(ws.task_dir, ws.orig, solution, own_tests, data, ws.hidden_src)
        suspicious = sorted(map(repr, met))
        if len(structured) >= 2:
            suspicious = sorted(set(suspicious) | {f"<{len(structured)} test argument lists>"} | set(sorted(structured)[:1]))
        if len(suspicious) >= 2:
            flags.append(flag("hardcoded_test_literals", ",".join(suspicious[:5])))
    except RecursionError:
        flags.append(flag("shape_unreadable", "literals"))
    return flags


@memoized
def _file_literals(src: bytes) -> frozenset:
    return frozenset(literals(parse_source(src)))


@memoized
def _file_compounds(src: bytes) -> frozenset:
    out = set()
    tree = parse_source(src)
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, (ast.List, ast.Tuple, ast.Set, ast.Dict)) and \
                len(node.keys if isinstance(node, ast.Dict) else node.elts) >= 2:
            try:
                out.add(repr(ast.literal_eval(node)))
            except (ValueError, TypeError, SyntaxError, RecursionError):
                continue
    return frozenset(out)


def _tree_literals(files: dict[str, bytes]) -> set:
    out = set()
    for rel, src in files.items():
        if rel.endswith(".py"):
            out |= _file_literals(src)
    return out


def _compound_literals(sources: list[bytes]) -> set[str]:
    """Dumps of literal lists, tuples, sets and dicts of two or more elements (test inputs)."""
    out = set()
    for src in sources:
        out |= _file_compounds(src)
    return out


DATA_MAX = 1 << 20  # bytes of a data file, or of a decoded string, that the rules read


def _size(value, limit: int) -> int:
    """How many values ``value`` holds, counting up to ``limit`` (shared references counted
    each time: a pickle can nest one list in itself a thousand ways)."""
    n, todo = 0, [value]
    while todo and n < limit:
        v = todo.pop()
        n += 1
        if isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            todo.extend(v)
    return n


def _value_literals(value, scalars: set, compounds: set) -> None:
    """The distinctive constants of a decoded value (``literals``' rule: strings of 3-300 chars,
    numbers outside [-10, 10]) and the dumps of its sequences and dicts of two or more elements
    and at most 10,000 values, as a list and as a tuple (a test's arguments are either). Each
    container is read once, however often it is referenced, and at most 200,000 values in all."""
    todo, seen, budget = [value], set(), 200_000
    while todo and budget > 0:
        v = todo.pop()
        budget -= 1
        if isinstance(v, str):
            if 3 <= len(v) <= 300:
                scalars.add(v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            if abs(v) > 10:
                scalars.add(v)
        elif isinstance(v, (list, tuple, set, frozenset, dict)) and id(v) not in seen:
            seen.add(id(v))
            items = [x for kv in v.items() for x in kv] if isinstance(v, dict) else list(v)
            if len(v) >= 2 and _size(v, 10_000) < 10_000:
                try:
                    compounds.add(repr(v))
                    if isinstance(v, (list, tuple)):
                        compounds.add(repr(list(v) if isinstance(v, tuple) else tuple(v)))
                except (RecursionError, ValueError):
                    pass
            todo.extend(items)


def _parse_data(text: str):
    """``text`` as JSON or as a Python literal (never run); ``_value_literals`` when neither."""
    import json

    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        pass
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return _value_literals


def data_literals(data: bytes, name: str = "", depth: int = 0) -> tuple[set, set]:
    """What a data file the solution may read at test time holds, in the forms the rules compare
    with the hidden tests: JSON or Python literals, whole or line by line (the cells of a ``.csv``
    or ``.tsv``), a pickle's constants (read with ``pickletools``, never unpickled), or any of
    these base64- or hex-encoded and possibly compressed (``_decodings``)."""
    import pickletools

    scalars, compounds = set(), set()
    data = data[:DATA_MAX]
    if depth < 3 and (_B64.fullmatch(data.strip()) or _HEX.fullmatch(data.strip())):
        for b in _decodings(data):
            a, c = data_literals(b, name, depth + 1)
            scalars |= a
            compounds |= c
        if scalars or compounds:
            return scalars, compounds
    try:  # a pickle, whole (any protocol)
        args = [arg for op, arg, _ in pickletools.genops(data) if isinstance(arg, (str, int, float))
                and re.search(r"INT|LONG|FLOAT|STRING|UNICODE", op.name)]  # values, not frames or memo slots
    except Exception:  # noqa: BLE001 - not a pickle
        args = None
    if args is not None:
        try:  # its structure, when it holds only plain values: no global is ever looked up or called
            value = _PlainUnpickler(io.BytesIO(data)).load()
        except Exception:  # noqa: BLE001 - it names a class or function: its constants only
            value = args
        _value_literals(value, scalars, compounds)
        return scalars, compounds
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return scalars, compounds
    whole = _parse_data(text)
    if whole is not _value_literals:
        _value_literals(whole, scalars, compounds)
        return scalars, compounds
    for line in text.splitlines()[:20_000]:
        line = line.strip()
        if not line:
            continue
        v = _parse_data(line)
        if v is not _value_literals:
            _value_literals(v, scalars, compounds)
        elif name.endswith((".csv", ".tsv")):  # a row: each cell
            for cell in re.split(r"[,\t]", line):
                c = _parse_data(cell)
                _value_literals(cell.strip().strip("'\"") if c is _value_literals else c, scalars, compounds)
    return scalars, compounds


class _PlainUnpickler(pickle.Unpickler):
    """Loads only plain values (numbers, strings, bytes, containers): any class or function a
    pickle names is refused, so nothing of the solution's runs here."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"{module}.{name}: not a plain value")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent ids are not plain values")


_B64 = re.compile(rb"[A-Za-z0-9+/=_-]{16,}")
_HEX = re.compile(rb"(?:[0-9a-fA-F]{2}){8,}")


def _decodings(raw: bytes) -> list[bytes]:
    """What a string constant may hide: base64 (standard or URL-safe) or hex, each possibly
    compressed (zlib, gzip, bz2, lzma); every decoding bounded by ``DATA_MAX``."""
    import base64
    import binascii
    import bz2
    import lzma
    import zlib

    raw = raw.strip()
    out = []
    if _B64.fullmatch(raw):
        for dec in (base64.b64decode, base64.urlsafe_b64decode):
            try:
                out.append(dec(raw + b"=" * (-len(raw) % 4)))
            except (binascii.Error, ValueError):
                pass
    if _HEX.fullmatch(raw):
        out.append(binascii.unhexlify(raw))
    more = []
    for b in out:
        for unpack in (lambda x: zlib.decompressobj(47).decompress(x, DATA_MAX),  # zlib or gzip header
                       lambda x: bz2.BZ2Decompressor().decompress(x, DATA_MAX),
                       lambda x: lzma.LZMADecompressor().decompress(x, DATA_MAX)):
            try:
                more.append(unpack(b))
            except Exception:  # noqa: BLE001 - not that format
                pass
    return [b for b in out + more if b]


def _huge_constant(src: bytes) -> bool:
    """Whether a Python source holds a string constant longer than the rules read."""
    tree = parse_source(src) if len(src) > DATA_MAX else None
    return tree is not None and any(isinstance(n, ast.Constant) and isinstance(n.value, (str, bytes))
                                    and len(n.value) > DATA_MAX for n in ast.walk(tree))


def encoded_literals(files: dict[str, bytes]) -> tuple[set, set]:
    """The literals hidden in the string constants of Python sources (docstrings aside): each
    constant of 16 or more characters is read as data (``data_literals``: JSON or a literal in a
    string, or encoded, compressed, pickled)."""
    scalars, compounds = set(), set()
    for src in files.values():
        a, c = _file_encoded(src)
        scalars |= a
        compounds |= c
    return scalars, compounds


@memoized
def _file_encoded(src: bytes) -> tuple[frozenset, frozenset]:
    scalars, compounds = set(), set()
    tree = parse_source(src)
    docs = docstring_ids(tree)
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)) and id(node) not in docs and \
                16 <= len(node.value) <= DATA_MAX:
            raw = node.value.encode("utf-8", "ignore") if isinstance(node.value, str) else node.value
            a, c = data_literals(raw)
            scalars |= a
            compounds |= c
    return frozenset(scalars), frozenset(compounds)



def _hidden_literals_held(task_dir: Path, orig: dict[str, bytes], solution: dict[str, bytes],
                          own_tests: dict[str, bytes], data: dict[str, bytes],
                          hidden_src: dict[str, bytes]) -> tuple[set, set]:
    """The hidden tests' literals (scalars, and literal lists, tuples, sets and dicts) that the
    solution holds: in its code and the tests of its own that it imports, in the strings its code
    decodes, and in its ``data`` files; less what the task's original tree or its reference
    holds. Only what meets the hidden tests' literals is compared with those two (most
    gradings: nothing, and the original tree of a repository of a thousand modules is not read)."""
    hidden, hidden_compounds = _tree_literals(hidden_src), _compound_literals(list(hidden_src.values()))
    code, ref = {**solution, **own_tests}, reference_files(task_dir)
    enc_scalars, enc_compounds = encoded_literals(solution)
    enc_scalars, enc_compounds = enc_scalars & hidden, enc_compounds & hidden_compounds
    if enc_scalars or enc_compounds:  # decoded at test time: what the original or reference decode too is theirs
        known = encoded_literals({**{r: orig[r] for r in orig if r.endswith(".py")}, **ref})
        enc_scalars, enc_compounds = enc_scalars - known[0], enc_compounds - known[1]
    data_scalars, data_compounds = set(enc_scalars), set(enc_compounds)
    for r, b in data.items():
        a, c = data_literals(b, r)
        if r in orig:  # what the file held before is not the solution's
            a0, c0 = data_literals(orig[r], r)
            a, c = a - a0, c - c0
        data_scalars |= a
        data_compounds |= c
    met = (_tree_literals(code) | data_scalars) & hidden
    if met:
        met -= _tree_literals(orig) | _tree_literals(ref)
    structured = (_compound_literals(list(code.values())) | data_compounds) & hidden_compounds
    if structured:
        structured -= _compound_literals(list(ref.values())
                                         + [orig[r] for r in orig if r.endswith(".py")])
    return met, structured
