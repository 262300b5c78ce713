"""MkDocs hook: the REST API page from the service's own OpenAPI document.

The document is built from `service.main.create_app()` without starting it (no database, no
scheduler: those start in the app's lifespan), so the page lists what the running service
serves. `openapi.json` is added to the site beside the page, and the page's
`<!-- openapi -->` marker becomes one section per operation.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from mkdocs.structure.files import File

MARKER = "<!-- openapi -->"
SCHEMA_FILE = "openapi.json"
METHODS = ("get", "post", "put", "patch", "delete")


@cache
def openapi() -> dict[str, Any]:
    from service.main import create_app

    return create_app().openapi()


def on_files(files, config):
    files.append(File.generated(config, SCHEMA_FILE, content=json.dumps(openapi(), indent=2)))
    return files


def on_page_markdown(markdown, page, config, files):
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render(openapi()))


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _schema_name(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        return f"`{schema['$ref'].rsplit('/', 1)[-1]}`"
    if "anyOf" in schema:
        return " or ".join(_schema_name(option) for option in schema["anyOf"])
    if schema.get("type") == "array":
        return f"list of {_schema_name(schema.get('items', {}))}"
    return f"`{schema.get('type', 'object')}`"


def render(document: dict[str, Any]) -> str:
    lines = [f"Version {document['info']['version']} of *{document['info']['title']}*: "
             f"{document['info'].get('description', '')}", ""]
    for path, operations in document["paths"].items():
        for method in METHODS:
            operation = operations.get(method)
            if operation is None:
                continue
            secured = operation.get("security", document.get("security")) != []
            lines += [f"## `{method.upper()} {path}`", "",
                      operation.get("summary", ""), ""]
            if operation.get("description"):
                lines += [operation["description"].strip(), ""]
            lines += ["Needs a bearer token." if secured else "Public: no token needed.", ""]
            parameters = operation.get("parameters", [])
            if parameters:
                lines += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
                lines += [f"| `{p['name']}` | {p['in']} | {_schema_name(p.get('schema', {}))} | "
                          f"{'yes' if p.get('required') else 'no'} | {_cell(p.get('description', ''))} |"
                          for p in parameters]
                lines.append("")
            body = operation.get("requestBody")
            if body:
                kinds = ", ".join(f"`{kind}` ({_schema_name(spec.get('schema', {}))})"
                                  for kind, spec in body.get("content", {}).items())
                lines += [f"Body: {kinds}.", ""]
            lines += ["| answer | meaning |", "|---|---|"]
            lines += [f"| {code} | {_cell(answer.get('description', ''))} |"
                      for code, answer in sorted(operation.get("responses", {}).items())]
            lines.append("")
    return "\n".join(lines)
