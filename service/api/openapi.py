"""The OpenAPI document as the service behaves: the generated schema, plus the bodies routes
parse themselves (JSON or YAML), the error answers FastAPI cannot see (401 from the bearer
dependency, 404 for ids that are missing or not the caller's, 413/415/422 from body parsing),
and the one public route (healthz) without the bearer requirement."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from service.schemas import JobCreate, StudyCreate

PUBLIC_PATHS = ("/v1/healthz",)
_MESSAGE = {"application/json": {"schema": {
    "type": "object", "required": ["detail"], "properties": {"detail": {"type": "string"}}}}}
_VALIDATION = {"application/json": {"schema": {"$ref": "#/components/schemas/HTTPValidationError"}}}
UNAUTHORIZED = {"description": "no bearer token, or an unknown one", "content": _MESSAGE}
NOT_FOUND = {"description": "no such resource, or not the caller's (the same answer)",
             "content": _MESSAGE}
BODY_ERRORS = {
    "413": {"description": "body over the size limit", "content": _MESSAGE},
    "415": {"description": "a Content-Type other than JSON or YAML", "content": _MESSAGE},
    "422": {"description": "the body, or a field of it, is refused", "content": _VALIDATION},
}


def build_openapi(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                         description=app.description)
    _, defs = models_json_schema([(JobCreate, "validation"), (StudyCreate, "validation")],
                                 ref_template="#/components/schemas/{model}")
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
    schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    schema["security"] = [{"bearer": []}]
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            if path in PUBLIC_PATHS:
                operation["security"] = []
            else:
                responses.setdefault("401", UNAUTHORIZED)
            if "{" in path:
                responses.setdefault("404", NOT_FOUND)
            if "requestBody" in operation:
                for code, answer in BODY_ERRORS.items():
                    responses.setdefault(code, answer)
    return schema
