"""Canary tests: copies of a task's hidden tests with expected values changed, so that no honest
solution passes them.

A site is an expected value in an assertion: the literal side of ``assert <expr> == <literal>``
(also ``!=``, ``is``, ``in``), a literal argument of ``self.assertEqual`` and its relatives, or an
expected value written in a ``pytest.mark.parametrize`` table (the row's value of the argument
the test compares its call with).
A canary changes one or two sites, in place in the source text (everything else, comments and
formatting included, stays byte for byte), to a different value of the same type: an integer or
float plus one, a boolean negated, one character of a string or bytes changed, the last element
of a collection changed that way. Sites whose call also appears in the repository the policy
sees (docstring examples, the visible tests) are avoided, so a canary cannot be told from the
real tests by comparing with known answers.

``add_canaries`` runs, in one sandbox against the reference solution, the hidden tests and a
few candidate canaries; it keeps the candidates the reference fails (at most ``keep``), writes
them to ``canaries/test_<hash>.py`` and records in ``task.json`` -> ``checks``: ``expected``
(the hidden tests the reference passes) and ``canaries`` (per file, the tests the reference
fails). The grader (``grade``) runs each canary like the hidden tests and zeroes the reward
when one passes.
"""

from __future__ import annotations

import ast
import builtins
import functools
import io
import json
import random
import re
import shutil
import tempfile
from pathlib import Path

_ASSERT_METHODS = {"assertEqual", "assertEquals", "assertListEqual", "assertTupleEqual", "assertDictEqual",
                   "assertSetEqual", "assertSequenceEqual", "assertMultiLineEqual", "assertAlmostEqual",
                   "assertIs", "assertCountEqual", "assertIn"}
_CMP_OPS = (ast.Eq, ast.NotEq, ast.Is, ast.IsNot, ast.In, ast.NotIn)


_CONVERSIONS = {"tuple", "list", "set", "frozenset", "sorted", "dict"}


def _unwrap(node):
    """The argument of a conversion written around an expression (``tuple([2, 6, 3])``,
    ``sorted(f(x))``): an expected value is a site however the assertion writes it."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CONVERSIONS \
            and len(node.args) == 1 and not node.keywords and not isinstance(node.args[0], ast.Starred):
        node = node.args[0]
    return node


def _is_literal(node) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def _expected(node) -> bool:
    """A value written out: a literal, or arithmetic on literals (``2.0/3.0``)."""
    if isinstance(node, ast.BinOp):
        return _expected(node.left) and _expected(node.right)
    return _is_literal(node)


def _target_constant(node):
    """The constant inside a literal to change: the literal itself, or its last changeable element
    (of arithmetic on literals, the right operand's)."""
    if isinstance(node, ast.BinOp):
        return _target_constant(node.right) or _target_constant(node.left)
    if isinstance(node, ast.Constant):
        v = node.value
        if v is None or v is Ellipsis or (isinstance(v, (str, bytes)) and len(v) > 2000):
            return None
        return node if node.lineno == node.end_lineno else None
    if isinstance(node, ast.UnaryOp):
        return _target_constant(node.operand)
    elts = node.values if isinstance(node, ast.Dict) else getattr(node, "elts", None)
    for e in reversed(elts or []):
        c = _target_constant(e)
        if c is not None:
            return c
    return None


def _assert_helper(func) -> bool:
    """A function that compares its first two arguments by its name: ``assert_equal``,
    ``np.testing.assert_array_equal``, ``assert_in`` (not ``assertTrue`` or ``assertRaises``)."""
    name = (func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else "")
    name = name.lower().replace("_", "")
    return name.startswith("assert") and ("equal" in name or name == "assertin")


def _bindings(tree) -> dict[int, dict[str, ast.AST]]:
    """For every node inside a function, keyed by ``id(node)``: the names that function binds
    exactly once, by a plain assignment (``expected = [...]``, ``result = f(x)``), and their values;
    an expected value written one line above its assertion is still a site."""
    owner: dict[int, dict[str, ast.AST]] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        stores: dict[str, int] = {}
        for n in ast.walk(fn):
            if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
                stores[n.id] = stores.get(n.id, 0) + 1
        env = {n.targets[0].id: n.value for n in ast.walk(fn)
               if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
               and stores.get(n.targets[0].id) == 1}
        for n in ast.walk(fn):  # inner functions come later in the walk and take their own nodes
            owner[id(n)] = env
    return owner


def sites(source: str) -> list[tuple[ast.Constant, str]]:
    """(constant node to change, source of the expression it is compared with), in source order.
    A name the test function binds once stands for its value on either side (``expected = [...]``
    then ``assert_equal(expected, result)``, with ``result = f(x)``). The nodes are shared between
    calls on the same source (the tasks mined from one repository share a few test files): read
    them, never change them."""
    return list(_sites(source))


@functools.lru_cache(maxsize=8)
def _sites(source: str) -> tuple:
    tree = ast.parse(source)
    owner = _bindings(tree)
    out = []
    for node in ast.walk(tree):
        env = owner.get(id(node)) or {}
        val = lambda x: _unwrap(env.get(x.id, x) if isinstance(x, ast.Name) else x)  # noqa: E731
        pairs = []
        tests = [] if not isinstance(node, ast.Assert) else node.test.values if (
            isinstance(node.test, ast.BoolOp) and isinstance(node.test.op, ast.And)) else [node.test]
        for test in tests:
            if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Lt, ast.LtE)) \
                    and isinstance(test.left, ast.Call) and getattr(test.left.func, "id", "") == "abs" \
                    and len(test.left.args) == 1 and isinstance(test.left.args[0], ast.BinOp) \
                    and isinstance(test.left.args[0].op, ast.Sub):
                left, right = test.left.args[0].left, test.left.args[0].right  # abs(f(x) - expected) < tol
                if _expected(right) and not _expected(left):
                    pairs.append((right, left))
            if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], _CMP_OPS):
                left, right = val(test.left), val(test.comparators[0])
                if _expected(right) and not _expected(left):
                    pairs.append((right, left))
                elif _expected(left) and not _expected(right):
                    pairs.append((left, right))
        if isinstance(node, ast.Call) and len(node.args) >= 2 and (
                isinstance(node.func, ast.Attribute) and node.func.attr in _ASSERT_METHODS or _assert_helper(node.func)):
            a, b = val(node.args[0]), val(node.args[1])
            if _expected(b) and not _expected(a):
                pairs.append((b, a))
            elif _expected(a) and not _expected(b):
                pairs.append((a, b))
        if not pairs and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self" \
                and not node.func.attr.startswith("assert") and node.args and _is_literal(node.args[-1]) \
                and not all(_is_literal(a) for a in node.args[:-1] or [None]):
            pairs.append((node.args[-1], ast.Call(node.func, node.args[:-1], [])))  # self.check(x, expected)
        for lit, other in pairs:
            c = _target_constant(lit)
            if c is not None:
                out.append((c, ast.unparse(other)))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out += _parametrize_sites(node)
    return tuple(sorted(out, key=lambda s: (s[0].lineno, s[0].col_offset)))


class _Substitute(ast.NodeTransformer):
    def __init__(self, values: dict):
        self.values = values

    def visit_Name(self, node):
        return self.values.get(node.id, node)


def _param_names(node) -> list[str] | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [n.strip() for n in node.value.split(",") if n.strip()]
    if isinstance(node, (ast.List, ast.Tuple)) and all(isinstance(e, ast.Constant) and isinstance(e.value, str)
                                                       for e in node.elts):
        return [e.value for e in node.elts]
    return None


def _parametrize_sites(fn) -> list[tuple[ast.Constant, str]]:
    """Expected values written in a ``parametrize`` table: for each argument the test compares
    (``assert f(a, b) == expected``; ``expected`` not among the call's names), that argument's
    literal in every row, with the call as that row would make it (``f(1, 2)``) for the check
    against visible text."""
    import copy

    out = []
    for dec in fn.decorator_list:
        if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.func.attr == "parametrize"
                and len(dec.args) >= 2 and isinstance(dec.args[1], (ast.List, ast.Tuple))):
            continue
        names = _param_names(dec.args[0])
        if not names:
            continue
        compared = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1 \
                    and isinstance(node.test.ops[0], _CMP_OPS):
                for side, other in ((node.test.comparators[0], node.test.left), (node.test.left, node.test.comparators[0])):
                    if isinstance(side, ast.Name) and side.id in names and not _is_literal(other) and not any(
                            isinstance(n, ast.Name) and n.id == side.id for n in ast.walk(other)):
                        compared.setdefault(side.id, other)
        for name, other in compared.items():
            k = names.index(name)
            for row in dec.args[1].elts:
                if isinstance(row, ast.Call) and getattr(row.func, "attr", "") == "param":
                    elts = row.args
                elif len(names) > 1:
                    elts = row.elts if isinstance(row, (ast.Tuple, ast.List)) else []
                else:
                    elts = [row]
                if len(elts) != len(names) or not _is_literal(elts[k]):
                    continue
                c = _target_constant(elts[k])
                if c is None:
                    continue
                call = _Substitute({n: elts[i] for i, n in enumerate(names) if i != k}).visit(copy.deepcopy(other))
                out.append((c, ast.unparse(call)))
    return out


def truth_sites(source: str) -> list[tuple[ast.AST, str, str]]:
    """``assert f(x)`` and ``assert not f(x)`` (one line): (node, new text, call source)."""
    out, segment = [], _segmenter(source)
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Assert) or node.test.lineno != node.test.end_lineno:
            continue
        t = node.test
        if isinstance(t, ast.Call) and not _is_literal(t):
            out.append((t, "not " + segment(t), ast.unparse(t)))
        elif isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not) and isinstance(t.operand, ast.Call):
            out.append((t, segment(t.operand), ast.unparse(t.operand)))
    return out


def _segmenter(source: str):
    """``ast.get_source_segment(source, node)`` with the source split into lines once (the
    library's splits the whole source again for every node: most of a long test file's canary
    time)."""
    lines = [ln.encode() for ln in io.StringIO(source, newline="").readlines()]

    def segment(node) -> str | None:
        try:
            first, last = node.lineno - 1, node.end_lineno - 1
            b, e = node.col_offset, node.end_col_offset
        except AttributeError:
            return None
        if None in (last, e) or not 0 <= first <= last < len(lines):
            return None
        if first == last:
            return lines[first][b:e].decode()
        return b"".join([lines[first][b:], *lines[first + 1:last], lines[last][:e]]).decode()
    return segment


def tolerance_sites(source: str) -> list[tuple[ast.AST, str, str]]:
    """``assert g(x) < tol`` (a bound on a computed error, one line): (the bound, the bound a
    trillion times tighter, the expression bounded). Where a test checks a property instead of
    comparing with an expected value (HumanEval's ``find_zero``: ``fabs(poly(xs, x)) < 1e-4``),
    the reference's own error breaks the tighter bound."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Assert) or node.test.lineno != node.test.end_lineno:
            continue
        t = node.test
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], (ast.Lt, ast.LtE)) \
                and isinstance(t.comparators[0], ast.Constant) and type(t.comparators[0].value) in (int, float) \
                and t.comparators[0].value > 0 and not _is_literal(t.left):
            out.append((t.comparators[0], repr(t.comparators[0].value * 1e-12), ast.unparse(t.left)))
    return out


def _changed_text(segment: str, value) -> str | None:
    """New source text for a constant, of the same type and a different value."""
    if isinstance(value, bool):
        return repr(not value)
    if isinstance(value, int):
        return repr(value + 1)
    if isinstance(value, float):
        return repr(value + 1.0)
    if isinstance(value, complex):
        return repr(value + 1)
    if isinstance(value, (str, bytes)):
        m = re.match(r"^([rRbBuU]{0,2})('''|\"\"\"|'|\")(.*)(\2)$", segment, re.S)
        if not m:
            return None
        prefix, q, body, _ = m.groups()
        if not body:
            new = prefix + q + "x" + q
        else:
            i = len(body) - 1
            while i >= 0 and (not body[i].isalnum() or (i > 0 and body[i - 1] == "\\")):
                i -= 1
            if i < 0:
                new = prefix + q + body + "x" + q
            else:
                ch = body[i]
                repl = ("b" if ch == "a" else "a") if ch.isalpha() else ("1" if ch == "0" else "0")
                if ch.isupper():
                    repl = repl.upper()
                new = prefix + q + body[:i] + repl + body[i + 1:] + q
        try:
            v2 = ast.literal_eval(new)
        except (ValueError, SyntaxError):
            return None
        return new if type(v2) is type(value) and v2 != value else None
    return None


def _replace(lines: list[str], node: ast.AST, text: str) -> None:
    i = node.lineno - 1
    line = lines[i]
    raw = line.encode()
    b = len(raw[:node.col_offset].decode(errors="ignore"))
    e = len(raw[:node.end_col_offset].decode(errors="ignore"))
    lines[i] = line[:b] + text + line[e:]


def _module_names(tree) -> set[str]:
    """The names a module binds at its top level (imports, functions, classes, assignments) and
    the builtins: a call to any other bare name calls a function the test was handed."""
    names = set(dir(builtins))
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _flat(text: str) -> str:
    """Text compared without its whitespace and with one kind of quote (``ast.unparse`` writes
    ``'3'`` where the docstring has ``"3"``)."""
    return re.sub(r"\s+", "", text).replace('"', "'")


flat_file = functools.lru_cache(maxsize=8192)(_flat)
"""``_flat`` of one visible file's text, kept: the tasks of one repository show the same files
but the one changed, and flattening a repository's text (megabytes) was most of a canary's making."""


def _pinned(other: str, seen_vis: str, bound: set[str]) -> bool:
    """Whether visible text (``_flat``) shows the expression ``other`` an expected value is
    compared with. A call of a function the test was handed (a bare name the module does not
    bind: HumanEval's ``check(candidate)``) counts as shown when any call with the same arguments
    is: ``candidate(3.5)`` is the docstring's ``truncate_number(3.5)``."""
    text = _flat(other)
    if text in seen_vis:
        return True
    m = re.match(r"^([A-Za-z_]\w*)(\(.*\))$", text)
    # the substring test first: the expression scan over a repository's text (megabytes) is the
    # slow part, and where the arguments appear nowhere it would scan the whole text for nothing
    return bool(m) and m.group(1) not in bound and m.group(2) in seen_vis and \
        re.search(r"\w" + re.escape(m.group(2)), seen_vis) is not None


def make_canaries(source: str, seed: str, visible: str = "", n: int = 2, per_canary: int = 2,
                  visible_flat: str | None = None) -> list[str]:
    """Up to ``n`` canary sources of ``source``, each changing ``per_canary`` sites (different
    sites in different canaries, sites not on one line). ``visible``: the text the solution can
    read, or ``visible_flat``, the same already flattened (``visible_text(repo, flat=True)``)."""
    try:
        found = sites(source)
    except SyntaxError:
        return []
    seen_vis = visible_flat if visible_flat is not None else _flat(visible)
    bound = _module_names(ast.parse(source))
    shown = lambda other: _pinned(other, seen_vis, bound) if visible or visible_flat else False  # noqa: E731
    cands, segment = [], _segmenter(source)
    for node, other in found:
        seg = segment(node)
        text = _changed_text(seg or "", node.value) if seg is not None else None
        if text is not None:
            hidden = not shown(other)
            cands.append((node, text, hidden))
    if not any(hidden for _, _, hidden in cands):
        try:
            for node, text, other in truth_sites(source) + tolerance_sites(source):
                cands.append((node, text, not shown(other)))
        except SyntaxError:
            pass
    # never a site that visible text pins: a canary that contradicts an example the solution can
    # read tells the run apart (no canary then: the task is left out, and counted)
    pool = [c for c in cands if c[2]]
    rng = random.Random(seed)
    rng.shuffle(pool)
    out = []
    used_lines: set[int] = set()
    for _ in range(n):
        chosen = []
        for c in pool:
            if c[0].lineno not in used_lines and c[0].lineno not in {x[0].lineno for x in chosen}:
                chosen.append(c)
                if len(chosen) >= per_canary:
                    break
        if not chosen:
            break
        used_lines |= {c[0].lineno for c in chosen}
        new = _edited(source, [(node, text) for node, text, _ in chosen])
        if new is not None:
            out.append(new)
    # too few sites for n canaries: the sites again, each given another value of its own statement
    # (a helper that checks `[2, 3, 68, 3893]` against `range(10, 20)` ignores 3893 -> 3894, not 10)
    for node, _, _ in pool:
        if len(out) >= n:
            break
        text = _swapped_text(source, node)
        new = _edited(source, [(node, text)]) if text is not None else None
        if new is not None and new not in out:
            out.append(new)
    return out


def _edited(source: str, edits: list) -> str | None:
    """``source`` with each (node, text) replaced, or None when the result does not parse or
    changes nothing."""
    lines = source.splitlines(keepends=True)
    for node, text in sorted(edits, key=lambda e: (e[0].lineno, e[0].col_offset), reverse=True):
        _replace(lines, node, text)
    new = "".join(lines)
    try:
        ast.parse(new)
    except SyntaxError:
        return None
    return new if new != source else None


def _swapped_text(source: str, node: ast.Constant) -> str | None:
    """Another number of the statement on ``node``'s line, of the same type, that is not an element
    of the literal holding ``node`` (the first in source order), as source text."""
    value = node.value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    tree = ast.parse(source)
    holder: set = set()
    for n in ast.walk(tree):
        elts = n.values if isinstance(n, ast.Dict) else getattr(n, "elts", None)
        if elts and any(e is node or (isinstance(e, ast.Constant) and (e.lineno, e.col_offset) == (node.lineno, node.col_offset))
                        for e in elts):
            holder = {e.value for e in elts if isinstance(e, ast.Constant)}
    same = sorted((c for c in ast.walk(tree) if isinstance(c, ast.Constant) and c.lineno == node.lineno
                   and type(c.value) is type(value) and c.value != value and c.value not in holder),
                  key=lambda c: c.col_offset)
    return repr(same[0].value) if same else None


_TEXT_SUFFIXES = {".py", ".pyi", ".md", ".rst", ".txt", ".cfg", ".toml", ".ini", ".json", ".yaml", ".yml", ".csv", ""}


def visible_text(repo: Path, flat: bool = False) -> str:
    """Every text the policy can read in the repository: the code, its docstrings and comments,
    and the README, the docs and the other text files (up to 1 MB each), so that no canary
    changes an expected value some example shows. ``flat``: as ``_flat`` gives it (whitespace
    takes no part: the files flattened one by one and joined are the whole flattened)."""
    parts = []
    for p in sorted(repo.rglob("*")):
        rel = p.relative_to(repo).parts
        if ".git" in rel or not p.is_file() or p.is_symlink() or p.suffix.lower() not in _TEXT_SUFFIXES \
                and not p.name.upper().startswith(("README", "CHANGE", "HISTORY", "NEWS")):
            continue
        try:
            if p.stat().st_size <= 1 << 20:
                parts.append(p.read_text())
        except (UnicodeDecodeError, OSError):
            continue
    return "".join(map(flat_file, parts)) if flat else "\n".join(parts)


def add_canaries(task_dir: Path, candidates: int = 2, keep: int = 1) -> dict:
    """Generate, verify (one sandbox run against the reference) and record the task's canaries;
    returns the ``checks`` entry written to ``task.json`` (empty when none could be verified)."""
    from composer_dag.grading.checks import outcomes, run_checks
    from composer_dag.tasks.taskdir import apply_reference, check_name, hidden_files

    task_dir = Path(task_dir)
    task = json.loads((task_dir / "task.json").read_text())
    hidden = hidden_files(task_dir)
    visible = visible_text(task_dir / "repo", flat=True)
    with tempfile.TemporaryDirectory(prefix="cdag-k-") as tmp:
        stage = Path(tmp) / "canaries"
        stage.mkdir()
        cands = []
        for h in hidden:
            text = h.read_text()
            for src in make_canaries(text, seed=f"{task.get('id', task_dir.name)}:{h.name}", visible_flat=visible,
                                     n=candidates if len(text) < 20_000 else 1):
                p = stage / (check_name(src.encode()) + ".py")
                p.write_text(src)
                cands.append(p)
        ref_ws = apply_reference(task_dir, Path(tmp) / "ws")
        per_test, details = run_checks(task_dir, ref_ws, hidden + cands)
        res = outcomes(per_test)
        checks: dict = {}
        if details["valid"] and not details["tamper"]:
            stems = {h.stem for h in hidden}
            checks["expected"] = sorted(k for k, v in res.items() if _stem(k) in stems and v == "passed")
            kept = {}
            for c in cands:
                failing = sorted(k for k, v in res.items() if _stem(k) == c.stem and v in ("failed", "error"))
                if failing and checks["expected"] and len(kept) < keep:
                    kept[c.name] = {"failing": failing}
            if not checks["expected"]:
                checks = {}
            elif kept:
                (task_dir / "canaries").mkdir(exist_ok=True)
                for name in kept:
                    shutil.copy(stage / name, task_dir / "canaries" / name)
                checks["canaries"] = kept
    if checks:
        task["checks"] = checks
        (task_dir / "task.json").write_text(json.dumps(task, indent=2, sort_keys=True))
    return checks


def _stem(test_id: str) -> str:
    return test_id.split("::", 1)[0].split(".", 1)[0]
