"""The `edit` workload: seeded prompts whose passage is real local text the answer should repeat."""
from __future__ import annotations

import itertools

import pytest

from pdserve.bench.edit_workload import REPO
from pdserve.bench.loadtest import workload_endpoint
from pdserve.bench.sse_client import EndpointConfig
from pdserve.bench.workloads import WorkloadSpec, build_workload


def take(spec: WorkloadSpec, n: int):
    return list(itertools.islice(build_workload(spec), n))


def test_prompts_quote_local_files_and_are_seeded():
    spec = WorkloadSpec(name="edit", seed=3, random_input_len=200, random_output_len=150)
    first, again, other = take(spec, 6), take(spec, 6), take(WorkloadSpec(name="edit", seed=4), 6)
    assert first == again and first != other
    sources = "\n".join(p.read_text() for p in sorted(REPO.glob("engine/**/*.py")) + sorted(REPO.glob("*/*.py")))
    for request in first:
        instruction, passage = request.prompt.split("\n\n", 1)
        assert instruction.endswith(":") and passage.strip()
        assert passage in sources                                  # consecutive lines of a file, verbatim
        assert 100 <= len(passage) <= 200 * 4 or "\n" not in passage
        assert request.output_len == 150


def test_edit_instructions_go_to_the_chat_endpoint():
    endpoint = EndpointConfig("http://localhost:8000", "m", endpoint="completions")
    assert workload_endpoint(endpoint, WorkloadSpec(name="edit")).endpoint == "chat"
    assert workload_endpoint(endpoint, WorkloadSpec(name="random")).endpoint == "completions"


def test_a_given_folder_is_used_and_an_empty_one_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("alpha beta gamma\n" * 50)
    [request] = take(WorkloadSpec(name="edit", dataset_path=str(tmp_path), random_input_len=20), 1)
    assert "alpha beta gamma" in request.prompt
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no text files"):
        take(WorkloadSpec(name="edit", dataset_path=str(tmp_path / "empty")), 1)


def test_a_quote_prompt_asks_for_a_prose_passage_of_the_file_verbatim():
    import random

    from pdserve.bench.edit_workload import DEFAULT_QUOTE_FILE, INSTRUCTIONS, quote_prompt

    prompt = quote_prompt(random.Random(0), 300, str(DEFAULT_QUOTE_FILE))
    assert prompt == quote_prompt(random.Random(0), 300, str(DEFAULT_QUOTE_FILE))
    instruction, passage = prompt.split("\n\n", 1)
    assert instruction == INSTRUCTIONS[0] and passage in DEFAULT_QUOTE_FILE.read_text()
    assert 300 * 2 <= len(passage) <= 300 * 4 + 200
