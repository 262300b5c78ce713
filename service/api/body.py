"""Request bodies in JSON or YAML, validated into schemas with 422s that name the field.

A YAML body is a ModelZoo params file posted as is, with the job's own options (num_csx, mode,
name, ...) as extra top-level keys; a JSON body may use that flat layout too, or put the
params under "params".
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import yaml
from fastapi import HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from service.preflight import Problem

JSON_TYPES = ("application/json",)
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")
Model = TypeVar("Model", bound=BaseModel)


def request_body_openapi(schema_name: str) -> dict[str, Any]:
    """`openapi_extra` for a route that parses its body itself."""
    ref = {"$ref": f"#/components/schemas/{schema_name}"}
    yaml_doc = {"type": "string", "description": f"{schema_name} as YAML; params may be flat"}
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": ref}, "application/yaml": {"schema": yaml_doc}}}}


def unprocessable(
    problems: list[Problem], *, prefix: tuple[str | int, ...] = ("body",)
) -> RequestValidationError:
    """A 422 in FastAPI's own error shape, one entry per problem, for the caller to raise."""
    return RequestValidationError(
        [{"loc": [*prefix, *loc], "msg": msg, "type": "value_error"} for loc, msg in problems]
    )


async def read_mapping(request: Request) -> dict[str, Any]:
    raw = await request.body()
    media_type = request.headers.get("content-type", "application/json").split(";")[0].strip()
    try:
        if media_type in JSON_TYPES:
            data = json.loads(raw)
        elif media_type in YAML_TYPES:
            data = yaml.safe_load(raw)
        else:
            raise HTTPException(
                status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
                f"Content-Type {media_type!r} is not supported; use application/json or "
                "application/yaml",
            )
    except (ValueError, yaml.YAMLError) as err:
        raise unprocessable([((), f"body is not valid {media_type}: {err}")]) from None
    if not isinstance(data, dict):
        raise unprocessable([((), f"body must be a mapping, got {type(data).__name__}")])
    return data


def nest_params(data: dict[str, Any], schema: type[BaseModel]) -> dict[str, Any]:
    """Flat layout → {"params": {...}, options...}: keys the schema knows stay at the top."""
    if "params" in data:
        return data
    options = {k: v for k, v in data.items() if k in schema.model_fields}
    return {**options, "params": {k: v for k, v in data.items() if k not in schema.model_fields}}


def validate(schema: type[Model], data: dict[str, Any]) -> Model:
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        # Only loc/msg/type: `input` may echo megabytes back, `ctx` may hold exceptions.
        problems = [(tuple(e["loc"]), e["msg"]) for e in err.errors(include_url=False)]
        raise unprocessable(problems) from None
