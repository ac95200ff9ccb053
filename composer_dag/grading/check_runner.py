"""The test runner the grader starts inside the sandbox (standard library only; run as a script).

``python3 -I -B check_runner.py ROOT REPORT_DIR FILE...``: the first line of standard input is
a per-run secret key, read and consumed before anything else is imported, then standard input
is replaced by ``/dev/null``. The runner then records the framework objects the verdict depends
on (builtins, ``os``/``sys`` exits and writes, every method of ``unittest``'s case, result,
suite and loader classes, its own functions), puts ``ROOT`` first on ``sys.path``, imports each
test file as a module and runs its ``unittest`` cases and its module-level ``test*`` functions,
each outcome caught by the runner itself (``passed``, ``failed``, ``error``, ``skipped``,
``xfailed``, ``xpassed``). With ``--pytest INI CHECKS_ROOT PATH...`` it runs pytest in its own
process instead (the settings file and the tree recorded with the task, plugin autoload off, no
conftest above ``CHECKS_ROOT``), records each report itself and watches pytest's runner,
report and collection functions as it watches ``unittest``'s. After every test it checks that the recorded objects are still the
originals and that no trace or profile hook is set. At the end it runs the exit handlers the
code under test registered, checks once more, and writes one ``results.json`` into
``REPORT_DIR`` (created exclusively, links not followed): an HMAC-SHA256 of the payload with
the key, then the payload. It then leaves with ``os._exit`` (no further code of the solution
runs). The grader trusts the file only if the MAC verifies and it is the only entry of
``REPORT_DIR``.
"""

import os
import sys


def _forget_keys():
    """Clear this uid's user, user-session and persistent keyrings: a run before this one under
    the same grading identity may have left keys there, the one kernel object kept per user
    that outlives its processes."""
    import ctypes

    nr = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)
    if nr is None:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    keyctl = libc.syscall
    keyctl.restype = ctypes.c_long
    clear, get_persistent = 7, 22
    for ring in (-4, -5):  # KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING
        keyctl(ctypes.c_long(nr), ctypes.c_long(clear), ctypes.c_long(ring))
    persistent = keyctl(ctypes.c_long(nr), ctypes.c_long(get_persistent), ctypes.c_long(-1), ctypes.c_long(-2))
    if persistent > 0:
        keyctl(ctypes.c_long(nr), ctypes.c_long(clear), ctypes.c_long(persistent))


def _main():  # noqa: C901 - one closure on purpose: the key lives only in its cells
    key = b""
    while not key.endswith(b"\n") and len(key) < 1024:
        chunk = os.read(0, 1024)
        if not chunk:
            break
        key += chunk
    key = key.strip()
    nul = os.open(os.devnull, os.O_RDONLY)
    os.dup2(nul, 0)
    os.close(nul)
    _forget_keys()

    import atexit
    import builtins
    import hashlib
    import hmac
    import importlib.util
    import inspect
    import json
    import traceback
    import unittest
    import unittest.case
    import unittest.suite

    root, report_dir, files = sys.argv[1], sys.argv[2], sys.argv[3:]
    pytest_mode = files[:1] == ["--pytest"]
    if pytest_mode:  # --pytest INI CHECKS_ROOT SITE_DIRS PATH...: the recorded tree, run by pytest here
        ini, checks_root, sites, files = files[1], files[2], files[3], files[4:]
        for k in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS"):
            os.environ.pop(k, None)
        os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        # started with -S: no site ran at startup, so no sitecustomize or .pth of the workspace's
        # could run before the key was read; the environment's site directories are added now
        import site

        venv = os.path.dirname(os.path.dirname(sys.executable))  # what site.venv() would have set
        if os.path.isfile(os.path.join(venv, "pyvenv.cfg")):
            sys.prefix = sys.exec_prefix = venv
        for d in sites.split(":"):
            if d:
                site.addsitedir(d)
        # a report's outcome as the bootstrap runs map it: their plugin (``pytest_report.py``, laid
        # beside this file by the grader), loaded from its path and kept out of ``sys.modules``
        spec = importlib.util.spec_from_file_location(
            "cdag_pytest_report", os.path.join(os.path.dirname(os.path.abspath(__file__)), "pytest_report.py"))
        report_plugin = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(report_plugin)
        outcome_of = report_plugin.outcome_of
    _exit, _open, _write, _close = os._exit, os.open, os.write, os.close
    _dumps, _hmac_new, _sha256 = json.dumps, hmac.new, hashlib.sha256
    _gettrace, _getprofile = sys.gettrace, sys.getprofile
    results, messages, tamper, events = {}, {}, [], []

    watched = []

    def watch(owner, names, label):
        d = vars(owner)
        for n in names:
            if n in d:
                v = d[n]
                fn = getattr(v, "__func__", v)
                watched.append((d, n, v, getattr(fn, "__code__", None), f"{label}.{n}"))

    watch(builtins, ["__import__", "isinstance", "issubclass", "getattr", "setattr", "hasattr", "len",
                     "repr", "str", "int", "float", "bool", "list", "tuple", "dict", "set", "type", "object",
                     "print", "open", "exec", "eval", "compile", "all", "any", "sorted", "abs", "round",
                     "callable", "iter", "next", "range", "zip", "map", "filter", "sum", "min", "max",
                     "AssertionError", "Exception", "BaseException", "SystemExit", "KeyboardInterrupt",
                     "__build_class__", "id", "hash", "vars", "exit", "quit"], "builtins")
    watch(os, ["_exit", "write", "open", "close", "replace", "rename", "unlink", "remove", "kill", "abort"], "os")
    watch(sys, ["exit", "settrace", "setprofile", "excepthook", "gettrace", "getprofile"], "sys")
    watch(unittest, ["TestCase", "TestResult", "TestSuite", "TestLoader", "SkipTest", "FunctionTestCase",
                     "defaultTestLoader"], "unittest")
    frameworks = [unittest.TestCase, unittest.TestResult, unittest.TestSuite, unittest.suite.BaseTestSuite,
                  unittest.TestLoader, unittest.case._Outcome, unittest.FunctionTestCase, unittest.SkipTest]
    for cls in frameworks:
        watch(cls, [n for n, v in vars(cls).items() if callable(v) or isinstance(v, (staticmethod, classmethod))],
              cls.__qualname__)
    class_keys = [(cls, frozenset(vars(cls))) for cls in frameworks]
    watch(unittest.case, [n for n, v in vars(unittest.case).items() if inspect.isfunction(v)], "unittest.case")
    watch(hmac, ["new", "compare_digest", "HMAC"], "hmac")
    watch(hashlib, ["sha256"], "hashlib")
    watch(json, ["dumps"], "json")
    if pytest_mode:
        import _pytest.main
        import _pytest.python
        import _pytest.reports
        import _pytest.runner
        import pytest

        watch(pytest, ["main", "fail", "skip", "xfail", "raises", "approx", "TestReport", "Function", "Item"], "pytest")
        watch(report_plugin, ["outcome_of"], "pytest_report")
        watch(_pytest.runner, [n for n, v in vars(_pytest.runner).items() if inspect.isfunction(v)], "_pytest.runner")
        watch(_pytest.main, [n for n, v in vars(_pytest.main).items() if inspect.isfunction(v)], "_pytest.main")
        watch(_pytest.python, [n for n, v in vars(_pytest.python).items() if inspect.isfunction(v)], "_pytest.python")
        for cls in (_pytest.reports.TestReport, _pytest.reports.BaseReport, _pytest.runner.CallInfo,
                    _pytest.python.Function):
            watch(cls, [n for n, v in vars(cls).items() if callable(v) or isinstance(v, (staticmethod, classmethod))],
                  cls.__qualname__)
    meta_path = list(sys.meta_path)

    def check(where):
        bad = []
        for d, n, v, code, label in watched:
            cur = d.get(n, None)
            if cur is not v or (code is not None and getattr(getattr(cur, "__func__", cur), "__code__", None) is not code):
                bad.append(label)
        for cls, keys in class_keys:
            if frozenset(vars(cls)) != keys:
                bad.append(f"{cls.__qualname__}.<attributes>")
        if _gettrace() is not None or _getprofile() is not None:
            bad.append("sys.settrace/setprofile")
        if [id(m) for m in sys.meta_path[:len(meta_path)]] != [id(m) for m in meta_path]:
            bad.append("sys.meta_path")
        for b in bad:
            entry = f"{b} changed ({where})"
            if entry not in tamper and len(tamper) < 20:
                tamper.append(entry)

    def text(exc):
        try:
            return "".join(traceback.format_exception_only(type(exc), exc))[-500:]
        except BaseException:
            return type(exc).__name__

    def record(key_, outcome, exc=None):
        if results.get(key_) in ("failed", "error") and outcome == "passed":
            return
        results[key_] = outcome
        if exc is not None and outcome in ("failed", "error"):
            messages[key_] = text(exc)
        if isinstance(exc, (SystemExit, KeyboardInterrupt)):
            events.append(f"{type(exc).__name__} raised in {key_}")

    def case_id(mod, test):
        tid = test.id()
        name = mod.__name__
        if isinstance(test, unittest.TestCase) and tid.startswith(name + "."):
            rest = tid[len(name) + 1:]
            cls, _, meth = rest.rpartition(".")
            return f"{name}.{cls}::{meth}" if cls else f"{name}::{meth}"
        return f"{name}::{tid}"

    class Result(unittest.TestResult):
        def __init__(self, mod):
            super().__init__()
            self.mod = mod

        def _k(self, test):
            return case_id(self.mod, test)

        def addSuccess(self, test):
            record(self._k(test), "passed")

        def addFailure(self, test, err):
            record(self._k(test), "failed", err[1])

        def addError(self, test, err):
            record(self._k(test), "error", err[1])

        def addSkip(self, test, reason):
            record(self._k(test), "skipped")

        def addExpectedFailure(self, test, err):
            record(self._k(test), "xfailed")

        def addUnexpectedSuccess(self, test):
            record(self._k(test), "xpassed")

        def addSubTest(self, test, subtest, err):
            if err is not None:
                record(self._k(test), "failed" if issubclass(err[0], AssertionError) else "error", err[1])

        def stopTest(self, test):
            check(self._k(test))

    for cls in (Result,):
        watch(cls, [n for n, v in vars(cls).items() if callable(v)], "runner.Result")
    for fn in (check, text, record, case_id):
        watched.append(({"f": fn}, "f", fn, fn.__code__, f"runner.{fn.__name__}"))

    def seal():
        check("end")
        try:
            seen, built = foreign(), built_files()
        except Exception as e:  # noqa: BLE001 - the workspace's modules made unreadable: that is a finding too
            seen, built = [f"the workspace's modules could not be read ({type(e).__name__})"], {}
        payload = _dumps({"results": results, "messages": messages, "tamper": tamper, "events": events,
                          "files": files, "foreign": seen, "built": built}, sort_keys=True).encode()
        mac = _hmac_new(key, payload, _sha256).hexdigest().encode()
        fd = _open(os.path.join(report_dir, "results.json"),
                   os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        data = mac + b"\n" + payload
        while data:
            data = data[_write(fd, data):]
        _close(fd)

    top = os.path.realpath(root) + os.sep
    venv_top = top + ".venv" + os.sep
    _getframe, _realpath, _b64 = sys._getframe, os.path.realpath, __import__("base64").b64encode
    made, by_checks, compiled = {}, set(), []  # what the solution's code wrote (path -> read back), the tests'
    over = []  # more was built than is recorded or read: the grader flags it, so junk cannot hide the rest
    read = []  # the built files read back, in order (at most 200)
    # what no run writes: a read there is of the installation, not of something built for the run
    fixed = tuple({_realpath(d) + os.sep for d in (sys.prefix, sys.base_prefix, sys.exec_prefix, "/usr", "/etc",
                                                    "/proc", "/sys", "/dev", "/bin", "/sbin", "/lib", "/lib64", "/opt")})
    # a file changed since the run began (its ctime, which no process can set back) was built
    # during it, by the solution's code or by a process it started
    began = __import__("time").time() - 0.02

    def whose():
        f = _getframe(2)
        while f is not None:
            fn = f.f_code.co_filename
            if fn.startswith(top) and not fn.startswith(venv_top):
                return "solution"
            if fn.startswith("/var/tmp/"):
                return "checks"
            f = f.f_back
        return None

    def audit(event, args):
        # the files the solution's code writes and reads back, and the sources it compiles from a
        # string: what it may build at run time from an encoded constant (the grader scans them)
        try:
            if event == "open" and isinstance(args[0], (str, bytes)):
                mode, flags = args[1] or "", args[2] or 0
                writes = any(c in str(mode) for c in "wax+") or bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
                who = whose()
                if who is None:
                    return
                path = _realpath(os.fsdecode(args[0]))
                if who == "checks":
                    if writes:
                        by_checks.add(path)
                elif writes:
                    if path not in made and len(made) >= 100_000:
                        over.append(path)
                    else:
                        made.setdefault(path, False)
                elif not made.get(path) and (path in made or (
                        not (path.startswith(fixed) or path.startswith(venv_top))
                        and os.stat(path).st_ctime >= began)):  # read back, or read after another process made it
                    if len(read) >= 200:
                        over.append(path)
                    else:
                        made[path] = True
                        read.append(path)
            elif event == "compile" and isinstance(args[0], (str, bytes)) \
                    and str(args[1]).startswith("<") and whose() == "solution":
                if len(compiled) < 50:  # decorators may compile many: past 50, unrecorded and not flagged
                    compiled.append(args[0] if isinstance(args[0], bytes) else args[0].encode("utf-8", "replace"))
        except Exception:  # noqa: BLE001 - never in the way of the code under test
            pass

    sys.addaudithook(audit)

    def built_files():
        out, budget = {}, 4 << 20
        for path in read:
            if path in by_checks:
                continue
            if budget <= 0:
                over.append(path)
                break
            try:
                fd = _open(path, os.O_RDONLY | os.O_NONBLOCK)
                try:
                    data = os.read(fd, min(budget, (1 << 20) + 1)) if stat_reg(fd) else b""
                finally:
                    _close(fd)
            except OSError:
                continue
            budget -= len(data)
            out[path] = _b64(data).decode()
        for i, src in enumerate(compiled):
            out[f"<compiled {i}>"] = _b64(src[:1 << 20]).decode()
        if over:
            out["<over>"] = ""
        return out

    def stat_reg(fd):
        return (os.fstat(fd).st_mode & 0o170000) == 0o100000

    def foreign():
        """The functions and classes of the workspace's modules whose code was loaded from another
        copy of a workspace module (a file at that module's path under a ``sys.path`` entry outside
        the workspace: the interpreter's own module, an installed copy), or, defined under the
        module's own name, from a file outside the workspace (another file's text compiled under
        its path); never code compiled from a string."""
        out, mods, dirs = [], [], set()
        for d in sys.path:
            rd = _realpath(d or ".") + os.sep
            if not rd.startswith(top) or rd.startswith(venv_top):
                dirs.add(rd)
        for name, mod in list(sys.modules.items()):
            f = vars(mod).get("__file__") if type(mod).__name__ == "module" else None
            if isinstance(f, str) and _realpath(f).startswith(top) and not _realpath(f).startswith(venv_top):
                mods.append((name, mod))
        paths = {n.replace(".", os.sep) + ext for n, _ in mods for ext in (".py", os.sep + "__init__.py")}
        copies = {d + p for d in dirs for p in paths}
        for name, mod in mods:
            for attr, v in list(vars(mod).items()):
                codes = code_files(v, name)
                for fn, own in codes:
                    if fn.startswith("<"):
                        # compiled from a string: what decorators and code generators make
                        # (networkx's argmap, dataclasses); the source is scanned as data, and
                        # exec of a file's text is seen in the code (delegation's exec_file)
                        continue
                    real = _realpath(fn)
                    if real in copies or (own and not (real.startswith(top) and not real.startswith(venv_top))):
                        out.append(f"{name}.{attr} from {fn}")
                        break
                if len(out) >= 20:
                    return out
        return out

    def code_files(v, modname):
        """(code file, module-level function of the module's own name) of a function (unwrapped)
        or of the methods a class of the module defines."""
        fnt = type(foreign)
        if type(v) is fnt:
            for _ in range(50):
                w = v.__dict__.get("__wrapped__")
                if type(w) is not fnt:
                    break
                v = w
            return [(v.__code__.co_filename, v.__module__ == modname)]
        if isinstance(v, type) and vars(v).get("__module__") == modname:
            out = []
            for m in list(vars(v).values()):
                m = getattr(m, "__func__", m) if type(m) in (staticmethod, classmethod) else m
                if type(m) is fnt and not m.__code__.co_filename.startswith("<"):
                    out.append((m.__code__.co_filename, False))
            return out
        return []

    for fn in (foreign, code_files, built_files, stat_reg, whose, audit):
        watched.append(({"f": fn}, "f", fn, fn.__code__, f"runner.{fn.__name__}"))
    sys.path.insert(0, root)
    check("start")
    if pytest_mode:
        class Recorder:
            def pytest_sessionstart(self, session):
                meta_path[:] = list(sys.meta_path)  # pytest's assertion rewriting hook, now in place

            def pytest_collectreport(self, report):
                if report.failed:
                    record(f"{report.nodeid or '<collection>'}::<module>", "error", RuntimeError(str(report.longrepr)[-500:]))

            def pytest_runtest_logreport(self, report):
                if report.when != "call" and report.passed:
                    return
                outcome = outcome_of(report)
                exc = RuntimeError(str(report.longrepr)[-500:]) if outcome in ("failed", "error") else None
                if exc is not None and report.longrepr is not None:
                    exc = AssertionError(str(getattr(report.longrepr, "reprcrash", None) and
                                             report.longrepr.reprcrash.message or report.longrepr)[-500:])
                record(report.nodeid, outcome, exc)

            def pytest_runtest_logfinish(self, nodeid, location):
                check(nodeid)

        rec = Recorder()
        watch(Recorder, [n for n, v in vars(Recorder).items() if callable(v)], "runner.Recorder")
        try:
            pytest.main(["-c", ini, "--rootdir", checks_root, "--confcutdir", checks_root, "-p", "no:cacheprovider",
                         "-o", "addopts=", "-q", "-rN", "--color=no", *files], plugins=[rec])
        except BaseException as e:  # noqa: BLE001
            record("<pytest>::<session>", "error", e)
        # pytest takes its assertion rewriting hook out again at the end: only that one may go
        meta_path[:] = [m for m in meta_path if m in sys.meta_path or type(m).__name__ != "AssertionRewritingHook"]
    for path in ([] if pytest_mode else files):
        name = os.path.basename(path)[:-3]
        try:
            spec = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
        except BaseException as e:  # noqa: BLE001 - the import of code under test may raise anything
            record(f"{name}::<module>", "error", e)
            continue
        check(f"{name} imported")
        try:
            suite = unittest.TestLoader().loadTestsFromModule(mod)
            suite.run(Result(mod))
        except BaseException as e:  # noqa: BLE001
            record(f"{name}::<suite>", "error", e)
        for fname, f in list(vars(mod).items()):
            if not (fname.startswith("test") and inspect.isfunction(f) and f.__module__ == name):
                continue
            k = f"{name}::{fname}"
            try:
                f()
                record(k, "passed")
            except unittest.SkipTest:
                record(k, "skipped")
            except AssertionError as e:
                record(k, "failed", e)
            except BaseException as e:  # noqa: BLE001
                record(k, "error", e)
            check(k)
    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        pass
    try:
        for s in (sys.__stdout__, sys.__stderr__):
            s.flush()
    except BaseException:  # noqa: BLE001
        pass
    try:
        seal()
        code = 0
    except BaseException:  # noqa: BLE001
        code = 3
    _exit(code)


if __name__ == "__main__":
    _main()
