"""Corrections to the generated OpenAPI document, so it describes what the API really sends.

Litestar renders a union holding both `int` and `float` (a known fact's value,
`bool | int | float | str`) as `oneOf [..., integer, number, ...]`; in JSON Schema every integer is
also a number, so an integer matches two branches and `oneOf` fails for every integer a response
carries. For the msgspec Structs with such a field, this plugin writes the union without `int`
(`number` accepts integers): exactly one branch matches any value.
"""

from __future__ import annotations

import functools
import operator
import types
import typing
from typing import Any, Literal

import msgspec
from litestar._openapi.schema_generation import SchemaCreator
from litestar.openapi.spec import Reference, Schema
from litestar.plugins import OpenAPISchemaPlugin
from litestar.typing import FieldDefinition


def _overlapping(annotation: Any) -> bool:
    if typing.get_origin(annotation) not in (types.UnionType, typing.Union):
        return False
    members = typing.get_args(annotation)
    return int in members and float in members


def _without_int(annotation: Any) -> Any:
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
