"""Request fields: the base of every request model (`RequestModel`: a field it does not know is a 400 naming it, or,
under `unknown_fields: warn`, dropped and logged once), fields refused by name, content parts a text-only model
refuses, and a validation error as a 400 naming the field as the client wrote it."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, model_validator

from serve_app.http.protocols.errors import ProtocolError, invalid

logger = logging.getLogger(__name__)

UnknownFields = Literal["reject", "warn"]
Body = TypeVar("Body", bound=BaseModel)

# Under `warn`, each (model, field) is logged once; past this many distinct ones, no more are remembered or logged
# (a client sending random names must not grow the set without bound).
_MAX_WARNED = 1024
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


class RequestModel(BaseModel):
    """A part of a request body: strict, as OpenAI's API is (an unknown argument is a 400). Validated with the
    context `{"unknown_fields": "warn"}`, unknown fields are dropped instead and each is logged once, as vLLM does."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _unknown_fields(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict) or not info.context or info.context.get("unknown_fields") != "warn":
            return data
        known = _known_names(cls)
        unknown = [name for name in data if name not in known]
        if not unknown:
            return data
        for name in unknown:
            _warn_once(cls.__name__, str(name))
        return {name: value for name, value in data.items() if name in known}


def _known_names(model: type[BaseModel]) -> frozenset[str]:
    names = set()
    for name, field in model.model_fields.items():
        names.add(field.alias or name)
        if model.model_config.get("populate_by_name") or field.alias is None:
            names.add(name)
    return frozenset(names)


def _warn_once(model: str, field: str) -> None:
    key = (model, field[:64])
    with _warned_lock:
        if key in _warned or len(_warned) >= _MAX_WARNED:
            return
        _warned.add(key)
    logger.warning("ignored the unknown request field %r (in %s): unknown_fields is warn", key[1], model)


# Content parts a text-only model cannot read, by their `type`.
NOT_TEXT = {
    "image_url": "images", "input_audio": "audio", "file": "files", "input_image": "images", "input_file": "files",
    "image": "images", "document": "documents",
}


def text_only(parts: Any, text_types: tuple[str, ...]) -> Any:
    """A message's content parts, refusing the kinds a text-only model cannot read by what they are."""
    if isinstance(parts, list):
        for index, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in NOT_TEXT:
                raise ValueError(f"part {index} is {kind}: this model takes text only, not {NOT_TEXT[kind]}")
            if kind is not None and kind not in text_types:
                raise ValueError(f"part {index} is {kind!r}: a part here is one of {', '.join(text_types)}")
    return parts


def validate_body(model: type[Body], body: Any, unknown: UnknownFields = "reject") -> Body:
    """A JSON body as `model`: 400 when it is not an object or a field is wrong or (under `reject`) unknown."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return validate_part(model, body, "", unknown)


def validate_part(model: type[Body], value: Any, prefix: str, unknown: UnknownFields = "reject") -> Body:
    """A part of a body (at `prefix`, e.g. `input.3.`) as `model`, its errors named from the body's root."""
    try:
        return model.model_validate(value, context={"unknown_fields": unknown})
    except ValidationError as error:
        raise from_validation_error(error, prefix) from None


def refuse_fields(body: Any, refused: Mapping[str, str], accepted: Mapping[str, tuple[Any, ...]] | None = None) -> Any:
    """A 400 naming the first field of `refused` that `body` sets: a field of the API that this server does not
    implement is refused, never silently ignored. Null, and the values of `accepted` (what the field means when
    unset, which is what this server does), count as unset: the body is returned without them."""
    if not isinstance(body, dict):
        return body
    accepted = accepted or {}
    for name, reason in refused.items():
        value = body.get(name)
        if value is not None and value not in accepted.get(name, ()):
            raise invalid(f"{name}: {reason}", name)
    return {name: value for name, value in body.items() if name not in refused}


def from_validation_error(error: ValidationError, prefix: str = "") -> ProtocolError:
    """A validation error as a 400 naming its field as the client wrote it (`messages.0.content`): of pydantic's
    errors, the one whose field lies deepest (in a union, the member that matched furthest), its path without
    the union members' tags."""
    details = error.errors()
    paths = [[str(part) for part in d.get("loc", ()) if not _is_union_tag(part)] for d in details]
    deepest = max(range(len(details)), key=lambda i: (len(paths[i]), -i))
    detail, path = details[deepest], paths[deepest]
    if detail.get("type") == "extra_forbidden":
        message = "unrecognized field: this API has no such field here (check its spelling)"
    else:
        message = str(detail.get("msg", "invalid value")).removeprefix("Value error, ")
        named = _NAMED.match(message)  # a model's own check names the field it concerns: "tool_calls: ..."
        if named is not None:
            path, message = [*path, named.group(1)], named.group(2)
    location = ".".join(path)
    param = f"{prefix}{location}" if location else (prefix.rstrip(".") or None)
    return invalid(f"{param}: {message}" if param else message, param)


_NAMED = re.compile(r"^([a-z_][a-z0-9_]*): (.+)$", re.DOTALL)


# Pydantic names a union's member in an error's location by its type: `str`, `list[TextPart]`, `TextBlock`,
# `function-after[...]`. Field names in these APIs are snake_case, never one of these.
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "bytes"})


def _is_union_tag(part: Any) -> bool:
    if not isinstance(part, str):
        return False
    return part in _TYPE_NAMES or "[" in part or part[:1].isupper()
