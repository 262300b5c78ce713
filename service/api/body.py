"""Request bodies in JSON or YAML, validated into schemas with 422s that name the field.

A YAML body is a ModelZoo params file posted as is, with the job's own options (num_csx, mode,
name, ...) as extra top-level keys; a JSON body may use that flat layout too, or put the
params under "params".
"""

from __future__ import annotations

import json
import time
from typing import Any, TypeVar

import anyio
import yaml
from fastapi import HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from csx_config.spec import YAML_LOADER
from service.preflight import Problem

JSON_TYPES = ("application/json",)
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")
Model = TypeVar("Model", bound=BaseModel)
# A params file nests about 8 levels (body, params, sparsity, groups, a group, a schedule, ...)
# and holds a few hundred values; a study a few thousand.
MAX_DEPTH = 32
MAX_NODES = 20_000
MAX_PARSE_S = 2.0
PARSE_THREADS = {"small": 8, "large": 2}
SMALL_BODY_BYTES = 256 * 1024  # a params file is a few kB
NUL_MESSAGE = "must not contain NUL (\\x00) characters"
MAX_INT = 2**63 - 1  # a 64-bit signed integer: what every backend stores


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
    """The body as a mapping, parsed in a worker thread (at most PARSE_THREADS at once, so
    hostile uploads cannot take every thread or the event loop from other requests)."""
    raw = await request.body()
    media_type = request.headers.get("content-type", "application/json").split(";")[0].strip()
    if media_type not in JSON_TYPES + YAML_TYPES:
        raise HTTPException(
            status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
            f"Content-Type {media_type!r} is not supported; use application/json or "
            "application/yaml",
        )
    # Large bodies queue for their own threads: a few hostile 10 MB uploads cannot hold up
    # the params files everyone else sends.
    parsers = request.app.state.body_parsers
    limiter = parsers["small"] if len(raw) <= SMALL_BODY_BYTES else parsers["large"]
    return await anyio.to_thread.run_sync(parse_mapping, raw, media_type, limiter=limiter)


def parse_mapping(raw: bytes, media_type: str) -> dict[str, Any]:
    """Parse and measure a body with bounded work: a YAML stream is first read as events and
    refused as soon as it nests deeper than MAX_DEPTH, holds more than MAX_NODES values or
    takes longer than MAX_PARSE_S (pure-Python YAML construction of 10 MB took minutes)."""
    try:
        if media_type in JSON_TYPES:
            data = json.loads(raw)
        else:
            problem = yaml_events_problem(raw, time.monotonic() + MAX_PARSE_S)
            if problem is not None:
                raise unprocessable([((), problem)])
            data = yaml.load(raw, Loader=YAML_LOADER)  # noqa: S506 (a safe loader)
    except RecursionError:
        raise unprocessable([((), f"body nests deeper than {MAX_DEPTH} levels")]) from None
    except yaml.YAMLError as err:
        if "maximum nesting depth" in str(err):  # libyaml's own limit, met while scanning ahead
            raise unprocessable([((), f"body nests deeper than {MAX_DEPTH} levels")]) from None
        raise unprocessable([((), f"body is not valid {media_type}: {str(err)[:500]}")]) from None
    except ValueError as err:
        raise unprocessable([((), f"body is not valid {media_type}: {str(err)[:500]}")]) from None
    if not isinstance(data, dict):
        raise unprocessable([((), f"body must be a mapping, got {type(data).__name__}")])
    problem = shape_problem(data)
    if problem is not None:
        raise unprocessable([problem])
    return data


def yaml_events_problem(raw: bytes, deadline: float) -> str | None:
    """Why a YAML stream is refused before anything is built from it, or None."""
    depth = values = 0
    for index, event in enumerate(yaml.parse(raw, Loader=YAML_LOADER)):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                return f"body nests deeper than {MAX_DEPTH} levels"
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
        values += isinstance(event, yaml.NodeEvent)
        if values > MAX_NODES:
            return f"body holds more than {MAX_NODES} values"
        if index % 1024 == 0 and time.monotonic() > deadline:
            return f"body took more than {MAX_PARSE_S:g} s to read"
    return None


def shape_problem(data: Any) -> Problem | None:
    """Why a parsed body is refused before any validator walks it, or None: nesting deeper than
    MAX_DEPTH (validators and serialisers recurse), more than MAX_NODES values once YAML
    aliases are expanded (a few lines of anchors can stand for billions), a YAML alias that
    contains itself, an integer beyond 64 bits (no field takes one; converting it to a float
    overflows), or a NUL character in a key or string (PostgreSQL cannot store one in text).
    One pass without recursion; a node shared through aliases is measured once."""
    # id of a finished container -> (values in it once expanded, levels below and with it)
    measured: dict[int, tuple[int, int]] = {}
    open_ids: set[int] = set()  # containers on the current path: met again means a cycle
    stack: list[tuple[Any, tuple[str | int, ...], bool]] = [(data, (), False)]
    while stack:
        node, loc, finished = stack.pop()
        depth = len(loc) + 1
        if isinstance(node, int) and not -MAX_INT <= node <= MAX_INT:
            return loc, f"integer out of range (at most {MAX_INT} in magnitude)"
        if isinstance(node, str) and "\x00" in node:
            return loc, NUL_MESSAGE
        if not isinstance(node, dict | list):
            continue
        if finished:
            children = [measured.get(id(c), (1, 0)) for c in
                        (node.values() if isinstance(node, dict) else node)]
            size = 1 + sum(size for size, _ in children)
            measured[id(node)] = size, 1 + max((height for _, height in children), default=0)
            if size > MAX_NODES:
                return (), f"body holds more than {MAX_NODES} values"
            open_ids.discard(id(node))
            continue
        if id(node) in open_ids:
            return (), "body contains itself (a recursive YAML alias)"
        height = measured[id(node)][1] if id(node) in measured else 1
        if depth - 1 + height > MAX_DEPTH:
            return (), f"body nests deeper than {MAX_DEPTH} levels"
        if id(node) in measured:
            continue
        open_ids.add(id(node))
        stack.append((node, loc, True))
        if isinstance(node, dict) and any(isinstance(k, str) and "\x00" in k for k in node):
            return loc, f"a key {NUL_MESSAGE}"
        items = node.items() if isinstance(node, dict) else enumerate(node)
        stack.extend((child, (*loc, str(key)[:100] if isinstance(node, dict) else key), False)
                     for key, child in items)
    return None


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
    except (ArithmeticError, RecursionError) as err:
        # A validator that does arithmetic on an absurd value: the value's fault, not a 500.
        raise unprocessable([((), f"a value is out of range: {str(err)[:200]}")]) from None
