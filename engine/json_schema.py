"""JSON schemas as the grammar engine (xgrammar) enforces them: the keywords it enforces (any other is refused
by name rather than silently ignored), and length bounds on the numbers and free strings of a compiled
schema's grammar, so a constrained request never spends its whole `max_tokens` inside one value. Free of torch
and xgrammar, so the producer checks a schema with the same rules the worker compiles it by."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

SCHEMA_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "anyOf", "allOf", "$ref", "$defs", "definitions", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "pattern", "format",
    "minProperties", "maxProperties", "patternProperties", "propertyNames", "title", "description", "default",
    "examples", "$schema", "$id", "$comment",
})  # fmt: skip
FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})  # fmt: skip
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SCHEMA_LISTS = ("prefixItems", "anyOf", "allOf")
SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames")


class GrammarError(ValueError):
    """A constraint the grammar engine cannot enforce (the message names the keyword or the reason)."""


def check_schema(schema: Any, path: str = "schema") -> None:
    """Refuse, by name, any JSON schema keyword (or use of one) that xgrammar would not enforce (it ignores
    some silently: remote `$ref`, unknown `format`s, `multipleOf` on non-integers, an `allOf` of several
    schemas)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarError(f"{path} must be a JSON schema object")
    for key, value in schema.items():
        if key not in SCHEMA_KEYWORDS:
            raise GrammarError(f"unsupported JSON schema keyword {key!r} at {path}")
        _check_use(schema, key, value, path)
        if key in SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_schema(sub, f"{path}.{key}.{name}")
        elif key in SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema(sub, f"{path}.{key}[{i}]")
        elif key in SCHEMA_VALUES:
            check_schema(value, f"{path}.{key}")


def _check_use(schema: dict[str, Any], key: str, value: Any, path: str) -> None:
    """Refuse the uses of an enforced keyword that the grammar would still ignore."""
    if key == "$ref" and not (isinstance(value, str) and (value == "#" or value.startswith("#/"))):
        raise GrammarError(f"$ref {value!r} at {path} is not a local reference ('#/...'); remote schemas "
                           "are not fetched")
    if key == "format" and value not in FORMATS:
        raise GrammarError(f"unsupported JSON schema format {value!r} at {path} (supported: "
                           f"{', '.join(sorted(FORMATS))})")
    if key == "multipleOf" and schema.get("type") != "integer":
        raise GrammarError(f"multipleOf at {path} is enforced only with \"type\": \"integer\"")
    if key == "allOf" and isinstance(value, list) and len(value) > 1:
        raise GrammarError(f"allOf of {len(value)} schemas at {path} is not supported (give one, or merge "
                           "them)")


@dataclass(frozen=True, slots=True)
class JsonBounds:
    """Length bounds on the values of a JSON schema's grammar: digits of a number's integer part, fraction and
    exponent (each), and characters of a string the schema does not bound itself."""

    number_digits: int = 32
    string_chars: int = 8192

    def __post_init__(self) -> None:
        assert self.number_digits >= 1 and self.string_chars >= 1, "bounds must be positive"


RULE = re.compile(r"^(\S+) ::= (.*)$")
CHAR_CLASS = re.compile(r"^\(\((\[[^\]]*\])\)\)$")
UNBOUNDED = re.compile(r"(\[1-9\] )?(?<![\w\]])(\w+)\{(\d+), -1\}")
ANY_DIGITS = re.compile(r"(\[1-9\] )?\[0-9\]\*")
BOUNDED_STRING = (
    'basic_string ::= (("\\"" basic_string_char{{0, {n}}} "\\""))\n'
    'basic_string_char ::= (([^\\0-\\x1f\\"\\\\\\r\\n]) | ("\\\\" basic_escape))'
)


def bound_grammar(ebnf: str, bounds: JsonBounds) -> str:
    """A JSON schema's grammar (xgrammar's EBNF) with every unbounded run of digits or characters bounded: a
    number has at most `number_digits` digits in each part, a free string at most `string_chars` characters;
    `pattern` regexes and the schema's own `maxLength` stay as given."""
    rules = [RULE.match(line) for line in ebnf.splitlines()]
    char_rules = {m.group(1) for m in rules if m and CHAR_CLASS.match(m.group(2))}
    digit_rules = {m.group(1) for m in rules if m and m.group(2) == "(([0-9]))"}
    char_rules -= digit_rules
    out = []
    for line, match in zip(ebnf.splitlines(), rules, strict=True):
        if match and match.group(1) == "basic_string":
            out.append(BOUNDED_STRING.format(n=bounds.string_chars))
            continue
        if match and not match.group(2).startswith("Regex("):
            line = ANY_DIGITS.sub(lambda m: _digits(m, bounds), line)
            line = UNBOUNDED.sub(lambda m: _bounded(m, digit_rules, char_rules, bounds), line)
        out.append(line)
    return "\n".join(out)


def _digits(match: re.Match, bounds: JsonBounds) -> str:
    """`[0-9]*` bounded (one digit less after a leading `[1-9]`)."""
    lead = match.group(1) or ""
    return f"{lead}[0-9]{{0, {bounds.number_digits - bool(lead)}}}"


def _bounded(match: re.Match, digit_rules: set[str], char_rules: set[str], bounds: JsonBounds) -> str:
    """`name{low, -1}` bounded (one digit less after a leading `[1-9]`), or as it was for other rules."""
    lead, name, low = match.group(1) or "", match.group(2), int(match.group(3))
    if name in digit_rules:
        return f"{lead}{name}{{{low}, {max(low, bounds.number_digits - bool(lead))}}}"
    if name in char_rules:
        return f"{lead}{name}{{{low}, {max(low, bounds.string_chars)}}}"
    return match.group(0)
