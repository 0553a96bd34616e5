"""The string forms' one tokenizer (labkit.grammar) and the one reader of a field's value
(labkit.settings.fields.parse): tokens, quoting, splitting, and one error format that names the field,
the text and the column, for every grammar that uses them."""

from typing import Literal

import pytest

from labkit import grammar, lab
from labkit.formulas import policy_losses
from labkit.problems import reward_expr
from labkit.run import stops, trackers
from labkit.settings.config import TrainConfig
from labkit.settings.fields import FALSE, TRUE, parse, parse_field

# --- the tokenizer ---------------------------------------------------------------------------


def test_tokens_cut_names_numbers_strings_and_operators_with_their_places():
    text = " noisy(p=5e-4) + 'a,b;c' >= pkg.mod:fn"
    got = [(t.kind, t.text, t.start, t.end) for t in grammar.tokens(text, "f")]
    assert got == [("name", "noisy", 1, 6), ("op", "(", 6, 7), ("name", "p", 7, 8),
                   ("op", "=", 8, 9), ("number", "5e-4", 9, 13), ("op", ")", 13, 14),
                   ("op", "+", 15, 16), ("string", "'a,b;c'", 17, 24), ("op", ">=", 25, 27),
                   ("name", "pkg.mod", 28, 35), ("op", ":", 35, 36), ("name", "fn", 36, 38),
                   ("end", "", 38, 38)]
    # every token is the text it was cut from
    assert all(text[t.start:t.end] == t.text for t in grammar.tokens(text, "f"))


def test_a_quoted_string_is_one_token_and_its_value_loses_the_quotes():
    (tok, _end) = grammar.tokens('"x, y; (z)"', "f")
    assert tok.kind == "string" and tok.value == "x, y; (z)"
    assert grammar.source('"x, y"', grammar.tokens('"x, y"', "f")[:1]) == "x, y"


@pytest.mark.parametrize("text, column, words", [
    ("a $ b", 3, "unexpected '$'"),
    ("a 'open", 3, "the quote ' is not closed"),
    ('x="y', 3, 'the quote " is not closed'),
])
def test_a_character_no_token_is_made_of_is_named_with_its_column(text, column, words):
    with pytest.raises(grammar.GrammarError) as e:
        grammar.tokens(text, "field")
    assert str(e.value) == f"field={text!r}: {words} (column {column})"
    assert (e.value.field, e.value.text, e.value.pos) == ("field", text, column - 1)


def test_split_cuts_outside_parentheses_and_strings_only():
    text = "a(b, c), 'd, e', f"
    pieces = grammar.split(grammar.tokens(text, "f"), ",", "f", text)
    assert [grammar.source(text, p) for p in pieces] == ["a(b, c)", "d, e", "f"]
    assert grammar.items(" x ,, y ,", "f") == ["x", "y"]
    for bad, column, words in (("a(b", 2, "'(' is not closed"), ("a)b", 2, "')' closes no '('")):
        with pytest.raises(grammar.GrammarError) as e:
            grammar.split(grammar.tokens(bad, "f"), ",", "f", bad)
        assert str(e.value) == f"f={bad!r}: {words} (column {column})"


# --- every grammar reports the field, the text and the column --------------------------------

@pytest.mark.parametrize("read, field, text, column", [
    (reward_expr.parse, "reward", "correctness+*format", 13),
    (reward_expr.parse, "reward", "correctness+0.3*nope", 17),
    (reward_expr.parse, "reward", "noisy(strict, p=2)", 1),
    (policy_losses.parse_loss, "loss", "sapo(tau=2)", 6),
    (policy_losses.parse_loss, "loss", "sapo(tau_pos=1", 15),
    (stops.parse, "stop_rules", "adv/gav>0.4; policy/kl>0.5 for x", 32),
    (stops.parse, "stop_rules", "adv/gav>0.4; nope<1", 14),
    (trackers.parse, "report_to", "tensorboard, tensorbord", 14),
    (lab.parse_arms, "arms", "a: lr=1e-3; b lr=2", 13),
    (lab.parse_arms, "arms", "a: lr=1e-3, colour=red", 13),
])
def test_each_grammar_names_the_field_the_text_and_the_column(read, field, text, column):
    with pytest.raises(grammar.GrammarError) as e:
        read(text)
    message = str(e.value)
    assert message.startswith(f"{field}={text!r}: ") and "\n" not in message, message
    assert message.endswith(f"(column {column})"), message


def test_a_quoted_arm_value_may_hold_the_separators():
    arms = lab.parse_arms("a: lora_targets='q_proj,v_proj', reward=shaped(lam=0.3, x=1); "
                          'b: stop_rules="adv/gav>0.4; policy/kl>1 for 2", kl_kind=k3+')
    assert arms == {"a": {"lora_targets": "q_proj,v_proj", "reward": "shaped(lam=0.3, x=1)"},
                    "b": {"stop_rules": "adv/gav>0.4; policy/kl>1 for 2", "kl_kind": "k3+"}}
    with pytest.raises(grammar.GrammarError, match="lr is given twice"):
        lab.parse_arms("a: lr=1e-3, lr=2e-3")


def test_comma_lists_read_alike_in_trackers_lora_targets_and_lists():
    assert trackers.parse(" tensorboard , mlflow,") == ["tensorboard", "mlflow"]
    assert trackers.parse("none") == trackers.parse("") == []
    assert lab.parse_list("2, 4,8", int) == [2, 4, 8]
    with pytest.raises(ValueError, match="must be int, got 'x'"):
        lab.parse_list("2,x", int)
    with pytest.raises(ValueError, match="lora_targets must name at least one layer"):
        TrainConfig(lora_rank=4, lora_targets=" , ")


# --- the one reader of a field's value -------------------------------------------------------

@pytest.mark.parametrize("text", [*TRUE, *FALSE, "True", "YES", "Off"])
def test_a_boolean_has_the_same_spellings_everywhere(text):
    expected = text.lower() in TRUE
    assert parse(text, bool, "x") is expected
    assert parse_field(TrainConfig, "dynamic_sampling", text) is expected
    assert lab.parse_fields(f"dynamic_sampling={text}") == {"dynamic_sampling": expected}


def test_none_is_a_choice_where_the_choices_hold_it_none_where_optional_text_elsewhere():
    assert parse_field(TrainConfig, "estimator", "none") == "none"  # a registry's choice
    assert parse_field(TrainConfig, "scale", "None") == "none"  # a Literal's choice
    assert parse_field(TrainConfig, "dual_clip", "none") is None  # optional
    assert parse_field(TrainConfig, "report_to", "none") == "none"  # a string: its text
    assert parse("none", Literal["a", "b"] | None, "x") is None
    with pytest.raises(ValueError, match="steps must be int, got 'none'"):
        parse_field(TrainConfig, "steps", "none")


@pytest.mark.parametrize("hint, given, expected", [
    (int, " 7 ", 7), (int, "-3", -3), (float, "2", 2.0), (float, "5e-4", 5e-4),
    (str, " a ", " a "),
    (float, 3, 3.0), (int | None, None, None), (bool, True, True),
])
def test_text_and_typed_values_read_as_the_type(hint, given, expected):
    got = parse(given, hint, "x")
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("hint, given, words", [
    (int, "2.5", "x must be int, got '2.5'"), (int, "true", "must be int"),
    (float, "fast", "x must be float, got 'fast'"), (bool, "maybe", "x must be bool"),
    (int, True, "must be int, got True (bool)"), (str, 3, "must be str, got 3 (int)"),
    (float, None, "must be float, got None"),
])
def test_a_value_of_another_type_is_named(hint, given, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse(given, hint, "x")
