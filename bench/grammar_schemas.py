"""JSON schemas of the kinds structured-output users send: objects, enums, bounded integers, arrays, nesting,
anyOf."""

from __future__ import annotations

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"mood": {"enum": ["merry", "sad", "wrathful"]},
                                      "act": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["mood", "act"], "additionalProperties": False},
    {"type": "object", "properties": {"lines": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                "maxItems": 3}},
     "required": ["lines"], "additionalProperties": False},
    {"type": "object", "properties": {
        "speaker": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                                     "noble": {"type": "boolean"}},
                    "required": ["name", "noble"], "additionalProperties": False},
        "scene": {"type": "integer", "minimum": 1, "maximum": 9}},
     "required": ["speaker", "scene"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5},
                                                           {"enum": ["aye", "nay"]}]}},
     "required": ["answer"], "additionalProperties": False},
]
