"""Chat templates: rendering as Hugging Face does, in a sandbox."""

from __future__ import annotations

import pytest

from hybridserve.chat_template import (
    ChatTemplateError,
    compile_chat_template,
    pick_template,
    render_chat,
)

MSGS = [{"role": "user", "content": "hi <b>&</b>"}]


def test_render_with_specials_and_generation_prompt(chat_template_text: str) -> None:
    t = compile_chat_template(chat_template_text)
    text = render_chat(t, MSGS, bos_token="<s>", eos_token="</s>")
    assert text == "<s><user>hi <b>&</b></s>\n<assistant>"
    assert (
        render_chat(t, MSGS, add_generation_prompt=False, bos_token="<s>", eos_token="</s>")
        == "<s><user>hi <b>&</b></s>\n"
    )


def test_raise_exception_becomes_template_error(chat_template_text: str) -> None:
    t = compile_chat_template(chat_template_text)
    with pytest.raises(ChatTemplateError, match="role tool is not supported"):
        render_chat(t, [{"role": "tool", "content": "x"}])


def test_tojson_keeps_text_as_is() -> None:
    t = compile_chat_template("{{ messages | tojson }}")
    assert render_chat(t, MSGS) == '[{"role": "user", "content": "hi <b>&</b>"}]'


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.append({'role': 'x'}) }}",
        "{{ messages[0].update({'role': 'x'}) }}",
    ],
)
def test_sandbox_refuses_internals_and_mutation(source: str) -> None:
    t = compile_chat_template(source)
    messages = [dict(m) for m in MSGS]
    with pytest.raises(ChatTemplateError):
        render_chat(t, messages)
    assert messages == MSGS


def test_compile_error_is_reported() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        compile_chat_template("{% for m in messages %}")


def test_pick_named_template() -> None:
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert pick_template(named) == "D"
    assert pick_template([{"name": "other", "template": "O"}]) == "O"
    assert pick_template("S") == "S" and pick_template(None) is None


@pytest.mark.parametrize(
    ("source", "kind"),
    [
        ("{% for i in range(10**9) %}x{% endfor %}", "OverflowError"),
        ("{{ 1 // 0 }}", "ZeroDivisionError"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ],
)
def test_any_template_failure_is_a_template_error(source: str, kind: str) -> None:
    with pytest.raises(ChatTemplateError, match=kind):
        render_chat(compile_chat_template(source), MSGS)


def test_output_cap() -> None:
    t = compile_chat_template("{% for i in range(1000) %}{{ 'abcd' }}{% endfor %}")
    assert len(render_chat(t, MSGS, max_chars=4000)) == 4000
    with pytest.raises(ChatTemplateError, match="passes 3999 characters"):
        render_chat(t, MSGS, max_chars=3999)


def test_tools_and_documents_are_always_defined() -> None:
    # As transformers passes them: None when the request has none, so a template's
    # "is not none" test and a loop over them behave as there.
    t = compile_chat_template("{{ tools is defined }}/{{ tools is none }}/{{ documents is none }}")
    assert render_chat(t, MSGS) == "True/True/True"
    assert render_chat(t, MSGS, tools=[{"type": "function"}]) == "True/False/True"
    loop = compile_chat_template("{% for t in tools %}{{ t }}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="TypeError"):
        render_chat(loop, MSGS)


def test_reasoning_is_under_every_name_templates_read() -> None:
    t = compile_chat_template("{% for m in messages %}[{{ m.reasoning_content }}|{{ m.thinking }}]{% endfor %}")
    msgs = [{"role": "assistant", "content": "4", "reasoning": "a"},
            {"role": "assistant", "content": "4", "reasoning_content": "b"},
            {"role": "assistant", "content": "4", "reasoning_content": "c", "thinking": "own"},
            {"role": "assistant", "content": "4"}]
    assert render_chat(t, msgs) == "[a|a][b|b][c|own][|]"
    assert "thinking" not in msgs[1]  # the caller's messages are not changed


def test_dict_and_namespace_globals() -> None:
    t = compile_chat_template("{% set d = dict(a=1) %}{% set ns = namespace(n=0) %}{% set ns.n = d.a + 1 %}{{ ns.n }}")
    assert render_chat(t, MSGS) == "2"
    for source in ("{% set ns = namespace(_x=1) %}", "{% set ns = namespace() %}{% set ns._x = 1 %}"):
        with pytest.raises(ChatTemplateError):
            render_chat(compile_chat_template(source), MSGS)


def test_continue_final_message_cuts_at_its_end() -> None:
    t = compile_chat_template("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</s>{% endfor %}")
    msgs = [{"role": "user", "content": "Say: go on"}, {"role": "assistant", "content": "go on "}]
    # The user's text holds the same words: the cut is where the last message ends.
    assert render_chat(t, msgs, add_generation_prompt=False, continue_final_message=True) == (
        "<user>Say: go on</s><assistant>go on")
    dropped = compile_chat_template("{% for m in messages %}{{ m.role }}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="verbatim"):
        render_chat(dropped, msgs, add_generation_prompt=False, continue_final_message=True)
