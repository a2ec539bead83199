"""Corrections to the generated OpenAPI document, so it describes what the API really sends.

Litestar renders a union holding both `int` and `float` (a known fact's value,
`bool | int | float | str`) as `oneOf [..., integer, number, ...]`; in JSON Schema every integer is
also a number, so an integer matches two branches and `oneOf` fails for every integer a response
carries. For the msgspec Structs with such a field, this plugin writes the union without `int`
(`number` accepts integers): exactly one branch matches any value.
"""

from __future__ import annotations

import functools
import json
import operator
import types
import typing
from typing import Any, Literal

import msgspec
from litestar import Litestar
from litestar._openapi.plugin import OpenAPIPlugin
from litestar._openapi.schema_generation import SchemaCreator
from litestar.openapi.spec import Reference, Schema
from litestar.plugins import OpenAPISchemaPlugin
from litestar.typing import FieldDefinition


def _declared(annotation: Any) -> Any:
    """A field's type; a generic Struct's unparameterized field, its type variable's bound."""
    return annotation.__bound__ if isinstance(annotation, typing.TypeVar) else annotation


def _overlapping(annotation: Any) -> bool:
    annotation = _declared(annotation)
    if typing.get_origin(annotation) not in (types.UnionType, typing.Union):
        return False
    members = typing.get_args(annotation)
    return int in members and float in members


def _without_int(annotation: Any) -> Any:
    annotation = _declared(annotation)
    if not _overlapping(annotation):
        return annotation
    return functools.reduce(operator.or_, [m for m in typing.get_args(annotation) if m is not int])


@functools.cache
def _needs_correction(value: Any) -> bool:
    if not (isinstance(value, type) and issubclass(value, msgspec.Struct)):
        return False
    return any(_overlapping(f.type) for f in msgspec.structs.fields(value))


class IntegerIsANumber(OpenAPISchemaPlugin):
    @staticmethod
    def is_plugin_supported_type(value: Any) -> bool:
        return _needs_correction(value)

    def to_openapi_schema(  # type: ignore[override]
        self, field_definition: FieldDefinition, schema_creator: SchemaCreator
    ) -> Schema | Reference:
        struct = field_definition.annotation
        fields = msgspec.structs.fields(struct)
        properties = {f.encode_name: FieldDefinition.from_annotation(_without_int(f.type)) for f in fields}
        required = [f.encode_name for f in fields if f.required]
        config = struct.__struct_config__
        if config.tag_field is not None:  # a tagged union member: its tag is a constant
            properties[config.tag_field] = FieldDefinition.from_annotation(Literal[config.tag])
            required.append(config.tag_field)
        return schema_creator.create_component_schema(
            field_definition, required=sorted(required), property_fields=properties
        )


# --- the document as served: readable names, the report's body, the problems each route answers ---

OPERATION_TAGS = {
    "/api/v1/hardware": "hardware",
    "/api/v1/health": "health",
    "/api/v1/agent/": "agent",
    "/api/v1/enrollment-tokens": "enrollment",
    "/api/v1/agent-credentials": "enrollment",
    "/api/v1/agent-streams": "enrollment",
    "/api/v1/webhooks": "webhooks",
    "/metrics": "metrics",
    "/api/v1/sd/": "discovery",
}
# Longer prefixes first: lease and decommission routes live under /hardware/nodes/{id}/.
_SUBTAGS = {"/leases": "leases", "/decommission": "decommission"}

_WIRE_PREFIX = "AgentReport"


# Handlers whose name alone is not a verb phrase a client generator could use.
_OPERATION_IDS = {
    "health": "getHealth",
    "live": "getLiveness",
    "refresh": "refreshLocalHost",
    "metrics": "getMetrics",
    "enroll": "enrollAgent",
    "report": "publishReport",
    "preview": "previewDecommission",
    "execute": "decommissionNode",
}


def operation_id(handler_name: str) -> str:
    """`list_nodes` -> `listNodes`: the handler's name is the operation's name."""
    if handler_name in _OPERATION_IDS:
        return _OPERATION_IDS[handler_name]
    head, *rest = handler_name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def tag_of(path: str) -> str | None:
    for marker, tag in _SUBTAGS.items():
        if marker in path and path.startswith("/api/v1/hardware/nodes/"):
            return tag
    for prefix, tag in OPERATION_TAGS.items():
        if path.startswith(prefix):
            return tag
    return None


def _problem_response(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}},
    }


_PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "Problem",
    "description": "RFC 9457 problem details",
    "required": ["type", "title", "status", "detail"],
    "properties": {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "errors": {"type": "array", "items": {"type": "string"}},
        "instance": {"type": "string"},
    },
}

_DESCRIPTIONS = {
    "400": "Invalid request: an unknown or malformed parameter, a body outside the schema",
    "401": "No valid bearer token",
    "403": "The token may not do this (a viewer token on a write, a credential of another node)",
    "404": "No such resource",
    "409": "Conflict with the current state (a stale version, a held lease, a refused sequence)",
    "410": "The node is decommissioned",
    "413": "Request body too large",
    "503": "The database is unreachable right now (Retry-After)",
}


def _statuses(path: str, method: str, operation: dict[str, Any]) -> list[str]:
    """Which problems a route can answer, by what it is: every route refuses bad input; a
    secured one refuses missing and out-of-scope tokens; one with a body refuses a too-large one;
    a route naming a resource can miss it; a write can conflict or meet a decommissioned node;
    everything but the process's liveness needs the database."""
    statuses = ["400"]
    if operation.get("security"):
        statuses += ["401", "403"]
    writes = method == "post"
    if "{" in path or path.startswith("/api/v1/agent/"):
        statuses.append("404")
    if writes:
        statuses += ["409", "410", "413"]
    if path != "/api/v1/health/live":
        statuses.append("503")
    return statuses


def _report_body() -> tuple[dict[str, Any], dict[str, Any]]:
    """The agent report's JSON Schema, from the protocol's own wire Structs (what decode_report
    checks), its components renamed under one prefix so they cannot collide with the API's (and
    msgspec's names for generic Structs, which spell out the type, become short ones)."""
    from agent.protocol import PROTOCOL_VERSION, STREAMS, WIRE_REPORT

    marker = "#/components/schemas/\x01"
    (schema,), components = msgspec.json.schema_components([WIRE_REPORT], ref_template=marker + "{name}")
    names: dict[str, str] = {}
    for i, name in enumerate(components):
        plain = name.lstrip("_")
        names[name] = _WIRE_PREFIX + (f"Known{i}" if plain.startswith("Known_") else plain)
    text = json.dumps([schema, components])
    for old, new in names.items():
        text = text.replace(json.dumps(marker + old)[1:-1], "#/components/schemas/" + new)
    schema, components = json.loads(text)
    renamed = {names[name]: value for name, value in components.items()}
    # One protocol version is spoken and two streams exist (checked by the service, which names
    # them in its refusal): say so, rather than let a client guess.
    report = renamed[_WIRE_PREFIX + "Report"]["properties"]
    report["protocol"] = {"const": PROTOCOL_VERSION}
    report["stream"] = {"enum": list(STREAMS)}
    return schema, renamed


def _strict_structs() -> set[str]:
    """Names of the Structs that refuse unknown fields (every request body), whose schemas must
    then say `additionalProperties: false`: Litestar leaves it open, so a client would believe
    extra fields are welcome."""
    seen: dict[str, bool] = {}
    pending = list(msgspec.Struct.__subclasses__())
    while pending:
        kind = pending.pop()
        pending.extend(kind.__subclasses__())
        strict = bool(kind.__struct_config__.forbid_unknown_fields)
        name = kind.__name__
        # A name two Structs share is left alone unless both are strict.
        seen[name] = seen.get(name, strict) and strict
    return {name for name, strict in seen.items() if strict}


def corrected(document: dict[str, Any]) -> dict[str, Any]:
    """The generated document, completed where Litestar cannot know: tags, the problems each
    route answers, the report's body (the route reads raw bytes to check its token first), and
    the report's bearer (a node credential)."""
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas["Problem"] = _PROBLEM_SCHEMA
    strict = _strict_structs()
    for name, schema in schemas.items():
        if name in strict and schema.get("type") == "object":
            schema["additionalProperties"] = False
    tags: set[str] = set()
    for path, item in document.get("paths", {}).items():
        for method, operation in item.items():
            if not isinstance(operation, dict) or method not in ("get", "post", "put", "patch", "delete"):
                continue
            if path == "/api/v1/agent/reports" and method == "post":
                body, components = _report_body()
                schemas.update(components)
                operation["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": body}},
                }
                operation["security"] = [{"bearer": []}]
            if path == "/api/v1/agent/enroll":
                operation["security"] = [{"bearer": []}]
            request_body = operation.get("requestBody")
            if request_body and any(
                {"type": "null"} in media.get("schema", {}).get("oneOf", [])
                for media in request_body.get("content", {}).values()
            ):
                # `data: X | None = None`: the route takes no body at all as well.
                request_body["required"] = False
            tag = tag_of(path)
            if tag:
                operation["tags"] = [tag]
                tags.add(tag)
            responses = operation.setdefault("responses", {})
            for status in _statuses(path, method, operation):
                responses.setdefault(status, _problem_response(_DESCRIPTIONS[status]))
                if status in responses and "content" in responses[status]:
                    # Litestar's own 400 entry names application/json; errors are problem+json.
                    responses[status]["content"] = _problem_response("")["content"]
    document["tags"] = [{"name": t} for t in sorted(tags)]
    return document


class _CorrectedOpenAPIPlugin(OpenAPIPlugin):
    """Litestar's OpenAPI plugin, serving the corrected document (built on first request)."""

    __slots__ = ()

    def provide_openapi_schema(self) -> dict[str, Any]:
        if not self._openapi_schema:
            self._openapi_schema = corrected(self.provide_openapi().to_schema())
        return self._openapi_schema


def install(app: Litestar) -> None:
    """Make the app's OpenAPI plugin serve the corrected document. Litestar builds the plugin
    itself; the subclass only adds the correction, lazily, so an app that is never asked for its
    document (most tests) never pays for building it."""
    app.plugins.get(OpenAPIPlugin).__class__ = _CorrectedOpenAPIPlugin


def document(app: Litestar) -> dict[str, Any]:
    """The document as /schema/openapi.json serves it."""
    return app.plugins.get(OpenAPIPlugin).provide_openapi_schema()
