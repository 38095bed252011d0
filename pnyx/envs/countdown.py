"""`countdown`: reach a target from given numbers with + - * / and parentheses, each number at most once.

A task: `Using the numbers 3, 7, 25, 50, make 75. Use + - * / and each number at most once.` after the
system prompt, which asks for `<answer>expression</answer>`. The verifier parses the expression with a
small recursive-descent parser and evaluates it exactly with `Fraction` (never `eval`), then checks every
number used is one of the given ones, each given number used at most once. `num_numbers` may be a list of
sizes to mix; a task's level (`meta["level"]`) is its size. `answer="lenient"` reads the last
arithmetic expression of a completion that has no answer tag (part `lenient` = 1, `format` 0).

Knows nothing about models. Invariants: every generated problem is solvable (the target is built from a
random expression over the numbers, kept as `answer["solution"]`); the parser is bounded (expression
length, token count, nesting depth, number size), so no input can make it slow or recurse deeply.
"""

from __future__ import annotations

import re
from collections import Counter
from fractions import Fraction

from pnyx.envs.base import (
    AnswerMode,
    Environment,
    Score,
    Split,
    Task,
    check_answer_mode,
    check_fraction,
    check_split,
    parse_procedural_id,
    seeded_rng,
    split_of,
    zero,
)
from pnyx.envs.parsing import Answer, last_answer
from pnyx.errors import ConfigError

MAX_EXPR_CHARS = 200
MAX_TOKENS = 64
MAX_DEPTH = 16
MAX_NUMBER_DIGITS = 6
_MAX_ATTEMPTS = 100_000
_OPS = "+-*/"
_ALIASES = str.maketrans({"×": "*", "x": "*", "÷": "/", "−": "-", "[": "(", "]": ")"})
SYSTEM_PROMPT = (
    "Combine the given numbers with + - * / and parentheses to make the target. Give only the expression "
    "in answer tags, e.g. <answer>(50-25)*3</answer>."
)
# A run of characters an expression is written with (no letters), for lenient reading; linear to scan.
_EXPR_RUN = re.compile(r"[0-9+\-*/×÷−()\[\]= ]+")
_EXPR_OPS = set("+-*/×÷−")


def last_expression(text: str) -> str | None:
    """The last run of expression characters in `text` that holds an operator and two numbers, else None
    (lenient reading of an untagged completion: `so 50 - 25 = 25, then 25 * 3 = 75.` gives `25 * 3 = 75`)."""
    found = None
    for m in _EXPR_RUN.finditer(text):
        run = m.group().strip()
        if any(c in _EXPR_OPS for c in run) and len(re.findall(r"\d+", run[: MAX_EXPR_CHARS + 1])) >= 2:
            found = run
    return found


class ExprError(ValueError):
    """The expression is not valid countdown arithmetic; `reason` says why (a Score reason code)."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


def tokenize(expr: str) -> list[str]:
    tokens: list[str] = []
    i = 0
    while i < len(expr):
        c = expr[i]
        if c.isspace():
            i += 1
        elif c in _OPS or c in "()":
            tokens.append(c)
            i += 1
        elif c.isascii() and c.isdigit():
            j = i
            while j < len(expr) and expr[j].isascii() and expr[j].isdigit():
                j += 1
            if j - i > MAX_NUMBER_DIGITS:
                raise ExprError("number_too_long")
            tokens.append(expr[i:j])
            i = j
        else:
            raise ExprError("bad_character")
        if len(tokens) > MAX_TOKENS:
            raise ExprError("expression_too_long")
    return tokens


class _Parser:
    """expr := term (('+'|'-') term)* ; term := atom (('*'|'/') atom)* ; atom := NUMBER | '(' expr ')'."""

    def __init__(self, tokens: list[str]):
        self.tokens = tokens
        self.pos = 0
        self.numbers: list[int] = []

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise ExprError("unexpected_end")
        self.pos += 1
        return tok

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self, depth: int) -> Fraction:
        value = self.atom(depth)
        while self.peek() in ("*", "/"):
            op = self.take()
            rhs = self.atom(depth)
            if op == "*":
                value = value * rhs
            elif rhs == 0:
                raise ExprError("division_by_zero")
            else:
                value = value / rhs
        return value

    def atom(self, depth: int) -> Fraction:
        tok = self.take()
        if tok == "(":
            if depth >= MAX_DEPTH:
                raise ExprError("nesting_too_deep")
            value = self.expr(depth + 1)
            if self.take() != ")":
                raise ExprError("unbalanced_parentheses")
            return value
        if tok.isdigit():
            self.numbers.append(int(tok))
            return Fraction(int(tok))
        raise ExprError("unexpected_token")


def evaluate(expr: str) -> tuple[Fraction, list[int]]:
    """The exact value of a countdown expression and the numbers it uses; raises `ExprError`."""
    if len(expr) > MAX_EXPR_CHARS:
        raise ExprError("expression_too_long")
    # "(50+25) = 75" is a common way to write an answer: judge the left-hand side.
    expr = expr.translate(_ALIASES).split("=", 1)[0]
    tokens = tokenize(expr)
    if not tokens:
        raise ExprError("empty_expression")
    parser = _Parser(tokens)
    value = parser.expr(0)
    if parser.pos != len(tokens):
        raise ExprError("trailing_tokens")
    return value, parser.numbers


class CountdownEnv(Environment):
    """Reach the target from the given numbers with + - * / (each number at most once)."""

    name = "countdown"
    system_prompt = SYSTEM_PROMPT
    max_new_tokens = 256
    stop_strings = ["</answer>"]

    def __init__(
        self,
        num_numbers: int | list[int] = 4,
        max_number: int = 50,
        max_target: int = 500,
        test_fraction: float = 0.1,
        answer: AnswerMode = "tag",
    ):
        sizes = [num_numbers] if isinstance(num_numbers, int) else list(num_numbers)
        if not sizes or any(not isinstance(k, int) or not 2 <= k <= 6 for k in sizes):
            raise ConfigError(
                f"countdown num_numbers must be integers in 2..6 (or a list of them), got {num_numbers!r}"
            )
        if not 2 <= max_number <= 1000 or not 10 <= max_target <= 100_000:
            raise ConfigError("countdown max_number must be in 2..1000 and max_target in 10..100000")
        self.sizes: list[int] = sizes
        self.answer = check_answer_mode(answer, self.name)
        if self.answer == "lenient":
            self.part_names = (*self.part_names, "lenient")
        self.max_number = max_number
        self.max_target = max_target
        self.test_fraction = check_fraction(test_fraction)

    def _solution(self, rng, numbers: list[int]) -> tuple[str, int] | None:
        """A random expression over a random subset (>= 2) of `numbers` with a positive integer value."""
        k = rng.randint(2, len(numbers))
        items: list[tuple[str, Fraction]] = [(str(v), Fraction(v)) for v in rng.sample(numbers, k)]
        while len(items) > 1:
            (ea, a), (eb, b) = items.pop(rng.randrange(len(items))), items.pop(rng.randrange(len(items)))
            op = rng.choice(_OPS)
            if op == "-" and a < b:
                (ea, a), (eb, b) = (eb, b), (ea, a)
            if op == "/" and (b == 0 or (a / b).denominator != 1):
                op = "+"
            value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else a}[op]
            items.append((f"({ea}{op}{eb})", value))
        expr, value = items[0]
        if value.denominator != 1 or not 1 <= value <= self.max_target:
            return None
        return expr[1:-1], int(value)

    def _make(self, split: Split, seed: int, index: int) -> Task:
        for attempt in range(_MAX_ATTEMPTS):
            rng = seeded_rng(self.name, split, seed, index, attempt)
            # One size draws nothing extra, so a fixed-size stream is the same as before sizes could mix.
            size = self.sizes[0] if len(self.sizes) == 1 else rng.choice(self.sizes)
            numbers = [rng.randint(1, self.max_number) for _ in range(size)]
            found = self._solution(rng, numbers)
            if found is None:
                continue
            solution, target = found
            canonical = f"{sorted(numbers)}->{target}"
            if split_of(canonical, self.test_fraction, salt=self.name) != split:
                continue
            shown = ", ".join(map(str, numbers))
            return Task(
                id=f"{self.name}/{split}/{seed}/{index}",
                prompt=self.chat(
                    f"Using the numbers {shown}, make {target}. Use + - * / and each number at most once."
                ),
                answer={"numbers": numbers, "target": target, "solution": solution},
                meta={"problem": canonical, "level": size},
            )
        raise ConfigError("countdown could not draw a problem; relax max_number/max_target")

    def sample(self, split: Split, seed: int, n: int, start: int = 0) -> list[Task]:
        check_split(split)
        return [self._make(split, seed, i) for i in range(start, start + n)]

    def task(self, task_id: str) -> Task:
        return self._make(*parse_procedural_id(task_id, self.name))

    def grade(self, task: Task, text: str) -> Score:
        ans = last_answer(text, max_len=MAX_EXPR_CHARS)
        extra = {"lenient": 0.0} if self.answer == "lenient" else {}
        if ans.text is None and ans.count == 0 and self.answer == "lenient":
            expr = last_expression(text)
            if expr is not None:
                ans, extra = Answer(text=expr, count=0, well_formed=False), {"lenient": 1.0}
        if ans.text is None:
            return zero(ans.missing_reason, correct=0, format=0, **extra)
        try:
            value, used = evaluate(ans.text)
        except ExprError as e:
            return zero(e.reason, correct=0, format=0, **extra)
        fmt = float(ans.count == 1 and ans.well_formed)
        available = Counter(task.answer["numbers"])
        for number, times in Counter(used).items():
            if number not in available:
                return zero("number_not_available", correct=0, format=fmt, **extra)
            if times > available[number]:
                return zero("number_reused", correct=0, format=fmt, **extra)
        correct = float(value == task.answer["target"])
        return Score(
            reward=correct,
            parts={"correct": correct, "format": fmt, **extra},
            reason=None if correct else "wrong_value",
        )

    def reference_completion(self, task: Task) -> str:
        return f"<answer>{task.answer['solution']}</answer>"
