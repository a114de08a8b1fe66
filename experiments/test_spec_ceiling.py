"""experiments/spec_ceiling.py's replay: verify steps an ungated n-gram proposer needs for a known output."""
from spec_ceiling import replay


def test_an_output_that_copies_its_prompt_takes_one_step_per_k_plus_one_tokens():
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 5, 6]
    output = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]              # the prompt's continuation of its last bigram
    assert replay(prompt, output, k=4, n_min=2, n_max=2) == (2, 8)     # 5 tokens a step: 4 drafts + 1


def test_an_output_with_nothing_to_look_up_takes_one_step_per_token():
    assert replay([1, 2, 3], [4, 5, 6, 7], k=4, n_min=2, n_max=2) == (4, 0)


def test_a_wrong_draft_keeps_only_its_matching_head():
    prompt = [1, 2, 3, 4, 9, 1, 2]
    output = [3, 4, 7, 7]                                        # drafts 3, 4, 9: two kept and 7 in one step
    steps, accepted = replay(prompt, output, k=3, n_min=2, n_max=2)
    assert accepted == 2 and steps == 2                          # then the last 7: nothing to look up
