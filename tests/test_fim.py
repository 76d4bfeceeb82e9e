import pytest

from tasks.fim import EOS, FimFormatError, build_prompt, parse_completion, parse_prompt, training_text


def test_round_trip():
    prompt = build_prompt("def f(x):\n    return ", "\n\nprint(f(2))\n")
    assert prompt == "<|fim_prefix|>def f(x):\n    return <|fim_suffix|>\n\nprint(f(2))\n<|fim_middle|>"
    fim = parse_prompt(prompt)
    assert (fim.prefix, fim.suffix, fim.context) == ("def f(x):\n    return ", "\n\nprint(f(2))\n", "")


def test_continue_repo_level_prompt_parses():
    context = "<|repo_name|>acme\n<|file_sep|>util.py\ndef helper(): ...\n<|file_sep|>main.py\n"
    prompt = context + build_prompt("import util\nutil.", "\n")
    fim = parse_prompt(prompt)
    assert fim.prefix == "import util\nutil." and fim.suffix == "\n" and fim.context == context
    assert build_prompt(fim.prefix, fim.suffix, fim.context) == prompt


@pytest.mark.parametrize(
    "bad, why",
    [
        ("plain text", "no <|fim_prefix|>"),
        ("<|fim_prefix|>a<|fim_middle|>", "no <|fim_suffix|>"),
        ("<|fim_prefix|>a<|fim_suffix|>b", "no <|fim_middle|>"),
        ("<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>c", "must end"),
    ],
)
def test_malformed_prompts_name_the_problem(bad, why):
    with pytest.raises(FimFormatError, match=why.replace("|", r"\|")):
        parse_prompt(bad)


def test_completion_stops_and_abstains():
    assert parse_completion("x + 1" + EOS + "junk") == "x + 1"
    assert parse_completion("foo()<|file_sep|>bar") == "foo()"
    assert parse_completion(EOS) == ""
    assert parse_completion("  \n" + EOS) == ""  # whitespace only: nothing worth showing
    assert training_text("a", "c", "b") == "<|fim_prefix|>a<|fim_suffix|>c<|fim_middle|>b<|endoftext|>"
