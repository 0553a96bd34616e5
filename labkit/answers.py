"""Answer extraction: find the final answer a completion commits to. Pure string functions.

Nothing here judges whether an answer is right (that is
`labkit.problems.rewards.correctness`); these functions only locate the answer text, in the
formats math models and GSM8K actually use, and read completions as text (`completion_text`,
`is_worked`).
"""

from __future__ import annotations

import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")

# "#### 18" (GSM8K's answer field), content up to the end of its line
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
# "the answer is $1,000." -> "$1,000"; the answer runs to the end of the sentence (a period
# followed by whitespace or the end) or the line, so decimals such as 0.5 stay whole
_ANSWER_IS = re.compile(r"the\s+(?:final\s+)?answer\s+is\s*:?[ \t]*(.+?)\s*(?:\.(?=\s|$)|\n|$)",
                        re.IGNORECASE)
# a line "A: 18" or "Answer: 18" ("answer" in any case, a bare "A" only in capitals)
_ANSWER_LINE = re.compile(r"^[ \t*]*(?:A|[Aa]nswer|ANSWER)[ \t*]*:[ \t*]*(.*?)[ \t]*$",
                          re.MULTILINE)


def _braced(text: str, start: int) -> str | None:
    """Content of the `{...}` group opening at `text[start]`, by brace counting.

    A backslash escapes the next character, so `\\{` and `\\}` do not count. None when the
    group never closes.
    """
    depth, i = 0, start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
        i += 1
    return None


def last_box_span(text: str) -> tuple[str, int] | None:
    """(content, end index) of the last `\\boxed`/`\\fbox`; None if absent or unbalanced."""
    starts = []
    for command in _BOX_COMMANDS:
        # the command must end there: `\boxed{`, `\boxed 5`, never `\boxedfoo`
        for m in re.finditer(re.escape(command) + r"(?![A-Za-z])", text):
            starts.append(m.end())
    if not starts:
        return None
    i = max(starts)
    while i < len(text) and text[i] in " \t":
        i += 1
    if i < len(text) and text[i] == "{":
        content = _braced(text, i)
        if content is None:
            return None
        return content, i + len(content) + 2
    # the space form `\boxed 5`: one token, up to whitespace or a closing `$`
    m = re.match(r"[^\s${}]+", text[i:])
    if m is None:  # `\boxed` alone, or before `$`, has no answer
        return None
    return m.group(0), i + m.end()


def last_boxed(text: str) -> str | None:
    r"""Content of the last `\boxed{...}` or `\fbox{...}` in `text`, else None.

    Nested braces are matched by counting (`\boxed{\frac{1}{2}}` gives `\frac{1}{2}`); the
    brace-less form `\boxed 5` gives `5`. The LAST box wins; if that one never closes the
    result is None (an earlier, closed box is not used instead: the model's final word is
    the one that counts, and a truncated one is no answer).
    """
    if not isinstance(text, str):
        return None
    span = last_box_span(text)
    return None if span is None else span[0]


def extract_answer(text: str) -> str | None:
    """The final answer a completion gives, as raw text stripped of surrounding whitespace.

    Tried in order, the first that yields a non-empty answer wins:
      1. the last `\\boxed{...}` / `\\fbox{...}` (`last_boxed`);
      2. the last `#### N` (GSM8K's ground-truth format);
      3. the last "the answer is N" (any case; the sentence's final period is dropped);
      4. the last line of the form `A: N` or `Answer: N`.
    An empty box or an empty line after a marker counts as no answer there. Returns None
    when nothing is found, or when `text` is not a string. No normalisation is done here
    (`$`, commas and units are left for the grader).
    """
    if not isinstance(text, str):
        return None
    candidates = (
        lambda: last_boxed(text),
        lambda: _last_group(_HASHES, text),
        lambda: _last_group(_ANSWER_IS, text),
        lambda: _last_group(_ANSWER_LINE, text),
    )
    for find in candidates:
        found = find()
        if found is not None and found.strip():
            return found.strip()
    return None


def _last_group(pattern: re.Pattern, text: str) -> str | None:
    """Group 1 of the match starting last; matches may overlap (unlike `findall`)."""
    last, pos = None, 0
    while (m := pattern.search(text, pos)) is not None:
        last, pos = m.group(1), m.start() + 1
    return last


def gsm8k_ground_truth(answer_field: str) -> str:
    """The final number of a GSM8K answer field: the text after its last `####`, commas removed.

    `"...\\n#### 1,000"` gives `"1000"`. Raises ValueError (naming `answer_field`) when the
    field is not a string or has no `####` with something after it.
    """
    if not isinstance(answer_field, str):
        raise ValueError(f"answer_field must be a GSM8K answer string ending in '#### N', "
                         f"got {type(answer_field).__name__}")
    found = _last_group(_HASHES, answer_field)
    value = None if found is None else found.strip().replace(",", "")
    if not value:
        raise ValueError(f"answer_field has no '#### N' final answer: {answer_field[-80:]!r}")
    return value


def completion_text(completion) -> str | None:
    """The text of one completion: a string as is; for TRL's conversational form (a list of
    `{"role", "content"}` dicts) the content of the last assistant message, or of the last
    message when none is marked assistant. None for anything else."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, (list, tuple)) and completion:
        messages = [m for m in completion if isinstance(m, dict)]
        if not messages:
            return None
        assistant = [m for m in messages if m.get("role") == "assistant"]
        content = (assistant or messages)[-1].get("content")
        return content if isinstance(content, str) else None
    return None


def gsm8k_steps(answer_field: str) -> list[str]:
    """The intermediate results of a GSM8K solution: the `c` of each `<<a*b=c>>` annotation."""
    return [m.strip() for m in re.findall(r"<<[^<>]*=([^<>=]*)>>", answer_field)]


STEP = re.compile(r"\d\s*[-+*]\s*\d+\s*=")
"""One written step of a worked solution, like '12+5='."""


def written_steps(completion: str) -> int:
    """How many steps a completion writes before its first \\boxed (like '3+4=', `STEP`); 0
    for a direct answer."""
    return len(STEP.findall(completion.split("\\boxed", 1)[0]))


def is_worked(completion: str) -> bool:
    """Whether a completion works before it answers: a step like '3+4=' before its first
    \\boxed (anywhere, when it boxes nothing). A direct answer is the box alone."""
    return bool(STEP.search(completion.split("\\boxed", 1)[0]))
