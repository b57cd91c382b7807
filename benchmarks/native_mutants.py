"""The C mutants of benchmarks/mutate_native.py: which textual changes it makes to the native kernels' sources
(confkv/native/kernels.c and c/*.c, c/*.h) and where (never in comments, strings or preprocessor lines), and a
mutated copy of the sources to build."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

NATIVE = Path(__file__).resolve().parent.parent / "confkv" / "native"


@dataclass(frozen=True)
class Mutant:
    """One change: ``file`` (relative to confkv/native) with text[start:end] replaced by ``new``."""

    file: str
    line: int
    start: int
    end: int
    old: str
    new: str
    kind: str
    #: the mutated line as it reads unmutated (stripped): a verdict is kept only while the line reads the same
    line_text: str = ""

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}:{self.kind}:{self.start}"


def code_mask(text: str) -> list[bool]:
    """Per character of C source ``text``: True where it is code (not a comment, string, char literal or
    preprocessor line)."""
    mask = [True] * len(text)
    i, n = 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if line_start and text[i:].lstrip(" \t").startswith("#"):
            j = i
            while j < n:  # a preprocessor line, with its backslash continuations
                end = text.find("\n", j)
                end = n if end < 0 else end
                if end > 0 and text[end - 1] == "\\":
                    j = end + 1
                    continue
                j = end
                break
            for k in range(i, j):
                mask[k] = False
            i = j
            continue
        line_start = False
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            j += 1
        else:
            if c == "\n":
                line_start = True
            i += 1
            continue
        for k in range(i, min(j, n)):
            mask[k] = False
        i = j
    return mask


def _close_paren(text: str, open_at: int) -> int:
    """Index of the ``)`` matching the ``(`` at ``open_at``."""
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise ValueError("unbalanced parentheses")


def _split_args(inner: str) -> list[str]:
    """Top-level comma-separated arguments of a call's inside."""
    args, depth, start = [], 0, 0
    for i, c in enumerate(inner):
        depth += {"(": 1, ")": -1, "[": 1, "]": -1}.get(c, 0)
        if c == "," and depth == 0:
            args.append(inner[start:i].strip())
            start = i + 1
    args.append(inner[start:].strip())
    return args


_SIMPLE = r"[A-Za-z_]\w*(?:\[[^\[\]]*\])?"
_RULES: list[tuple[str, re.Pattern, object]] = [
    # (kind, pattern, replacement: a dict old -> new for the whole match, or a function of the match)
    ("arith", re.compile(r"(?<=[\w)\]]) ([-+*/]) (?=[\w(])"), {"+": " - ", "-": " + ", "*": " / ", "/": " * "}),
    ("compare", re.compile(r" (<=|>=|<|>|==|!=) "), {"<": " <= ", "<=": " < ", ">": " >= ", ">=": " > ",
                                                        "==": " != ", "!=": " == "}),
    ("logic", re.compile(r" (&&|\|\|) "), {"&&": " || ", "||": " && "}),
    ("swap", re.compile(rf"(?<![\w.>*/])({_SIMPLE}) ([-/]) ({_SIMPLE})(?![\w\[(.])"),
     lambda m: f"{m.group(3)} {m.group(2)} {m.group(1)}"),
    ("bound", re.compile(r"(for \([^;]*; \w+ <=? )([^;]+)(;)"), lambda m: f"{m.group(1)}({m.group(2)}) - 1{m.group(3)}"),
    ("start", re.compile(r"(for \((?:const )?(?:int64_t|int) \w+ = )0(;)"), lambda m: f"{m.group(1)}1{m.group(2)}"),
]


def mutants(root: Path = NATIVE) -> list[Mutant]:
    """Every mutant of kernels.c and c/*.[ch], in file and position order, duplicates (same text) removed."""
    found: list[Mutant] = []
    files = [root / "kernels.c", *sorted((root / "c").glob("*.[ch]"))]
    for path in files:
        text = path.read_text()
        rel = str(path.relative_to(root))
        mask = code_mask(text)
        def add(start: int, end: int, new: str, kind: str) -> None:
            if all(mask[start:end]) and text[start:end] != new:
                line_start = text.rfind("\n", 0, start) + 1
                line_end = text.find("\n", start)
                line = text[line_start:len(text) if line_end < 0 else line_end].strip()
                found.append(Mutant(rel, text.count("\n", 0, start) + 1, start, end, text[start:end], new, kind, line))
        for kind, pattern, replace in _RULES:
            for m in pattern.finditer(text):
                new = replace[m.group(1)] if isinstance(replace, dict) else replace(m)
                add(m.start(), m.end(), new, kind)
        for name in ("round_to", "fmaf"):  # dropped roundings
            for m in re.finditer(rf"\b{name}\(", text):
                if not mask[m.start()] or text[m.start() - 7:m.start()].endswith("float "):  # not the definition
                    continue
                close = _close_paren(text, m.end() - 1)
                args = _split_args(text[m.end():close])
                if name == "round_to" and len(args) == 2:
                    add(m.start(), close + 1, f"({args[0]})", "no-round")
                elif name == "fmaf" and len(args) == 3:
                    add(m.start(), close + 1, f"(({args[0]}) * ({args[1]}) + ({args[2]}))", "split-fma")
    unique, seen = [], set()
    for mutant in found:
        key = (mutant.file, mutant.start, mutant.end, mutant.new)
        if key not in seen:
            seen.add(key)
            unique.append(mutant)
    return unique


def apply(mutant: Mutant, source: Path, target: Path) -> None:
    """A copy of the sources at ``source`` in ``target`` with ``mutant`` applied."""
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    shutil.copy(source / "kernels.c", target / "kernels.c")
    shutil.copytree(source / "c", target / "c")
    path = target / mutant.file
    text = path.read_text()
    assert text[mutant.start:mutant.end] == mutant.old, mutant
    path.write_text(text[:mutant.start] + mutant.new + text[mutant.end:])
