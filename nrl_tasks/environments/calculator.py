"""Built-in tool environment: a calculator the policy calls in the Hermes/Qwen tool-call format.

The task is multi-digit arithmetic a small model cannot do in its head (``data.dataset:
calculator``: ``"What is 4821*317?"`` with the tool's description). On each turn the policy
either calls the tool::

    <tool_call>{"name": "calculator", "arguments": {"expression": "4821*317"}}</tool_call>

and gets a ``tool`` message with the result (``1528257``, or an error the policy can read), or
answers: a turn without a tool call ends the episode with reward 1 when the first integer in it
equals the answer, else 0. The turn stops at ``</tool_call>`` (the environment's stop string).

Expressions are integers, ``+ - * // %``, parentheses and unary minus, evaluated by walking
Python's AST (never ``eval``), with operands and results bounded by ``10**30``.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from typing import Any

import torch

from nrl_tasks.environments.arithmetic import extract_first_integer
from nrl_tasks.environments.interfaces import EnvironmentInterface, EnvironmentReturn, MessageLog

__all__ = ["CalculatorEnvironment", "evaluate_expression", "make_calculator_prompts", "parse_tool_call"]

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
STOP = "</tool_call>"
LIMIT = 10**30
INSTRUCTIONS = (
    "You can use a calculator. To call it, write "
    '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call> '
    "and wait for its result. Then reply with the final answer as a number."
)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod}


def evaluate_expression(text: str) -> int:
    """The value of an integer expression (see the module docstring); ``ValueError`` otherwise.

    >>> evaluate_expression("4821*317")
    1528257
    >>> evaluate_expression("(2+3)*-4")
    -20
    """
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {text!r}") from exc

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            out = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            out = -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
                raise ValueError("division by zero")
            out = _OPS[type(node.op)](left, right)
        else:
            raise ValueError(f"only integers, + - * // % and parentheses are allowed: {text!r}")
        if abs(out) > LIMIT:
            raise ValueError("number too large")
        return out

    return value(tree.body)


def parse_tool_call(text: str) -> dict[str, Any] | None:
    """The first ``<tool_call>`` of an assistant turn as ``{"name", "arguments"}``; ``None``
    without one; ``{"error": ...}`` when it is not a JSON object with a name."""
    m = TOOL_CALL.search(text)
    if m is None:
        return None if "<tool_call>" not in text else {"error": "unterminated <tool_call>"}
    try:
        call = json.loads(m.group(1))
    except json.JSONDecodeError as exc:
        return {"error": f"the tool call is not JSON ({exc.msg})"}
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return {"error": 'the tool call needs {"name": ..., "arguments": {...}}'}
    args = call.get("arguments")
    return {"name": call["name"], "arguments": args if isinstance(args, dict) else {}}


class CalculatorEnvironment(EnvironmentInterface):
    """The calculator tool (see the module docstring); ``metadata["answer"]`` is the expected answer."""

    stop_strings = [STOP]

    def step(self, message_logs: list[MessageLog], metadata: list[dict[str, Any] | None]) -> EnvironmentReturn:
        observations, rewards, done, answers, metas = [], [], [], [], []
        for log, meta in zip(message_logs, metadata):
            meta = dict(meta or {})
            text = log[-1]["content"] if log and log[-1]["role"] == "assistant" else ""
            call = parse_tool_call(text)
            if call is None:  # the final answer
                got = extract_first_integer(text)
                rewards.append(1.0 if got is not None and str(got) == str(meta.get("answer", "")).strip() else 0.0)
                done.append(True)
                answers.append(None if got is None else str(got))
                observations.append({"role": "environment", "content": ""})
            else:
                meta["tool_calls"] = int(meta.get("tool_calls", 0)) + 1
                rewards.append(0.0)
                done.append(False)
                answers.append(None)
                observations.append({"role": "tool", "content": self._call(call)})
            metas.append(meta)
        return EnvironmentReturn(
            observations, metas, [[STOP] for _ in message_logs], torch.tensor(rewards, dtype=torch.float32),
            torch.tensor(done, dtype=torch.bool), answers,
        )

    @staticmethod
    def _call(call: dict[str, Any]) -> str:
        if "error" in call:
            return f"error: {call['error']}"
        if call["name"] != "calculator":
            return f"error: no tool named {call['name']!r} (the one tool is 'calculator')"
        expr = call["arguments"].get("expression")
        if not isinstance(expr, str):
            return 'error: the calculator needs {"expression": "..."}'
        try:
            return str(evaluate_expression(expr))
        except ValueError as exc:
            return f"error: {exc}"


def make_calculator_prompts(num: int, seed: int, *, max_operand: int = 9999, ops: tuple[str, ...] = ("*",)) -> list[dict[str, str]]:
    """``num`` problems ``{"prompt", "answer", "demonstration"}`` with operands up to
    ``max_operand`` (drawn by ``random.Random(seed)``), each prompt carrying the tool's
    instructions; ``demonstration``: the ideal episode (call the tool, read it, answer) as JSON
    messages, what a warm start (``warm_start.sft_steps``) trains on.

    >>> make_calculator_prompts(1, seed=0, max_operand=99)[0]["answer"]
    '5049'
    """
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        a, b, op = rng.randint(2, max_operand), rng.randint(2, max_operand), rng.choice(list(ops))
        expr = f"{a}{op}{b}"
        value = str(evaluate_expression(expr))
        call = json.dumps({"name": "calculator", "arguments": {"expression": expr}})
        demo = [{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"}, {"role": "tool", "content": value},
                {"role": "assistant", "content": value}]
        out.append({"prompt": f"{INSTRUCTIONS}\nWhat is {expr}?", "answer": value, "demonstration": json.dumps(demo)})
    return out
