"""Secret redaction: credentials and e-mail addresses become placeholders.

Kinds and what matches them (``find_secrets`` and ``redact`` share one matcher, ``secret_spans``):

- tokens (whole match replaced): PEM private-key blocks, AWS access key ids (AKIA/ASIA...),
  AWS secret keys in an ``aws_secret_access_key = ...`` assignment (the value), GitHub tokens
  (ghp_/gho_/ghu_/ghs_/ghr_, github_pat_), Slack tokens (xox?-), Google API keys (AIza...).
- generic assignments (``password``, ``api_key``): an identifier ending in password / passwd /
  passphrase, or api_key / api_token / secret / secret_key / access_token / auth_token /
  private_key (any case), then ``=`` or ``:`` (optionally after a closing quote/bracket, as in
  ``"api_key": ...`` or ``d['password'] = ...``), then a quoted literal. Only the literal's
  value is replaced, and only literals count, so ``password = None``, ``password = input()``
  and ``password = os.environ[...]`` stay as they are.
- e-mail addresses: ``local@domain.tld`` where the top-level domain is two lowercase letters or
  a common generic one (com, org, ...), which keeps ``x@self.weight`` (matrix product) out.

Placeholders never match again, so redaction is idempotent and ``find_secrets`` finds nothing
in redacted text. ``SECRET_PATTERNS`` holds every pattern; each starts with a literal, so the
regex engine skips ahead with a fast substring search, and the case-insensitive kinds run on
the lower-cased text (same length, same offsets) instead of using re.IGNORECASE.
"""

from __future__ import annotations

import ipaddress
import re

_WB = rb"[A-Za-z0-9_]"
_ASSIGN = rb"""(?![a-z0-9_])(?:["']\]?|\]?)\s*[:=]\s*(["'])(?!<[a-z_]+>)(?P<v>[^"'\n]{1,200})\1"""


def _word(prefix: bytes, rest: bytes) -> re.Pattern[bytes]:
    """``prefix`` (fixed width, starting with a literal, which keeps the scan fast) at the start
    of a word, then ``rest``."""
    return re.compile(prefix + rb"(?<!" + _WB + prefix + rb")" + rest)


# kind -> patterns. Patterns of the kinds in ON_LOWER run on the lower-cased text (same
# offsets); where a pattern has a group named ``v`` only that value is replaced.
SECRET_PATTERNS: dict[str, tuple[re.Pattern[bytes], ...]] = {
    "private_key": (
        re.compile(
            rb"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----[A-Za-z0-9+/=\s:,.\\-]{20,}?"
            rb"-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"
        ),
    ),
    "aws_access_key": (_word(rb"AKIA", rb"[0-9A-Z]{16}\b"), _word(rb"ASIA", rb"[0-9A-Z]{16}\b")),
    "aws_secret_key": (
        re.compile(
            rb"aws_?secret_?(?:access_?)?key(?:[\"']\]?|\]?)\s*[:=]\s*[\"']?"
            rb"(?P<v>[a-z0-9/+]{40})(?![a-z0-9/+])"
        ),
    ),
    "github_token": (
        _word(rb"gh[pousr]_", rb"[A-Za-z0-9]{36}\b"),
        _word(rb"github_pat_", rb"[A-Za-z0-9_]{22,255}\b"),
    ),
    "slack_token": (_word(rb"xox[abposr]-", rb"[A-Za-z0-9-]{10,}"),),
    "google_api_key": (_word(rb"AIza", rb"[0-9A-Za-z_\-]{35}"),),
    "password": (re.compile(rb"pass(?:word|wd|phrase)" + _ASSIGN),),
    "api_key": tuple(
        re.compile(p + _ASSIGN)
        for p in (rb"api_?(?:key|token)", rb"secret(?:_?key)?", rb"access_?token", rb"auth_?token", rb"private_?key")
    ),
    "email": (
        re.compile(rb"@(?:[A-Za-z0-9-]+\.)+(?:[a-z]{2}|com|org|net|edu|gov|mil|int|info|biz|io|dev|ai|app|name|pro)\b"),
    ),
}
ON_LOWER = frozenset({"aws_secret_key", "password", "api_key"})
# kind -> for each of its patterns, literals of which every match contains one (in the text the
# pattern runs on: the lower-cased text for ON_LOWER kinds). A file containing none of a
# pattern's literals has no match of it, so ``secret_spans`` skips that pattern (see ``NEEDLES``).
NEEDLES: dict[str, tuple[tuple[bytes, ...], ...]] = {
    "private_key": ((b"-----BEGIN ",),),
    "aws_access_key": ((b"AKIA",), (b"ASIA",)),
    "aws_secret_key": ((b"awssecret", b"aws_secret"),),
    "github_token": ((b"ghp_", b"gho_", b"ghu_", b"ghs_", b"ghr_"), (b"github_pat_",)),
    "slack_token": ((b"xox",),),
    "google_api_key": ((b"AIza",),),
    "password": ((b"password", b"passwd", b"passphrase"),),
    "api_key": (
        (b"apikey", b"api_key", b"apitoken", b"api_token"),
        (b"secret",),
        (b"accesstoken", b"access_token"),
        (b"authtoken", b"auth_token"),
        (b"privatekey", b"private_key"),
    ),
    "email": ((b"@",),),
}
PATTERN_IDS: tuple[tuple[str, int], ...] = tuple(
    (kind, i) for kind, patterns in SECRET_PATTERNS.items() for i in range(len(patterns)))
_EMAIL_LOCAL = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._%+-")

PLACEHOLDERS: dict[str, bytes] = {
    "private_key": b"<PRIVATE_KEY>",
    "aws_access_key": b"<API_KEY>",
    "aws_secret_key": b"<API_KEY>",
    "github_token": b"<API_KEY>",
    "slack_token": b"<API_KEY>",
    "google_api_key": b"<API_KEY>",
    "password": b"<PASSWORD>",
    "api_key": b"<API_KEY>",
    "email": b"<EMAIL>",
}
SECRET_KINDS: tuple[str, ...] = tuple(PLACEHOLDERS)


def _b(text: str | bytes) -> bytes:
    return text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)


def secret_spans(data: bytes, only: frozenset[tuple[str, int]] | None = None) -> list[tuple[int, int, str]]:
    """Non-overlapping ``(start, end, kind)`` byte spans to replace, sorted by start.

    ``only``: the ``(kind, pattern index)`` pairs to run, where the caller knows the others
    cannot match (none of their ``NEEDLES`` is in ``data``); None runs every pattern."""
    lower = data.lower() if only is None or any(kind in ON_LOWER for kind, _ in only) else data
    spans: list[tuple[int, int, str]] = []
    for kind, patterns in SECRET_PATTERNS.items():
        text = lower if kind in ON_LOWER else data
        for i, pat in enumerate(patterns):
            if only is not None and (kind, i) not in only:
                continue
            for m in pat.finditer(text):
                if kind == "email":  # the pattern starts at '@': extend over the local part
                    start = m.start()
                    while start > 0 and data[start - 1] in _EMAIL_LOCAL:
                        start -= 1
                    if start < m.start():
                        spans.append((start, m.end(), kind))
                else:
                    g = "v" if "v" in pat.groupindex else 0
                    spans.append((m.start(g), m.end(g), kind))
    rank = {kind: r for r, kind in enumerate(PLACEHOLDERS)}
    spans.sort(key=lambda s: (s[0], rank[s[2]]))
    out: list[tuple[int, int, str]] = []
    for s in spans:  # where spans overlap the earliest wins (at one start, the first kind listed)
        if out and s[0] < out[-1][1]:
            continue
        out.append(s)
    return out


def find_secrets(text: str | bytes) -> list[str]:
    """The kind of every secret found in ``text``, in order of position ([] if clean)."""
    return [kind for _, _, kind in secret_spans(_b(text))]


def redact(data: bytes, only: frozenset[tuple[str, int]] | None = None) -> tuple[bytes, dict[str, int]]:
    """``data`` with every secret replaced by its placeholder, and the count per kind
    (``only`` as for ``secret_spans``)."""
    spans = secret_spans(data, only)
    if not spans:
        return data, {}
    parts, counts, last = [], {}, 0
    for s, e, kind in spans:
        parts += [data[last:s], PLACEHOLDERS[kind]]
        counts[kind] = counts.get(kind, 0) + 1
        last = e
    parts.append(data[last:])
    return b"".join(parts), counts


# ---------------------------------------------------------------- identities (user sessions)
#
# A harness session carries who and where its user is: the user's login and the machine's name
# (in prompts, paths, ``git`` output), home directories, and addresses. The corpus keeps these
# as they are (an address or a path in source code is content: a test's ``10.0.0.1``, a
# README's ``/home/user``), so these kinds are a second pass, run on sessions only.
#
# - ``home_path``: ``/home/NAME``, ``/Users/NAME``, ``C:\Users\NAME`` -> the same with ``<USER>``;
# - ``user_name`` / ``host_name``: each name the session declares (its client's user and host)
#   wherever it stands as a word, plus the ``NAME@HOST`` of a shell prompt;
# - ``ip_address``: what parses as an IPv4 or IPv6 address (``ipaddress``), except loopback and
#   the unspecified address.
IDENTITY_PLACEHOLDERS = {"home_path": "<USER>", "user_name": "<USER>", "host_name": "<HOST>", "ip_address": "<IP>"}
IDENTITY_KINDS: tuple[str, ...] = tuple(IDENTITY_PLACEHOLDERS)
_HOME = re.compile(r"(?P<pre>/home/|/Users/|[A-Za-z]:\\\\?Users\\\\?)(?P<name>(?!<USER>)[A-Za-z0-9._-]{1,64})")
_PROMPT = re.compile(r"\b(?P<user>(?!<)[a-z_][a-z0-9_-]{0,31})@(?P<host>(?!<)[A-Za-z0-9][A-Za-z0-9-]{0,62})(?=[:\s])")
_IP = re.compile(r"(?<![\w.:])(?:\d{1,3}(?:\.\d{1,3}){3}|[0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4}){2,7})(?![\w.:])")


def redact_identities(text: str, users: tuple[str, ...] = (), hosts: tuple[str, ...] = ()) -> tuple[str, dict[str, int]]:
    """``text`` with home paths, the given user and host names, ``user@host`` prompts and IP
    addresses replaced by placeholders, and the count per kind. Idempotent."""
    counts: dict[str, int] = {}

    def bump(kind: str, n: int = 1) -> None:
        if n:
            counts[kind] = counts.get(kind, 0) + n

    def home(m: re.Match) -> str:
        bump("home_path")
        return m.group("pre") + "<USER>"

    text = _HOME.sub(home, text)

    def prompt(m: re.Match) -> str:
        bump("user_name")
        bump("host_name")
        return "<USER>@<HOST>"

    text = _PROMPT.sub(prompt, text)
    for kind, names in (("user_name", users), ("host_name", hosts)):
        for name in sorted({n for n in names if n and len(n) >= 2}, key=len, reverse=True):
            text, n = re.subn(r"(?<![A-Za-z0-9_])" + re.escape(name) + r"(?![A-Za-z0-9_])",
                              IDENTITY_PLACEHOLDERS[kind], text)
            bump(kind, n)

    def ip(m: re.Match) -> str:
        if not any(c.isdigit() for c in m.group(0)):  # ``a::b``, ``dead::beef``: words, not addresses
            return m.group(0)
        try:  # the candidate must parse as an address: ``12:30:45`` and ``1.2.3.400`` do not
            addr = ipaddress.ip_address(m.group(0))
        except ValueError:
            return m.group(0)
        if addr.is_loopback or addr.is_unspecified:
            return m.group(0)
        bump("ip_address")
        return "<IP>"

    text = _IP.sub(ip, text)
    return text, counts
