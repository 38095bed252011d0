"""Rows and a tool shared by the classic and v1 test environments (no verifiers import)."""

from __future__ import annotations

import re


def arith_rows(n: int) -> list[dict[str, str]]:
    """`n` distinct problems `Compute a+(a+7).` with their answers."""
    return [{"question": f"Compute {a}+{a + 7}.", "answer": str(2 * a + 7)} for a in range(10, 10 + n)]


def calc(expression: str) -> str:
    """Evaluate an integer expression with + - * and parentheses."""
    if not re.fullmatch(r"[0-9+\-*() ]{1,64}", expression):
        raise ValueError("only integers, + - * and parentheses")
    return str(eval(expression))  # noqa: S307 - the pattern above admits integer arithmetic only
