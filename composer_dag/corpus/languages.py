"""Language detection from a file's name, extension and (for extensionless scripts) shebang.

Language ids are short lowercase names (``python``, ``cpp``, ``makefile``, ...); ``LANGUAGES``
lists them all. Precedence: exact file name, then file-name prefix (``Dockerfile.dev``), then
extension (case-insensitive), then the shebang line of the content.
"""

from __future__ import annotations

import posixpath
import re

_EXTENSIONS = {  # language id -> extensions
    "python": "py pyi pyw pyx pxd", "javascript": "js mjs cjs jsx", "typescript": "ts tsx mts cts",
    "java": "java", "c": "c h", "cpp": "cc cpp cxx c++ hh hpp hxx h++ ipp inl", "csharp": "cs csx",
    "go": "go", "rust": "rs", "ruby": "rb rake gemspec", "php": "php phtml", "swift": "swift",
    "kotlin": "kt kts", "scala": "scala sc", "shell": "sh bash zsh ksh fish",
    "powershell": "ps1 psm1 psd1", "batch": "bat cmd", "sql": "sql", "html": "html htm xhtml",
    "css": "css scss sass less", "markdown": "md markdown", "json": "json jsonl ipynb",
    "yaml": "yaml yml", "toml": "toml", "xml": "xml xsd xsl xslt svg plist",
    "ini": "ini cfg conf properties", "r": "r", "lua": "lua", "perl": "pl pm t",
    "haskell": "hs lhs", "ocaml": "ml mli", "elixir": "ex exs", "erlang": "erl hrl",
    "clojure": "clj cljs cljc edn", "dart": "dart", "julia": "jl", "objective-c": "m mm",
    "groovy": "groovy gradle", "fortran": "f f90 f95 f03", "assembly": "s asm", "vue": "vue",
    "protobuf": "proto", "graphql": "graphql gql", "tex": "tex sty bib", "makefile": "mk mak",
    "dockerfile": "dockerfile", "cmake": "cmake", "starlark": "bzl", "rst": "rst",
    "text": "txt text",
}
EXTENSIONS: dict[str, str] = {
    ext: lang for lang, exts in _EXTENSIONS.items() for ext in exts.split()
}

FILENAMES: dict[str, str] = {
    "Makefile": "makefile", "makefile": "makefile", "GNUmakefile": "makefile",
    "Dockerfile": "dockerfile", "Containerfile": "dockerfile",
    "CMakeLists.txt": "cmake",
    ".bashrc": "shell", ".bash_profile": "shell", ".profile": "shell", ".zshrc": "shell",
    "Gemfile": "ruby", "Rakefile": "ruby", "Jenkinsfile": "groovy",
    "BUILD": "starlark", "WORKSPACE": "starlark", "SConstruct": "python",
    "README": "text", "LICENSE": "text", "COPYING": "text", "AUTHORS": "text", "NOTICE": "text",
}
_PREFIXES = {"Dockerfile.": "dockerfile", "Makefile.": "makefile"}

# Interpreter names from a shebang, version digits removed (python3.11 -> python).
INTERPRETERS: dict[str, str] = {
    "python": "python", "pypy": "python", "sh": "shell", "bash": "shell", "zsh": "shell",
    "dash": "shell", "ksh": "shell", "fish": "shell",
    "node": "javascript", "nodejs": "javascript", "deno": "typescript", "ts-node": "typescript",
    "ruby": "ruby", "perl": "perl", "php": "php", "lua": "lua", "Rscript": "r",
    "runhaskell": "haskell", "make": "makefile", "pwsh": "powershell",
}

LANGUAGES: frozenset[str] = frozenset(
    [*_EXTENSIONS, *FILENAMES.values(), *_PREFIXES.values(), *INTERPRETERS.values()]
)

# Extensions whose content is never text: skipped as binary without being read.
BINARY_EXTENSIONS = frozenset(
    """pyc pyo pyd so dll dylib exe o obj a lib class jar war whl egg zip gz tgz bz2 xz zst lz4
    tar 7z rar png jpg jpeg gif bmp ico icns webp tif tiff psd pdf mp3 mp4 m4a wav ogg flac aac
    avi mov mkv webm ttf otf woff woff2 eot db sqlite sqlite3 bin pkl pickle npy npz pt pth
    ckpt safetensors onnx parquet arrow feather h5 hdf5 wasm der p12 pfx keystore""".split()
)


def _extension(name: str) -> str:
    return name.rsplit(".", 1)[1].lower() if "." in name.lstrip(".") else ""


def is_binary_name(path: str) -> bool:
    return _extension(posixpath.basename(path)) in BINARY_EXTENSIONS


def language_from_name(path: str) -> str | None:
    """The language of a file from its name alone, or None."""
    name = posixpath.basename(path)
    if name in FILENAMES:
        return FILENAMES[name]
    for prefix, lang in _PREFIXES.items():
        if name.startswith(prefix):
            return lang
    return EXTENSIONS.get(_extension(name))


def language_from_shebang(text: str) -> str | None:
    """The language named by a ``#!`` first line (``#!/usr/bin/env python3``), or None."""
    if not text.startswith("#!"):
        return None
    words = text[2:].split("\n", 1)[0].split()
    if words and posixpath.basename(words[0]) == "env":
        words = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
    if not words:
        return None
    interpreter = re.sub(r"[\d.]+$", "", posixpath.basename(words[0]))
    return INTERPRETERS.get(interpreter)


def detect_language(path: str, text: str | None = None) -> str | None:
    """Name first, then the shebang of ``text`` when the name says nothing."""
    lang = language_from_name(path)
    if lang is None and text is not None:
        lang = language_from_shebang(text)
    return lang
