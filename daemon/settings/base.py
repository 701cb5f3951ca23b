"""What every part of the settings shares: the strict base model, the field types, the
settings error, and per-field errors for validators that check several fields at once.

A validator that finds problems in named fields raises :func:`field_errors`: one
:class:`pydantic_core.PydanticCustomError` per problem, each at its field's location, so the
error a user reads names ``kafka.sasl_username`` rather than ``kafka`` (pydantic puts the
location of the model in front of them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from lpcal.errors import InputError
from lpcal.p_norm import parse_p

__all__ = ["MIB", "NonNegFloat", "NonNegInt", "PNorm", "PosFloat", "PosInt", "Prob",
           "SettingsError", "Strict", "field_errors"]

MIB = 1 << 20


class SettingsError(ValueError):
    """Invalid settings; ``str(e)`` lists every bad field as ``path: reason`` lines."""

    def __init__(self, message: str, errors: list[tuple[str, str]] | None = None):
        super().__init__(message)
        self.errors = errors or []


#: The ``type`` of the errors raised by :func:`field_errors` (and by the ``p`` validator).
ERROR_TYPE = "lpcal_setting"


def field_errors(model: str, problems: Iterable[tuple[tuple[str | int, ...], str]],
                 value: Any = None) -> None:
    """Raise ``problems``, ``(location, reason)`` pairs with the location of a field inside
    the model being validated (``()``: the model itself), as one :class:`ValidationError` of
    one :class:`PydanticCustomError` each; return when there are none. ``model`` names the
    model in the error's title; ``value`` is the input each error reports."""
    line_errors = [InitErrorDetails(type=PydanticCustomError(ERROR_TYPE, "{reason}",
                                                             {"reason": reason}),
                                    loc=tuple(loc), input=value)
                   for loc, reason in problems]
    if line_errors:
        raise ValidationError.from_exception_data(model, line_errors)


# --------------------------------------------------------------------------- field types


def _upper(v: Any) -> Any:
    return v.strip().upper() if isinstance(v, str) else v


def _lower(v: Any) -> Any:
    return v.strip().lower() if isinstance(v, str) else v


def _p(v: Any) -> float:
    """:func:`lpcal.p_norm.parse_p`, its message as the field's error."""
    try:
        return parse_p(v)
    except InputError as e:
        raise PydanticCustomError(ERROR_TYPE, "{reason}", {"reason": str(e)}) from None


Upper = BeforeValidator(_upper)
Lower = BeforeValidator(_lower)
Prob = Annotated[float, Field(gt=0.0, lt=1.0)]
#: The ``p`` of ``Err_p``: :func:`lpcal.p_norm.parse_p`, the domain (:data:`lpcal.p_norm.P_DOMAIN`)
#: the library and CLI use.
PNorm = Annotated[float, BeforeValidator(_p)]
PosInt = Annotated[int, Field(gt=0)]
PosFloat = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
NonNegInt = Annotated[int, Field(ge=0)]


class Strict(BaseModel):
    """A settings section: unknown keys are errors, defaults are validated too."""

    model_config = ConfigDict(extra="forbid", validate_default=True, ser_json_inf_nan="strings")
