"""README.md's option tables and the argument parser of `pdserve serve` name the same options, one
short row each."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from pdserve.server.cli import COMMANDS

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
MAX_ROW = 250
OPTION = r"`(--?[a-z0-9][a-z0-9-]*)"          # --long, or vLLM's short -tp / -q


def table_rows(markdown: str) -> list[list[str]]:
    """Every Markdown table of `markdown` as its lines (header first, separator dropped)."""
    tables, current = [], []
    for line in markdown.splitlines() + [""]:
        if line.strip().startswith("|"):
            if not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line.strip()):
                current.append(line.strip())
        elif current:
            tables.append(current)
            current = []
    return tables


def option_rows(markdown: str) -> list[str]:
    """The rows of the tables whose first column is headed `option`."""
    return [row for table in table_rows(markdown) if _cells(table[0])[0] == "option" for row in table[1:]]


def options_in(rows: list[str]) -> set[str]:
    return {name for row in rows for name in re.findall(OPTION, _cells(row)[0])}


def serve_options() -> set[str]:
    parser = argparse.ArgumentParser(prog="pdserve serve")
    COMMANDS["serve"].add_arguments(parser)
    return {name for action in parser._actions for name in action.option_strings} - {"-h", "--help"}


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip("|").split("|")]


ROWS = option_rows(README)


def test_the_readme_has_the_engine_and_server_option_tables():
    assert len([t for t in table_rows(README) if _cells(t[0])[0] == "option"]) == 2
    assert {"--model", "--enable-prefix-caching", "--async-scheduling", "--host", "--log-level"} <= options_in(ROWS)


def test_every_serve_option_is_in_a_readme_table():
    assert serve_options() - options_in(ROWS) == set()


def test_every_option_in_a_readme_table_exists():
    assert options_in(ROWS) - serve_options() == set()


def test_every_option_has_one_row():
    names = [name for row in ROWS for name in re.findall(OPTION, _cells(row)[0])]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


@pytest.mark.parametrize("row", [row for table in table_rows(README) for row in table],
                         ids=lambda row: _cells(row)[0][:40])
def test_every_readme_table_row_is_short(row):
    assert len(row) < MAX_ROW, f"{len(row)} characters; the detail belongs in docs/"


def test_a_dropped_row_or_a_stray_option_is_caught():
    without_host = [row for row in ROWS if not row.startswith("| `--host`")]
    assert serve_options() - options_in(without_host) == {"--host"}
    assert options_in(ROWS + ["| `--no-such-option` | off | nothing |"]) - serve_options() == {"--no-such-option"}
