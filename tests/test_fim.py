"""The FIM template table: every family renders, parses back, re-renders in another, and is found from a tokenizer."""

import pytest

from tasks.core.fim import (
    CODEGEMMA,
    CODELLAMA,
    CODESTRAL,
    DEEPSEEK,
    PREFIX_ONLY,
    QWEN,
    STARCODER,
    TEMPLATES,
    FimFormatError,
    FimPrompt,
    get_template,
    infer_template,
    parse_any,
    parse_completion,
    read_template,
    save_template,
    template_for_model_name,
)

FIM_FAMILIES = [t for t in TEMPLATES.values() if t.order != "prefix-only"]


def test_qwen_round_trip():
    prompt = QWEN.render("def f(x):\n    return ", "\n\nprint(f(2))\n")
    assert prompt == "<|fim_prefix|>def f(x):\n    return <|fim_suffix|>\n\nprint(f(2))\n<|fim_middle|>"
    fim = QWEN.parse(prompt)
    assert (fim.prefix, fim.suffix, fim.context) == ("def f(x):\n    return ", "\n\nprint(f(2))\n", "")


def test_the_formats_are_those_the_families_document():
    assert STARCODER.render("a", "b") == "<fim_prefix>a<fim_suffix>b<fim_middle>"
    assert DEEPSEEK.render("a", "b") == "<｜fim▁begin｜>a<｜fim▁hole｜>b<｜fim▁end｜>"
    assert CODELLAMA.render("a", "b") == "<PRE> a <SUF>b <MID>"
    assert CODESTRAL.render("a", "b") == "[SUFFIX]b[PREFIX]a"  # suffix first
    assert (
        CODEGEMMA.training_text("a", "b", "", eos="<eos>")
        == "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|><|file_separator|>"
    )
    assert PREFIX_ONLY.render("a", "b") == "a" and PREFIX_ONLY.training_text("a", "b", "c", eos="</s>") == "ac</s>"


@pytest.mark.parametrize("template", FIM_FAMILIES, ids=lambda t: t.name)
def test_every_family_parses_back_and_is_recognised(template):
    prompt = template.render("import os\nos.", "\n\nmain()\n")
    found, fim = parse_any(prompt)
    assert fim == FimPrompt("import os\nos.", "\n\nmain()\n")
    assert found.render(fim.prefix, fim.suffix) == prompt  # CodeGemma parses as Qwen: same markers, same parts


def test_repo_level_context_is_kept_and_translated_between_families():
    context = "<|repo_name|>acme\n<|file_sep|>util.py\ndef helper(): ...\n<|file_sep|>main.py\n"
    prompt = context + QWEN.render("import util\nutil.", "\n")
    source, fim = parse_any(prompt)
    assert source == QWEN and fim.context == context and QWEN.rerender(fim, QWEN) == prompt
    assert STARCODER.rerender(fim, QWEN) == (
        "<repo_name>acme\n<file_sep>util.py\ndef helper(): ...\n<file_sep>main.py\n"
        "<fim_prefix>import util\nutil.<fim_suffix>\n<fim_middle>"
    )
    assert DEEPSEEK.rerender(fim, QWEN) == DEEPSEEK.render("import util\nutil.", "\n")  # no repo markers: dropped
    assert PREFIX_ONLY.rerender(fim, None) == context + "import util\nutil."


@pytest.mark.parametrize(
    "bad, why",
    [
        ("plain text", "no FIM template tabrl knows"),
        ("<|fim_prefix|>a<|fim_middle|>", "no <|fim_suffix|>"),
        ("<|fim_prefix|>a<|fim_suffix|>b", "no <|fim_middle|>"),
        ("<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>c", "must end"),
        ("[SUFFIX]b", r"no \[PREFIX\] after \[SUFFIX\]"),
    ],
)
def test_malformed_prompts_name_the_problem(bad, why):
    with pytest.raises(FimFormatError, match=why.replace("|", r"\|")):
        parse_any(bad)


def test_templates_are_found_from_special_tokens_and_model_names():
    assert infer_template({"<|endoftext|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"}) == QWEN
    assert infer_template({"<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_separator|>"}) == CODEGEMMA
    assert infer_template({"<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<|endoftext|>"}) == STARCODER
    assert infer_template({"<|endoftext|>", "<|im_start|>", "<file_sep>"}) == PREFIX_ONLY  # SmolLM2: no FIM
    assert template_for_model_name("Qwen/Qwen2.5-Coder-1.5B") == QWEN
    assert template_for_model_name("bigcode/starcoder2-3b") == STARCODER
    assert template_for_model_name("codestral-latest") == CODESTRAL
    assert template_for_model_name("llama3") is None
    with pytest.raises(FimFormatError, match="known: qwen2.5-coder"):
        get_template("gpt")


def test_a_template_travels_with_a_checkpoint(tmp_path):
    assert read_template(tmp_path) is None
    save_template(tmp_path, DEEPSEEK)
    assert read_template(tmp_path) == DEEPSEEK
    (tmp_path / "fim_template.json").write_text("{}")
    with pytest.raises(FimFormatError, match="not a FIM template"):
        read_template(tmp_path)


def test_completion_stops_and_abstains():
    assert parse_completion("x + 1<|endoftext|>junk", QWEN.stops) == "x + 1"
    assert parse_completion("foo()<|file_sep|>bar", QWEN.stops) == "foo()"
    assert parse_completion("<|endoftext|>", QWEN.stops) == ""
    assert parse_completion("  \n<|endoftext|>", QWEN.stops) == ""  # whitespace only: nothing worth showing
    assert parse_completion("f.read()\n    return", PREFIX_ONLY.stops) == "f.read()"
    assert (
        QWEN.training_text("a", "c", "b", eos="<|endoftext|>")
        == "<|fim_prefix|>a<|fim_suffix|>c<|fim_middle|>b<|endoftext|>"
    )
