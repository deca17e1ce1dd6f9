"""Chat messages for the built-in tasks and custom templates."""

from __future__ import annotations

from hisparse_cli.tasks import TaskSpec, build_messages, template_problem


def user(spec, document="DOC"):
    system, message = build_messages(spec, document, job_id="j1", name="file.txt")
    assert system["role"] == "system" and message["role"] == "user"
    return message["content"]


def test_summarize_puts_document_first_then_instruction():
    text = user(TaskSpec())
    assert text.startswith("<document>\nDOC\n</document>") and "Summarize" in text


def test_answer_carries_question():
    assert user(TaskSpec("answer", question="Who won?")).endswith("Question: Who won?")


def test_extract_fields_and_schema():
    assert "name, date" in user(TaskSpec("extract", fields=("name", "date")))
    schema = '{"type": "object"}'
    assert schema in user(TaskSpec("extract", fields=schema))
    assert "JSON" in user(TaskSpec("extract"))


def test_custom_template_substitutes_without_touching_braces():
    spec = TaskSpec("custom", prompt='Return {"title": ...} for $name ($id): ${document} $$5')
    assert user(spec) == 'Return {"title": ...} for file.txt (j1): DOC $5'


def test_template_problems():
    assert template_problem("Summarize ${document}") is None
    assert "${document}" in template_problem("Summarize {document}")
    assert "$secret" in template_problem("$secret ${document}")
    assert "valid template" in template_problem("cost $ 5 ${document}")


def test_task_problems():
    assert TaskSpec("answer").problems() == [("question", "is required for task 'answer'")]
    assert [
        f for f, _ in TaskSpec("summarize", prompt="x", question="q", fields="f").problems()
    ] == ["prompt", "question", "fields"]
    assert TaskSpec("custom", prompt="${document}", question="q", fields=("a",)).problems() == []
