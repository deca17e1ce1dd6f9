"""Chat messages for a job: built-in tasks and custom prompt templates.

Tasks
-----
``summarize``  summarise the document (default).
``answer``     answer ``question`` from the document (``question`` required).
``extract``    reply with one JSON object: the ``fields`` named (a list of field
               names) or matching ``fields`` given as schema text; without ``fields``,
               the document's key facts.
``custom``     ``prompt`` is a :class:`string.Template`: ``$document`` / ``${document}``
               (required) and optionally ``$question``, ``$fields``, ``$id``, ``$name``;
               ``$$`` is a literal ``$``. Braces are left alone, so JSON examples need
               no escaping. Nothing in a template can run code or read attributes.

The document always goes into the user message; for built-in tasks it comes first,
inside ``<document>`` tags, and the instruction follows it (instructions after a
long context are followed more reliably).
"""

from __future__ import annotations

import string
from dataclasses import dataclass

TASKS = ("summarize", "answer", "extract", "custom")
TEMPLATE_VARIABLES = ("document", "question", "fields", "id", "name")
SYSTEM_PROMPT = (
    "You are a careful assistant. You read the document you are given and answer "
    "only from what it says."
)
SUMMARIZE_INSTRUCTION = (
    "Summarize the document above. Cover its main points in the order they appear, "
    "in a few short paragraphs."
)
ANSWER_INSTRUCTION = (
    "Answer the question below using only the document above. If the document does "
    "not contain the answer, say so.\n\nQuestion: {question}"
)
EXTRACT_FIELDS_INSTRUCTION = (
    "Extract the following fields from the document above: {fields}. Reply with one "
    "JSON object whose keys are exactly these field names; use null for a field the "
    "document does not give. Reply with the JSON object only."
)
EXTRACT_SCHEMA_INSTRUCTION = (
    "Extract information from the document above as one JSON object matching this "
    "schema:\n{fields}\nReply with the JSON object only."
)
EXTRACT_DEFAULT_INSTRUCTION = (
    "Extract the key facts of the document above (names, dates, numbers, decisions) as "
    "one JSON object. Reply with the JSON object only."
)


@dataclass(frozen=True)
class TaskSpec:
    """What to ask about a document.

    fields: field names (tuple) or schema text (str) for ``extract``.
    prompt: the template of a ``custom`` task.
    """

    task: str = "summarize"
    prompt: str | None = None
    question: str | None = None
    fields: tuple[str, ...] | str | None = None

    def problems(self) -> list[tuple[str, str]]:
        """Inconsistencies as ``(field, message)`` pairs; empty when the spec is usable."""
        if self.task not in TASKS:
            return [("task", f"must be one of {', '.join(TASKS)}, got {self.task!r}")]
        found = []
        if self.task == "answer" and not self.question:
            found.append(("question", "is required for task 'answer'"))
        if self.task == "custom" and not self.prompt:
            found.append(("prompt", "is required for task 'custom' (a template with ${document})"))
        if self.prompt is not None and self.task != "custom":
            found.append(("prompt", f"is only used with task 'custom', not {self.task!r}"))
        if self.question is not None and self.task not in ("answer", "custom"):
            found.append(
                ("question", f"is only used with tasks 'answer' and 'custom', not {self.task!r}")
            )
        if self.fields is not None and self.task not in ("extract", "custom"):
            found.append(
                ("fields", f"is only used with tasks 'extract' and 'custom', not {self.task!r}")
            )
        if self.task == "custom" and self.prompt and string.Template(self.prompt).is_valid():
            used = string.Template(self.prompt).get_identifiers()
            for name, value in (("question", self.question), ("fields", self.fields)):
                if name in used and not value:  # it would be replaced by nothing
                    found.append((name, f"is required: the custom prompt uses ${name}"))
        return found

    def to_dict(self) -> dict:
        """JSON-ready form (used in the resume key)."""
        fields = list(self.fields) if isinstance(self.fields, tuple) else self.fields
        return {
            "task": self.task,
            "prompt": self.prompt,
            "question": self.question,
            "fields": fields,
        }


def template_problem(template: str) -> str | None:
    """Why ``template`` is not a usable custom prompt, or ``None``.

    Checks :class:`string.Template` syntax, that ``$document`` is used, and that only
    :data:`TEMPLATE_VARIABLES` are referenced.
    """
    parsed = string.Template(template)
    if not parsed.is_valid():
        return "is not a valid template: a '$' must start $name or ${name} (write $$ for '$')"
    names = parsed.get_identifiers()
    found = []  # every problem at once, so one fix-and-retry covers them
    unknown = sorted(set(names) - set(TEMPLATE_VARIABLES))
    if unknown:
        allowed = ", ".join(f"${n}" for n in TEMPLATE_VARIABLES)
        found.append(
            f"uses unknown variable(s) {', '.join('$' + n for n in unknown)}; allowed: {allowed}"
        )
    if "document" not in names:
        hint = " (write ${document}, not {document})" if "{document}" in template else ""
        found.append(f"must contain ${{document}}{hint}")
    return "; and ".join(found) or None


def build_messages(spec: TaskSpec, document: str, job_id: str = "", name: str = "") -> list[dict]:
    """Chat messages for one job.

    Parameters
    ----------
    spec
        The task (assumed to have no :meth:`TaskSpec.problems`).
    document
        The document text.
    job_id, name
        Values for ``$id`` and ``$name`` in custom templates (name: input file name).

    Returns
    -------
    list of dict
        ``[{"role": "system", ...}, {"role": "user", "content": ...}]``.
    """
    if spec.task == "custom":
        user = render_template(spec, document, job_id, name)
    else:
        user = f"<document>\n{document}\n</document>\n\n{instruction(spec)}"
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def instruction(spec: TaskSpec) -> str:
    """The instruction text of a built-in task."""
    if spec.task == "answer":
        return ANSWER_INSTRUCTION.format(question=spec.question)
    if spec.task == "extract":
        if isinstance(spec.fields, tuple):
            return EXTRACT_FIELDS_INSTRUCTION.format(fields=", ".join(spec.fields))
        if spec.fields:
            return EXTRACT_SCHEMA_INSTRUCTION.format(fields=spec.fields)
        return EXTRACT_DEFAULT_INSTRUCTION
    return SUMMARIZE_INSTRUCTION


def render_template(spec: TaskSpec, document: str, job_id: str = "", name: str = "") -> str:
    """Substitute a custom template (``string.Template.substitute``; no code runs)."""
    fields = ", ".join(spec.fields) if isinstance(spec.fields, tuple) else spec.fields or ""
    values = {"document": document, "question": spec.question or "", "fields": fields}
    return string.Template(spec.prompt or "").substitute(values, id=job_id, name=name)
