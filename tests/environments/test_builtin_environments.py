"""The built-in environments: the calculator tool (Hermes tool calls) and the guessing game."""

from __future__ import annotations

import pytest

from nrl_tasks.environments.calculator import CalculatorEnvironment, evaluate_expression, parse_tool_call
from nrl_tasks.environments.guess_number import GuessNumberEnvironment
from nrl_tasks.environments.interfaces import check_environment_return


def _log(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": "What is 4821*317?"}, {"role": "assistant", "content": text}]


def test_calculator_answers_tool_calls_and_rewards_the_final_answer():
    env = CalculatorEnvironment()
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "4821*317"}}</tool_call>'
    out = check_environment_return(env.step(
        [_log(call), _log("The answer is 1528257."), _log("It is 1528258"), _log('<tool_call>{"name": "web"}</tool_call>'),
         _log("<tool_call>not json</tool_call>"), _log('<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(1)"}}</tool_call>')],
        [{"answer": "1528257"}] * 6), 6, "calculator")
    assert out.observations[0] == {"role": "tool", "content": "1528257"}
    assert out.terminateds.tolist() == [False, True, True, False, False, False]
    assert out.rewards.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert "no tool named 'web'" in out.observations[3]["content"]
    assert "not JSON" in out.observations[4]["content"]
    assert out.observations[5]["content"].startswith("error: only integers")
    assert out.metadata[0]["tool_calls"] == 1 and out.next_stop_strings[0] == ["</tool_call>"]


@pytest.mark.parametrize("expr", ["2**1000", "open('x')", "1/0", "10**40", "9//0"])
def test_calculator_refuses_what_is_not_bounded_integer_arithmetic(expr):
    with pytest.raises(ValueError):
        evaluate_expression(expr)


def test_tool_call_parsing():
    assert parse_tool_call("no call") is None
    assert parse_tool_call("<tool_call>{") == {"error": "unterminated <tool_call>"}
    assert parse_tool_call('<tool_call> {"name": "calculator", "arguments": {"expression": "1+1"}} </tool_call>')["name"] == "calculator"


def test_guessing_game_replies_and_rewards_fewer_turns():
    env = GuessNumberEnvironment(decay=0.5)
    meta = [{"answer": "7"}, {"answer": "7"}, {"answer": "7"}]
    out = env.step([_log("5"), _log("9 I think"), _log("seven")], meta)
    assert [o["content"] for o in out.observations] == ["Higher.", "Lower.", "Say one number."]
    assert out.terminateds.tolist() == [False] * 3
    out = env.step([_log("7")], [out.metadata[0]])  # right on the second guess
    assert out.terminateds.tolist() == [True] and out.rewards.tolist() == [0.5]
    with pytest.raises(ValueError, match="decay"):
        GuessNumberEnvironment(decay=2)


def test_a_calculator_demonstration_trains_the_assistant_turns_of_the_episode(tiny_model_dir):
    """The warm start's batch of a calculator record: its demonstration (tool call, result,
    answer) after the prompt, built like a sampled episode; only the assistant turns at mask 1."""
    import json

    from transformers import AutoTokenizer

    from flows.algorithms.sft import build_sft_batch
    from nrl_tasks.config.data import DataConfig
    from nrl_tasks.environments.calculator import make_calculator_prompts
    from tests.environments.test_multi_turn import mask_spans

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    recs = make_calculator_prompts(3, seed=1, max_operand=999)
    data = build_sft_batch(recs, tok, DataConfig(dataset="calculator", chat_template=True), max_len=512)
    for i, rec in enumerate(recs):
        demo = json.loads(rec["demonstration"])
        assert demo[1] == {"role": "tool", "content": rec["answer"]}  # the tool's true result
        assert parse_tool_call(demo[0]["content"])["arguments"]["expression"] in rec["prompt"]
        k = int(data["input_lengths"][i])
        ids, m = data["input_ids"][i, :k], data["token_mask"][i, :k].bool()
        spans = [tok.decode(s) for s in mask_spans(ids, m)]
        assert spans == [demo[0]["content"], rec["answer"] + tok.eos_token]  # the answer closes the episode
        assert f"<|im_start|>tool\n{rec['answer']}<|im_end|>\n<|im_start|>assistant\n" in tok.decode(ids[~m].tolist())


def test_a_demonstration_that_is_not_an_episode_is_refused(tiny_model_dir):
    from transformers import AutoTokenizer

    from nrl_tasks.stages.multi_turn import demonstration_tokens

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="end with the assistant's answer"):
        demonstration_tokens(tok, [1], '[{"role": "assistant", "content": "x"}, {"role": "tool", "content": "1"}]',
                             chat_template=True, eos_id=0)
    with pytest.raises(ValueError, match="list of"):
        demonstration_tokens(tok, [1], '{"role": "assistant"}', chat_template=True, eos_id=0)
