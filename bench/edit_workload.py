"""The `edit` workload: output that overlaps its input, as in code edits and quoting answers.

Each prompt hands the model a passage of about `random_input_len` tokens (consecutive lines of a
local text file: this repository's own sources by default, or the files under `--dataset-path`)
and asks it to repeat it, or to repeat it with one light edit (a rename, a comment, a changed
number), the kind of request where n-gram and suffix drafts pay off.
"""
from __future__ import annotations

import random
import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_QUOTE_FILE = REPO / "docs" / "architecture.md"     # prose, as a RAG answer quotes its source
SOURCE_GLOBS = ("engine/**/*.py", "server/**/*.py", "bench/*.py", "kernels/*.py")
TEXT_SUFFIXES = (".py", ".md", ".txt", ".rst", ".c", ".cpp", ".h", ".js", ".ts", ".rs", ".go", ".java", ".json")
CHARS_PER_TOKEN = 4          # what bench.workloads.approx_tokens assumes
INSTRUCTIONS = (
    "Repeat the following text exactly, with no commentary:",
    "Rewrite the following text, replacing every occurrence of `{word}` with `{new}`; change nothing else:",
    "Copy the following code and add a short comment above its first line; keep everything else as is:",
    "Reproduce the following passage, changing only the first number in it to {number}:",
)


def source_files(dataset_path: str | None) -> list[Path]:
    """The text files passages come from, in a fixed order; raises ValueError when there are none."""
    if dataset_path is None:
        files = sorted({p for pattern in SOURCE_GLOBS for p in REPO.glob(pattern)})
    else:
        root = Path(dataset_path)
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix in TEXT_SUFFIXES)
    files = [p for p in files if p.is_file() and p.stat().st_size > 0]
    if not files:
        raise ValueError(f"the edit workload found no text files under {dataset_path or REPO}")
    return files


def passage(rng: random.Random, lines: list[str], num_tokens: int) -> str:
    """Consecutive lines from a seeded start, about `num_tokens` tokens in all (at least one line; the whole
    file when it is shorter)."""
    budget, remaining, last_start = num_tokens * CHARS_PER_TOKEN, 0, 0
    for index in range(len(lines) - 1, -1, -1):                  # the last start that still fills the budget
        remaining += len(lines[index]) + 1
        if remaining >= budget:
            last_start = index
            break
    start = rng.randint(0, last_start)
    taken, size = [], 0
    for line in lines[start:]:
        if taken and size + len(line) > num_tokens * CHARS_PER_TOKEN:
            break
        taken.append(line)
        size += len(line) + 1
    return "\n".join(taken)


def instruction(rng: random.Random, text: str) -> str:
    words = re.findall(r"[A-Za-z_][A-Za-z0-9_]{3,}", text)
    template = rng.choice(INSTRUCTIONS if words else INSTRUCTIONS[:1])
    word = rng.choice(words) if words else ""
    return template.format(word=word, new=f"{word}_v2", number=rng.randint(2, 99))


def quote_prompt(rng: random.Random, num_tokens: int, path: str) -> str:
    """One prompt asking for a passage of about `num_tokens` tokens of the text file `path` repeated exactly."""
    lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines() or [""]
    return f"{INSTRUCTIONS[0]}\n\n{passage(rng, lines, num_tokens)}"


def edit_prompts(rng: random.Random, num_tokens: int, dataset_path: str | None) -> Iterator[str]:
    """An endless, seeded stream of edit prompts (instruction, blank line, passage)."""
    if num_tokens < 1:
        raise ValueError("the edit workload needs --random-input-len >= 1")
    files = source_files(dataset_path)
    texts: dict[Path, list[str]] = {}
    while True:
        path = rng.choice(files)
        lines = texts.setdefault(path, path.read_text(encoding="utf-8", errors="replace").splitlines()) or [""]
        text = passage(rng, lines, num_tokens)
        yield f"{instruction(rng, text)}\n\n{text}"
