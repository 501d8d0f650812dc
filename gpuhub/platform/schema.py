"""Request bodies as declared models, and one clear 400 message per bad body.

pydantic (v2), not jsonschema: models give handlers typed attributes instead of dict lookups, and
validators sit next to the fields they check; both are pinned in the runtime set anyway.

Models are strict (``"1"`` is not an int, ``true`` is not a number, ``1.0`` is not an int) and
ignore unknown fields. A field with a default of ``None`` may be left out but not sent as ``null``.
Messages name the field, and the list element when there is one::

    missing field 'name'
    field 'gpus' must be of type int
    replicas[1]: field 'id' must be a number
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import PydanticCustomError

# pydantic's error types for a value of the wrong JSON type -> the Python type the message names
_TYPE_NAMES = {"int_type": "int", "string_type": "str", "dict_type": "dict", "list_type": "list",
               "model_type": "dict", "bool_type": "bool", "float_type": "float"}
_INVALID = "gpuhub_invalid"


class Body(BaseModel):
    """Base of every request body model."""

    model_config = ConfigDict(strict=True, extra="ignore")


def invalid(message: str) -> PydanticCustomError:
    """Raise this from a validator: ``message`` is the 400's text as it is (after the list element
    it is about, if any: ``replicas[1]: …``)."""
    return PydanticCustomError(_INVALID, "{message}", {"message": message})


class BodyError(ValueError):
    """A body that does not fit its model; ``str()`` is the message for the client."""


def parse(model: type[Body], body: Any) -> Body:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise BodyError(describe(exc.errors()[0])) from None


def describe(error: dict) -> str:
    """One pydantic error as the message the API has always given."""
    loc = error["loc"]
    last_index = max((i for i, part in enumerate(loc) if isinstance(part, int)), default=-1)
    where = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p)
                    for i, p in enumerate(loc[:last_index + 1]))
    name = ".".join(str(p) for p in loc[last_index + 1:])
    kind = error["type"]
    if kind == _INVALID:
        message = error["ctx"]["message"]
    elif kind == "missing":
        message = f"missing field {name!r}"
    elif not name and kind == "model_type":
        return f"{where} must be an object"
    elif kind == "int_type" and isinstance(error["input"], bool):
        message = f"field {name!r} must be a number"  # JSON true is not 1
    elif kind in _TYPE_NAMES:
        message = f"field {name!r} must be of type {_TYPE_NAMES[kind]}"
    else:  # a constraint a model declared without invalid(): still name the field
        message = f"field {name!r}: {error['msg']}"
    return f"{where}: {message}" if where else message
