"""The small languages of the string fields, read by one tokenizer with one way to quote.

    reward       correctness+0.3*format   shaped(lam=0.3)   noisy(strict, p=0.1)   pkg.mod:fn
    loss         sapo(tau_pos=1.0, tau_neg=1.05)
    stop_rules   rollout/truncated_frac>0.9 for 20; policy/kl>0.5
    report_to    tensorboard,mlflow   (or none)
    lora_targets q_proj,v_proj
    arms         rloo: estimator=rloo; lam03: reward=shaped(lam=0.3), lr=5e-4

`tokens` cuts a text into names (`correctness`, `pkg.mod`), numbers (`0.3`, `5e-4`), quoted
strings and operators; spaces only separate tokens. A value that holds a separator of the
text it sits in (',' ';' ':' '=' or a parenthesis), or a character no token is made of, is
quoted with ' or " (nothing is escaped inside): `a: lora_targets='q_proj,v_proj'`.

`split` cuts tokens at a separator outside parentheses, `source` gives back the text a run of
tokens was cut from, and `Cursor` walks tokens for the recursive-descent grammars (reward,
loss). Every error is a `GrammarError`, one line naming the field, the text and the column
(1-based) of the fault: `reward='correctness+*format': expected a reward, got '*' (column
13)`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r"""\s*(?:
    (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)
  | (?P<name>[A-Za-z_][\w.]*)
  | (?P<string>"[^"]*"|'[^']*')
  | (?P<op>>=|<=|[-+*/(),;:=<>@~])
)""", re.X)


class GrammarError(ValueError):
    """A text that breaks its field's grammar: `field`, `text`, the 0-based `pos` of the
    fault (None: the text as a whole) and `what` is wrong there."""

    def __init__(self, field: str, text: str, pos: int | None, what: str):
        self.field, self.text, self.pos, self.what = field, text, pos, what
        where = "" if pos is None else f" (column {pos + 1})"
        super().__init__(f"{field}={text!r}: {what}{where}")


@dataclass(frozen=True)
class Token:
    """One token: `kind` is number, name, string, op or end; `start` and `end` index the
    text it was cut from."""

    kind: str
    text: str
    start: int
    end: int

    @property
    def value(self) -> str:
        """The token's text, a string's without its quotes."""
        return self.text[1:-1] if self.kind == "string" else self.text

    def shown(self) -> str:
        """The token as an error shows it: quoted, or `the end`."""
        return "the end" if self.kind == "end" else repr(self.text)

    def is_op(self, *ops: str) -> bool:
        return self.kind == "op" and self.text in ops


def tokens(text: str, field: str) -> list[Token]:
    """The tokens of `text`, then an `end` token; GrammarError at a character no token is
    made of, or at a quote that is not closed."""
    out, pos = [], 0
    while text[pos:].strip():
        m = _TOKEN.match(text, pos)
        if m is None:
            at = len(text) - len(text[pos:].lstrip())
            if text[at] in "'\"":
                raise GrammarError(field, text, at, f"the quote {text[at]} is not closed")
            raise GrammarError(field, text, at, f"unexpected {text[at]!r}")
        kind = m.lastgroup
        out.append(Token(kind, m.group(kind), m.start(kind), m.end(kind)))
        pos = m.end()
    return out + [Token("end", "", len(text), len(text))]


def split(toks: list[Token], sep: str, field: str, text: str) -> list[list[Token]]:
    """`toks` (the end token dropped) cut at the operator `sep` outside parentheses; the
    pieces may be empty. GrammarError at a parenthesis without its partner."""
    pieces, piece, opened = [], [], []
    for tok in toks:
        if tok.kind == "end":
            break
        if tok.is_op("("):
            opened.append(tok)
        elif tok.is_op(")"):
            if not opened:
                raise GrammarError(field, text, tok.start, "')' closes no '('")
            opened.pop()
        if tok.is_op(sep) and not opened:
            pieces.append(piece)
            piece = []
        else:
            piece.append(tok)
    if opened:
        raise GrammarError(field, text, opened[-1].start, "'(' is not closed")
    return pieces + [piece]


def source(text: str, toks: list[Token]) -> str:
    """The text `toks` were cut from, spaces inside kept; a lone string's value unquoted;
    '' for none."""
    if not toks:
        return ""
    if len(toks) == 1:
        return toks[0].value
    return text[toks[0].start:toks[-1].end]


def items(text: str, field: str) -> list[str]:
    """A comma-separated list, `tensorboard, mlflow` -> ['tensorboard', 'mlflow']: each item
    the text between commas (a quoted one unquoted), empty items dropped."""
    return [source(text, piece) for piece in split(tokens(text, field), ",", field, text)
            if piece]


class Cursor:
    """Tokens walked one at a time, for a recursive-descent grammar; `form` (e.g. "NAME or
    NAME(OPTION=NUMBER, ...)") ends the message of a token out of place."""

    def __init__(self, text: str, field: str, form: str = ""):
        self.text, self.field, self.form = text, field, form
        self.toks, self.i = tokens(text, field), 0

    def peek(self, ahead: int = 0) -> Token:
        return self.toks[min(self.i + ahead, len(self.toks) - 1)]

    def next(self) -> Token:
        tok = self.peek()
        self.i += tok.kind != "end"
        return tok

    def error(self, what: str, tok: Token | None = None) -> GrammarError:
        """A GrammarError at `tok` (default: the next token)."""
        return GrammarError(self.field, self.text, (tok or self.peek()).start, what)

    def expect(self, kind_or_op: str, what: str) -> Token:
        """The next token, which must be of the kind (number, name, string, end) or the
        operator `kind_or_op`."""
        tok = self.peek()
        if tok.kind != kind_or_op and not tok.is_op(kind_or_op):
            form = f"; {self.field} is {self.form}" if self.form else ""
            raise self.error(f"expected {what}, got {tok.shown()}{form}")
        return self.next()

    def take(self, op: str) -> bool:
        """Step over the operator `op` if it comes next."""
        if self.peek().is_op(op):
            self.next()
            return True
        return False

    def path(self, what: str) -> Token:
        """A name, or an import path `package.module:function` written without spaces, as
        one name token."""
        first = self.expect("name", what)
        colon, attr = self.peek(), self.peek(1)
        if colon.is_op(":") and colon.start == first.end and attr.kind == "name" \
                and attr.start == colon.end:
            self.i += 2
            return Token("name", self.text[first.start:attr.end], first.start, attr.end)
        return first

    def number(self, what: str) -> float:
        """A number with an optional sign (inf and nan read as float does)."""
        start = self.peek()
        sign = -1.0 if self.take("-") else 1.0
        if sign > 0:
            self.take("+")
        tok = self.peek()
        try:
            value = float(tok.text) if tok.kind in ("number", "name") else None
        except ValueError:
            value = None
        if value is None:
            raise self.error(f"{what} must be a number, got {tok.shown()}", start)
        self.next()
        return sign * value


__all__ = ["GrammarError", "Token", "tokens", "split", "source", "items", "Cursor"]
